"""Quantities that must be reduced over ranks the right way for N processes to equal one (docs/reductions.md).

One gloo group of 3 processes (2 would hide non-associativity), float64, runs every check and
returns what rank 0 measured; the tests compare it with one process on the whole global batch, and
each planted wrong way with the same reference, which it must miss.
  - gradient clipping by the total norm: DDP, ZeRO stages 1-3 (common/zero.py), FSDP2, Accelerate;
    the wrong way clips each rank's shards by their own norm.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.fsdp import fully_shard
from common.spawn import run_in_process_group
from common.zero import STAGES, ZeRO
from test_zero import small_model

WORLD_SIZE = 3
PER_RANK = 4
MAX_NORM = 0.1  # well below the gradient's norm, so that clipping scales it
LR = 0.5


def global_batch():
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(WORLD_SIZE * PER_RANK, 7, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (WORLD_SIZE * PER_RANK,), generator=generator)


def rank_batch(rank):
    inputs, labels = global_batch()
    return inputs[rank * PER_RANK:(rank + 1) * PER_RANK], labels[rank * PER_RANK:(rank + 1) * PER_RANK]


def clipping_model():
    torch.manual_seed(0)
    return small_model().double()


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def one_process_clipped():
    """The reference: one process, the whole global batch, torch's clip_grad_norm_, one SGD step."""
    model = clipping_model()
    F.cross_entropy(model(global_batch()[0]), global_batch()[1]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    sgd(model.parameters()).step()
    return norm, [p.detach().clone() for p in model.parameters()]


def full(tensor):
    """A DTensor (FSDP2) in full on every rank; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def clipped_step(rank, wrapper):
    """One step on this rank's slice: forward, backward, clip, SGD. Returns (norm, full parameters)."""
    model = clipping_model()
    inputs, labels = rank_batch(rank)
    if wrapper in ("zero", "zero_local_norm"):
        norms, params = [], []
        for stage in STAGES:
            zero = ZeRO(clipping_model(), stage, sgd)
            F.cross_entropy(zero(inputs), labels).backward()
            if wrapper == "zero":
                norms.append(zero.clip_grad_norm_(MAX_NORM))
            else:  # the planted bug: each rank clips its shards by their own norm
                norms.append(torch.nn.utils.clip_grad_norm_([unit.shard for unit in zero.units], MAX_NORM))
            zero.step()
            params.append(zero.full_parameters())
        return norms, params
    if wrapper == "accelerate":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
        accelerator.backward(F.cross_entropy(model(inputs), labels))
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        if wrapper == "ddp":
            model = DDP(model)
        else:  # FSDP2: each Linear and LayerNorm its own group, then the root
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            fully_shard(model)
        optimizer = sgd(model.parameters())
        F.cross_entropy(model(inputs), labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return norm, [full(p.detach()).clone() for p in model.parameters()]


def clipping(rank):
    results = {wrapper: clipped_step(rank, wrapper) for wrapper in ("ddp", "fsdp2", "accelerate", "zero", "zero_local_norm")}
    fsdp_norm = results["fsdp2"][0]
    results["fsdp2_returns"] = {"type": type(fsdp_norm).__name__, "placements": str(fsdp_norm.placements),
                                "local": fsdp_norm.to_local().clone(), "full": fsdp_norm.full_tensor()}
    results["fsdp2"] = (fsdp_norm.full_tensor(), results["fsdp2"][1])
    return results


def every_check(rank, world_size):
    """Every multi-process check in one group: starting processes is the slow part."""
    return {"clipping": clipping(rank)}


@pytest.fixture(scope="module")
def measured():
    return run_in_process_group(every_check, WORLD_SIZE, timeout=180)


def assert_same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "accelerate"])
def test_clipping_by_the_total_norm_equals_one_process(measured, wrapper):
    norm, params = measured["clipping"][wrapper]
    reference_norm, reference_params = one_process_clipped()
    assert reference_norm > 2 * MAX_NORM  # the clip did scale the gradient
    assert_same(norm, reference_norm)
    for got, want in zip(params, reference_params, strict=True):
        assert_same(got, want)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_clip_grad_norm_equals_one_process(measured, stage):
    norms, params = measured["clipping"]["zero"]
    reference_norm, reference_params = one_process_clipped()
    assert_same(norms[stage - 1], reference_norm)
    for got, want in zip(params[stage - 1], reference_params, strict=True):
        assert_same(got, want)


def test_clipping_shards_by_their_own_norm_fails(measured):
    norms, params = measured["clipping"]["zero_local_norm"]
    reference_norm, reference_params = one_process_clipped()
    for stage in STAGES:
        assert norms[stage - 1] < 0.9 * reference_norm  # rank 0's shards hold only part of the norm
        assert not all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(params[stage - 1], reference_params))


def test_fsdp2_clip_returns_a_replicated_dtensor(measured):
    """torch's clip_grad_norm_ over FSDP2's DTensor parameters already sums the shards' squares over the
    ranks: it returns the total norm as a DTensor replicated on every rank; full_tensor() makes it a tensor."""
    returned = measured["clipping"]["fsdp2_returns"]
    assert returned["type"] == "DTensor" and "Replicate" in returned["placements"]
    assert_same(returned["local"], one_process_clipped()[0])
    assert_same(returned["full"], one_process_clipped()[0])
