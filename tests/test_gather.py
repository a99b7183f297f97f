"""The gather utilities under real 2- and 3-process gloo groups, with per-rank lengths that differ."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from common.gather import drop_sampler_padding, gather_uneven, sum_across_ranks
from common.spawn import run_in_process_group


def check_gathers(rank, world_size):
    # rank r holds r + 1 rows whose values name the rank and the row
    mine = torch.stack([torch.tensor([rank, row], dtype=torch.float32) for row in range(rank + 1)])
    expected = torch.cat([torch.stack([torch.tensor([r, row], dtype=torch.float32) for row in range(r + 1)])
                          for r in range(world_size)])
    assert torch.equal(gather_uneven(mine), expected)
    to_last = gather_uneven(mine, dst=world_size - 1)
    if rank == world_size - 1:
        assert torch.equal(to_last, expected)
    else:
        assert to_last is None
    empty_on_rank_0 = torch.arange(rank * 2, dtype=torch.int64)
    assert gather_uneven(empty_on_rank_0).tolist() == [i for r in range(world_size) for i in range(r * 2)]

    correct, seen, loss = sum_across_ranks(rank + 1, 10 * (rank + 1), 0.5, device="cpu")
    n = world_size * (world_size + 1) // 2
    assert (correct, seen) == (n, 10 * n) and isinstance(seen, int)
    assert loss == pytest.approx(0.5 * world_size)

    for dataset_size in (10, 11, 13):  # none divisible by 3, two not by 2
        for shuffle in (False, True):
            sampler = DistributedSampler(range(dataset_size), shuffle=shuffle, seed=7)
            mine = torch.tensor(list(sampler))  # a "prediction" per sample: its own index
            gathered = gather_uneven(mine)
            assert len(gathered) >= dataset_size  # padded
            kept = drop_sampler_padding(gathered, world_size, dataset_size)
            assert sorted(kept.tolist()) == list(range(dataset_size))
            if not shuffle:
                assert kept.tolist() == list(range(dataset_size))
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathers_in_a_real_process_group(world_size):
    run_in_process_group(check_gathers, world_size)


def test_without_a_process_group_gathers_are_identity():
    t = torch.arange(5)
    assert gather_uneven(t) is t
    assert sum_across_ranks(3, 4, device="cpu") == [3, 4]


def test_drop_sampler_padding_rejects_unequal_parts():
    with pytest.raises(ValueError, match="equal per-rank parts"):
        drop_sampler_padding(torch.arange(7), world_size=2, dataset_size=7)
