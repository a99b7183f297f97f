"""Samplers for exact distributed evaluation, and for resuming training in the middle of an epoch.

torch's DistributedSampler pads the index list with repeats until it divides by the world size
(10000 test images over 7 ranks -> 10003), so an accuracy computed from it counts some images twice.
DistributedEvalSampler gives rank r the indices r, r+N, r+2N, ... and nothing more: across the ranks
every index appears exactly once, whatever the dataset size and world size.

Use it for evaluation only. Ranks then hold different numbers of samples, hence of batches, and in
training DDP's all-reduce in backward would wait forever for the rank that ran out of batches first.
"""
import itertools
import math

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


class DistributedEvalSampler(Sampler[int]):
    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = False, seed: int = 0):
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset_size = len(dataset)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def __iter__(self):
        if self.shuffle:  # the same permutation on every rank: seeded by seed + epoch alone
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = range(self.dataset_size)
        return iter(order[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Same contract as DistributedSampler.set_epoch: a new shuffle order each epoch."""
        self.epoch = epoch


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler whose position is (epoch, batches done), so a resumed epoch continues exactly.

    A run that stops after b batches of epoch e resumes with set_epoch(e, batches_done=b): the same
    shuffle as before (it depends on seed and epoch only), minus this rank's first b batches, which are
    skipped as indices and so never loaded. Starting the epoch over instead would train twice on those
    batches and change the weights. The next set_epoch(e + 1) starts the following epoch at its first batch.
    """

    def __init__(self, dataset, batch_size: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.batch_size, self.batches_done = batch_size, 0

    def set_epoch(self, epoch: int, batches_done: int = 0) -> None:
        super().set_epoch(epoch)
        self.batches_done = batches_done

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a whole epoch on this rank, the skipped ones included."""
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.batches_done * self.batch_size, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.batches_done * self.batch_size, 0)
