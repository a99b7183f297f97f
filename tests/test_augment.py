"""The resume rungs' random augmentation (common/augment.py), with 2 DataLoader workers: a loader started
afresh mid-epoch, as a resumed run starts it, shifts every later image as the loader that never stopped
did. The trap beside it: shifts drawn from each worker's own generator, as most examples draw them, are
not drawn again after such a restart (the negative control). The whole runs, killed and resumed at 3
processes with --num-workers 2 --augment 2, are tests/test_resume.py's."""
from pathlib import Path

import pytest
import torch

from common.augment import RandomShift
from common.mnist import MNISTTensors, mnist_loader
from common.samplers import ResumableDistributedSampler

BATCH, DONE = 11, 66  # rank 1 of 3, global batches of 33; the restart comes 2 global batches into epoch 1


class WorkerShift(RandomShift):
    """The trap: each shift drawn from the generator of the worker that loads the image."""

    def shift(self, image, index):
        rows, columns = torch.randint(-self.pixels, self.pixels + 1, (2,)).tolist()
        return torch.roll(image, shifts=(rows, columns), dims=(-2, -1))


def epoch_batches(dataset, epochs, samples_done=0):
    """Rank 1's batches of the last of `epochs`, from one loader with 2 persistent workers, as a rung makes it."""
    sampler = ResumableDistributedSampler(dataset, BATCH, num_replicas=3, rank=1, seed=0)
    loader = mnist_loader(dataset, BATCH, sampler, num_workers=2, generator=torch.Generator())
    for epoch in epochs:
        sampler.set_epoch(epoch, samples_done if epoch == epochs[-1] else 0)
        dataset.set_epoch(epoch)
        batches = [images for images, _ in loader]
    return batches


@pytest.fixture(scope="module")
def images(tiny_mnist):
    return MNISTTensors(Path(tiny_mnist) / "MNIST" / "raw", train=True)


@pytest.mark.parametrize("kind, same", [(RandomShift, True), (WorkerShift, False)])
def test_a_loader_restarted_mid_epoch_shifts_the_images_as_before(images, kind, same):
    never_stopped = epoch_batches(kind(images, 2, seed=0), [0, 1])
    restarted = epoch_batches(kind(images, 2, seed=0), [1], samples_done=DONE)
    assert len(restarted) == len(never_stopped) - DONE // (3 * BATCH)
    assert all(torch.equal(a, b) for a, b in zip(restarted, never_stopped[-len(restarted):])) == same
    unshifted = epoch_batches(RandomShift(images, 0, seed=0), [0, 1])
    assert not any(torch.equal(a, b) for a, b in zip(never_stopped, unshifted))  # every batch is augmented
