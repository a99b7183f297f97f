"""Each hand-written all-reduce equals dist.all_reduce under real gloo groups of 2, 3 and 4 processes."""
import pytest
import torch
import torch.distributed as dist

from common.lessons.allreduce import ALGORITHMS, bytes_sent_per_rank, ring_all_reduce
from common.spawn import run_in_process_group

SIZES = [1, 2, 5, 7, 1000, 4099]  # several smaller than the world size, most not divisible by it
DTYPES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}


def check_all_algorithms(rank, world_size):
    for name, algorithm in ALGORITHMS.items():
        for size in SIZES:
            for dtype, tolerance in DTYPES.items():
                for op in ("sum", "avg"):
                    generator = torch.Generator().manual_seed(1000 * rank + size)
                    mine = torch.randn(size, generator=generator, dtype=torch.float64).to(dtype)
                    expected = mine.clone()
                    dist.all_reduce(expected)
                    if op == "avg":
                        expected /= world_size
                    got = algorithm(mine.clone(), op=op)
                    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance,
                                               msg=lambda m: f"{name} {dtype} size {size} {op}: {m}")
                    everyone = [torch.empty_like(got) for _ in range(world_size)]
                    dist.all_gather(everyone, got)
                    assert all(torch.equal(other, got) for other in everyone), f"{name}: ranks disagree"
        matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)  # not contiguous
        result = algorithm(matrix, op="sum")
        assert result is matrix
        torch.testing.assert_close(matrix, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world_size + 1)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_algorithm_equals_dist_all_reduce(world_size):
    run_in_process_group(check_all_algorithms, world_size, timeout=180)


def test_unknown_op_is_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="op must be one of"):
        ring_all_reduce(torch.ones(4), op="max")  # no process group: it must not get as far as sending


def test_cost_model():
    assert bytes_sent_per_rank("ring", 1000, 4) == 1500
    assert bytes_sent_per_rank("all_to_all", 1000, 4) == 3000
    assert bytes_sent_per_rank("ring", 1000, 2) == 1000
