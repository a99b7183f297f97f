"""A random augmentation, done in the DataLoader's workers, that a resumed run draws again sample for sample.

A DataLoader worker seeds torch, random and NumPy with base_seed + its worker id, base_seed drawn from the
loader's generator at iter(). A transform that draws from those generators gives a sample the next numbers
of its worker's stream, which depend on which worker loads the sample and on how many that worker loaded
before it. A run resumed mid-epoch starts its workers afresh at the first batch it has not trained on, so
every later sample would draw other numbers than in the run that was never stopped (and at another
--num-workers or world size, other workers load it). Here a sample's shift comes from a generator seeded
by (seed, epoch, index): what the checkpoint already holds decides it, whichever worker, rank or restart
loads the sample.
"""
import numpy as np
import torch
from torch.utils.data import Dataset


class RandomShift(Dataset):
    """The images of `dataset` rolled by up to `pixels` rows and columns (MNIST's digits sit in a 20-pixel
    box in the middle of 28, so what wraps round is background); with pixels=0 they pass unchanged."""

    def __init__(self, dataset: Dataset, pixels: int, seed: int):
        self.dataset, self.pixels, self.seed = dataset, pixels, seed
        self.collate = getattr(dataset, "collate", None)
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # persistent workers read what set_epoch writes

    def set_epoch(self, epoch: int) -> None:
        """Before the epoch's iter(), as for the sampler: the workers receive their first indices only then."""
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def shift(self, image: torch.Tensor, index: int) -> torch.Tensor:
        if not self.pixels:
            return image
        rows, columns = np.random.default_rng([self.seed, int(self.epoch), index]).integers(-self.pixels, self.pixels + 1, 2)
        return torch.roll(image, shifts=(int(rows), int(columns)), dims=(-2, -1))

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return self.shift(image, index), label

    def __getitems__(self, indices):
        """A whole batch at once where the dataset loads one (common/mnist.py's tensors), else sample by sample."""
        if not self.pixels and hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__(indices)
        if not hasattr(self.dataset, "__getitems__"):
            return [self[index] for index in indices]
        images, labels = self.dataset.__getitems__(indices)
        return torch.stack([self.shift(image, index) for image, index in zip(images, indices)]), labels
