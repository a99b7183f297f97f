"""Random augmentation drawn in the DataLoader's workers, each worker from a generator of its own.

Most training code draws an augmentation in the worker that loads the sample, from whatever generator is
at hand there. Whether that is right depends on where the generator was made:
  - in the dataset's __init__ (the trap): every worker gets a copy of the same generator, pickled or
    forked with the dataset, so worker 1 repeats worker 0's draws; and every rank built the dataset with
    the same seed, so rank 1 repeats rank 0's. A quarter of the "random" augmentations of 2 ranks of 2
    workers are then all there is;
  - in each worker, from the seed the DataLoader gives it: at iter() the loader draws one base seed from
    its `generator`, and worker w seeds torch, Python's `random` and NumPy's global state with
    base_seed + w before it loads anything (torch.utils.data._utils.worker._worker_loop; torch.initial_seed()
    in the worker returns it). seed_worker, the loader's worker_init_fn, makes the worker's own generator
    from that seed. With the loader's generator seeded from (seed, rank, epoch) at the start of each epoch,
    every worker of every rank draws its own numbers, and the same ones in a rerun.
A resumed run must then give each worker back where its generator was: tests/test_data_pipeline.py shows
a rung that replays the epoch's first batches through the workers (src/ch4/data_pipeline/mnist_workers.py)
and one whose loader keeps the workers' states in the checkpoint (mnist_stateful.py).
"""
import os
import random
import sys

import torch
from torch.utils.data import Dataset, get_worker_info

from common.stop_signal import leave_signals_to_the_rank


def loader_seed(seed: int, rank: int, epoch: int) -> int:
    """One number per (seed, rank, epoch): ranks and epochs differ, a rerun is the same."""
    return random.Random(f"{seed} {rank} {epoch}").getrandbits(63)


def warn_if_oversubscribed(num_workers: int, local_world_size: int) -> None:
    """One warning where each rank's workers are more than this machine has cores per rank: the workers then
    take turns on the cores with the training processes, which slows the step they are meant to feed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_rank = max(cores // local_world_size, 1)
    if num_workers > per_rank and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"warning: --num-workers {num_workers} on each of {local_world_size} processes is more than the "
              f"{cores} cores of this machine give each ({per_rank}); pass --num-workers {per_rank} or fewer "
              "(docs/data_pipeline.md measures what more costs)", file=sys.stderr, flush=True)


def seed_epoch(loader, seed: int, rank: int, epoch: int) -> None:
    """Before the epoch's iter(): the base seed its workers get, and the generator of a loader without workers."""
    value = loader_seed(seed, rank, epoch)
    loader.generator.manual_seed(value)
    loader.dataset.generator.manual_seed(value)


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: this worker's generator, from the seed the DataLoader gave the worker (base + id);
    and a process group of its own, so that a stop signal to the rank's group is the rank's alone."""
    leave_signals_to_the_rank()
    info = get_worker_info()
    info.dataset.generator = torch.Generator().manual_seed(info.seed)


class WorkerShift(Dataset):
    """The images of `dataset` rolled by up to `pixels` rows and columns, each shift drawn from the generator
    of the process that loads the image: a worker's own (seed_worker), or the main process's without workers.

    Its state_dict is that generator's state: a stateful loader (torchdata's StatefulDataLoader) collects it
    from each worker with each batch and gives it back to the same worker on resume."""

    def __init__(self, dataset: Dataset, pixels: int):
        self.dataset, self.pixels = dataset, pixels
        self.collate = getattr(dataset, "collate", None)
        self.generator = torch.Generator()  # the main process's; each worker replaces its copy (seed_worker)

    def __len__(self):
        return len(self.dataset)

    def shift(self, image: torch.Tensor) -> torch.Tensor:
        if not self.pixels:
            return image
        rows, columns = torch.randint(-self.pixels, self.pixels + 1, (2,), generator=self.generator).tolist()
        return torch.roll(image, shifts=(rows, columns), dims=(-2, -1))

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return self.shift(image), label

    def __getitems__(self, indices):
        """A whole batch at once where the dataset loads one (common/mnist.py's tensors), else sample by sample."""
        if not hasattr(self.dataset, "__getitems__"):
            return [self[index] for index in indices]
        images, labels = self.dataset.__getitems__(indices)
        return torch.stack([self.shift(image) for image in images]), labels

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
