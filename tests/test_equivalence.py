"""Data parallelism changes where the arithmetic runs, not its result.

One optimizer step of DDP over N processes, each on its b samples, must leave the same gradients and
weights as one process on all N*b samples. Dropout is switched off (eval mode; BasicNet has no
batch norm), because each rank draws its own masks and the single process draws different ones.
The step is plain SGD: its update is linear in the gradient, so float rounding in the all-reduce
stays at rounding size. (Adam's first update, g / (|g| + eps), turns a 1e-9 rounding of a gradient
near zero into a visible change of the weight, which says nothing about DDP.)
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import per_process_batch
from common.mnist import BasicNet
from common.spawn import run_in_process_group

GLOBAL_BATCH = 12


def fixed_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=generator), torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)


def one_step(model, images, labels):
    """Forward, loss, backward, SGD step; returns the gradients the step used."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.eval()
    F.nll_loss(model(images), labels).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return grads


def single_process_reference():
    torch.manual_seed(0)
    model = BasicNet()
    grads = one_step(model, *fixed_batch())
    return grads, [p.detach().clone() for p in model.parameters()]


def ddp_worker(rank, world_size, out_dir, sync=True):
    torch.manual_seed(0 if rank == 0 else 1000 + rank)  # other ranks start elsewhere: DDP must copy rank 0's weights
    model = DDP(BasicNet())
    images, labels = fixed_batch()
    b = per_process_batch(GLOBAL_BATCH, world_size)
    with contextlib.nullcontext() if sync else model.no_sync():
        grads = one_step(model, images[rank * b:(rank + 1) * b], labels[rank * b:(rank + 1) * b])
    torch.save({"grads": grads, "params": [p.detach() for p in model.parameters()]}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_step_equals_single_process_on_the_global_batch(tmp_path, world_size):
    run_in_process_group(ddp_worker, world_size, str(tmp_path))
    reference_grads, reference_params = single_process_reference()
    for rank in range(world_size):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for got, want in zip(result["grads"], reference_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        for got, want in zip(result["params"], reference_params):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_check_fails_when_gradients_are_not_averaged(tmp_path):
    """The check above can fail: the same DDP step with gradient sync off (no_sync) leaves each rank
    its own half-batch gradients, which are not the global ones."""
    run_in_process_group(ddp_worker, 2, str(tmp_path), False)
    reference_grads, _ = single_process_reference()
    result = torch.load(tmp_path / "rank0.pt")
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(result["grads"], reference_grads))
