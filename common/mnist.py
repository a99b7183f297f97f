"""MNIST for the chapter: the BasicNet CNN and two ways to feed it.

The fast way (default) decodes the idx files once, normalizes all 70 000 images into one tensor, and
builds each batch with a single indexing operation. The classic way (--loader classic) is the one in
most tutorials: a PIL image per sample through ToTensor and Normalize, then a collate that stacks 64 of
them. Both go through a DataLoader with a sampler, so DistributedSampler slots in the same way.
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms

from common.distributed import main_process_first

MEAN, STD = 0.1307, 0.3081  # over the 60 000 training images


class BasicNet(nn.Module):
    """Two convolutions and two linear layers: 1.2 M parameters, ~99% test accuracy after one epoch."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class MNISTTensors(Dataset):
    """All images of one split as a single normalized float tensor of shape (N, 1, 28, 28)."""

    def __init__(self, split: datasets.MNIST):
        self.images = ((split.data.float() / 255 - MEAN) / STD).unsqueeze(1)
        self.labels = split.targets

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
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    splits = []
    with main_process_first(local_rank):
        for train in (True, False):
            try:
                splits.append(datasets.MNIST(data_dir, train=train, download=True,
                                             transform=transform if loader == "classic" else None))
            except (RuntimeError, OSError) as error:  # torchvision raises RuntimeError after every mirror failed
                raw = Path(data_dir, "MNIST", "raw").resolve()
                sys.exit(f"error: MNIST is not in {raw} and could not be downloaded ({error}); pass "
                         f"--data-dir with a folder that holds MNIST/raw/*-ubyte, e.g. --data-dir path/to/folder.")
    if loader == "classic":
        return splits[0], splits[1]
    return MNISTTensors(splits[0]), MNISTTensors(splits[1])


def make_loader(dataset: Dataset, batch_size: int, sampler, num_workers: int = 0, generator=None) -> DataLoader:
    """A DataLoader over either form of the dataset; the sampler decides which indices this process sees.

    Each iter() of a DataLoader draws a seed for its workers from `generator`, or from the global RNG
    if there is none (even with num_workers=0), which shifts every later dropout mask."""
    collate = dataset.collate if isinstance(dataset, MNISTTensors) else None
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                      num_workers=num_workers, persistent_workers=num_workers > 0, generator=generator)
