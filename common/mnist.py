"""MNIST for the chapter: the BasicNet CNN and two ways to feed it.

The fast way (default) decodes the idx files once, normalizes all 70 000 images into one tensor, and
builds each batch with a single indexing operation; it reads the files itself and imports torchvision
only to download them (0.3 s of every process's start). The classic way (--loader classic) is the one
in most tutorials: a PIL image per sample through ToTensor and Normalize, then a collate that stacks 64
of them. Both go through a DataLoader with a sampler, so DistributedSampler slots in the same way.
"""
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from common.distributed import main_process_first, pin_memory

MEAN, STD = 0.1307, 0.3081  # over the 60 000 training images
RAW_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),  # train=True, as torchvision names them
             False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


class Dropout(nn.Dropout):
    """nn.Dropout, with the mask drawn by torch.rand where the tensor is on a CPU.

    On a CPU, nn.Dropout's bernoulli_ draws its numbers one at a time: 5 ms for the 590 k-element mask of
    one batch of 64 on a 2-core AMD EPYC, a sixth of the training step; torch.rand fills the same mask
    vectorized in 2 ms. The same distribution (each element kept with probability 1 - p, scaled by
    1 / (1 - p)), from the same generator, so a seeded run repeats itself. On a GPU, nn.Dropout's fused
    kernel is the fast one."""

    def forward(self, x):
        if not self.training or x.device.type != "cpu" or self.p == 0:
            return super().forward(x)
        keep = 1 - self.p
        return x * (torch.rand(x.shape) < keep).to(x.dtype).mul_(1 / keep)


class BasicNet(nn.Module):
    """Two convolutions and two linear layers: 1.2 M parameters, ~99% test accuracy after one epoch."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = Dropout(0.25)
        self.dropout2 = Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))  # pool, then ReLU: the same numbers on a quarter of the elements
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def read_idx(path: Path) -> torch.Tensor:
    """An idx file of unsigned bytes: a zero word, the type byte 0x08, the rank, each dimension (big-endian
    32-bit), then the values."""
    data = path.read_bytes()
    rank = data[3] if len(data) > 3 else 0
    shape = np.frombuffer(data, dtype=">u4", count=rank, offset=4) if len(data) >= 4 + 4 * rank else None
    if data[:3] != b"\x00\x00\x08" or shape is None or len(data) != 4 + 4 * rank + int(np.prod(shape)):
        sys.exit(f"error: {path} is not a whole MNIST idx file of unsigned bytes; pass --data-dir with a folder "
                 f"that holds MNIST/raw/*-ubyte as yann.lecun.com's files unpack.")
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(shape).copy())


class MNISTTensors(Dataset):
    """All images of one split as a single normalized float tensor of shape (N, 1, 28, 28)."""

    def __init__(self, raw: Path, train: bool):
        images, labels = (read_idx(raw / name) for name in RAW_FILES[train])
        self.images = ((images.float() / 255 - MEAN) / STD).unsqueeze(1)
        self.labels = labels.long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):
        """DataLoader hands a whole batch of indices here: one gather instead of 64 lookups and a stack."""
        return self.images[indices], self.labels[indices]

    @staticmethod
    def collate(batch):
        return batch  # already (images, labels) of the whole batch


def load_mnist(data_dir: str, loader: str = "tensor", local_rank: int = 0) -> tuple[Dataset, Dataset]:
    """The train and test splits, downloaded into data_dir by local rank 0 if they are not there yet."""
    raw = Path(data_dir, "MNIST", "raw")
    with main_process_first(local_rank):
        if loader == "classic" or not all((raw / name).exists() for names in RAW_FILES.values() for name in names):
            splits = torchvision_splits(data_dir, loader)
    if loader == "classic":
        return splits
    return MNISTTensors(raw, train=True), MNISTTensors(raw, train=False)


def torchvision_splits(data_dir: str, loader: str) -> tuple[Dataset, Dataset]:
    """torchvision's MNIST datasets, which download the files where they are missing; per-sample PIL images
    through ToTensor and Normalize for the classic loader."""
    from torchvision import datasets, transforms
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    try:
        return tuple(datasets.MNIST(data_dir, train=train, download=True,
                                    transform=transform if loader == "classic" else None) for train in (True, False))
    except (RuntimeError, OSError) as error:  # torchvision raises RuntimeError after every mirror failed
        raw = Path(data_dir, "MNIST", "raw").resolve()
        sys.exit(f"error: MNIST is not in {raw} and could not be downloaded ({error}); pass "
                 f"--data-dir with a folder that holds MNIST/raw/*-ubyte, e.g. --data-dir path/to/folder.")


def mnist_loader(dataset: Dataset, batch_size: int, sampler, num_workers: int = 0, generator=None,
                 worker_init_fn=None) -> DataLoader:
    """A DataLoader over either form of the dataset; the sampler decides which indices this process sees.

    Each iter() of a DataLoader draws a seed for its workers from `generator`, or from the global RNG
    if there is none (even with num_workers=0), which shifts every later dropout mask. worker_init_fn runs
    in each worker as it starts (the restartable rungs': leave the stop signals to the rank)."""
    collate = getattr(dataset, "collate", None)  # MNISTTensors' batches come whole
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                      num_workers=num_workers, persistent_workers=num_workers > 0, generator=generator,
                      worker_init_fn=worker_init_fn, pin_memory=pin_memory())
