"""A sampler for exact distributed evaluation.

torch's DistributedSampler pads the index list with repeats until it divides by the world size
(10000 test images over 7 ranks -> 10003), so an accuracy computed from it counts some images twice.
DistributedEvalSampler gives rank r the indices r, r+N, r+2N, ... and nothing more: across the ranks
every index appears exactly once, whatever the dataset size and world size.

Use it for evaluation only. Ranks then hold different numbers of samples, hence of batches, and in
training DDP's all-reduce in backward would wait forever for the rank that ran out of batches first.
"""
import torch
import torch.distributed as dist
from torch.utils.data import Sampler


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
