"""Samplers for exact distributed evaluation, and for resuming training in the middle of an epoch.

torch's DistributedSampler pads the index list with repeats until it divides by the world size
(10000 test images over 7 ranks -> 10003), so an accuracy computed from it counts some images twice.
DistributedEvalSampler gives rank r the indices r, r+N, r+2N, ... and nothing more: across the ranks
every index appears exactly once, whatever the dataset size and world size.

Use it for evaluation only. Ranks then hold different numbers of samples, hence of batches, and in
training DDP's all-reduce in backward would wait forever for the rank that ran out of batches first.
"""
import itertools

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
    """DistributedSampler whose position is a global sample cursor, so that an epoch continues exactly,
    at the world size that stopped it or at another.

    DistributedSampler shuffles the whole dataset with seed + epoch alone, on every rank and at every
    world size, and deals the shuffle out in turn: rank r of N takes positions r, r + N, r + 2N, ...
    With a per-rank batch of B / N, the k-th batches of all ranks together are therefore positions
    [kB, (k + 1)B) of the one shuffle: the global order is the shuffle cut into global batches, and
    the world size only decides which rank trains on which sample of a global batch (and how the
    epoch's last global batch is padded to a multiple of N, with the shuffle's first samples).
    A run that stopped after c samples of epoch e (all ranks together, c a multiple of the global
    batch) resumes with set_epoch(e, samples_done=c): each of the M ranks skips its first c / M
    indices, so the ranks go on at position c of the same shuffle, and every sample of the epoch is
    trained on once, before the stop or after it. Counted per rank instead (this rank's c / N samples),
    the same cursor would skip c·M/N at M ranks: samples lost when M > N, trained twice when M < N.
    """

    def __init__(self, dataset, batch_size: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.batch_size, self.samples_done = batch_size, 0

    @property
    def global_batch(self) -> int:
        """Samples that one step of all ranks together trains on."""
        return self.batch_size * self.num_replicas

    def set_epoch(self, epoch: int, samples_done: int = 0) -> None:
        if samples_done % self.num_replicas:
            raise ValueError(f"{samples_done} samples done do not split evenly over {self.num_replicas} ranks")
        super().set_epoch(epoch)
        self.samples_done = samples_done

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.samples_done // self.num_replicas, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.samples_done // self.num_replicas, 0)
