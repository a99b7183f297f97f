"""Four ways to accumulate gradients under DDP: all end at the weights of one process on the whole
accumulated batch, and each makes exactly the all-reduces it should."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons import accumulation
from common.mnist import BasicNet
from common.spawn import run_in_process_group

STEPS, MICRO, WORLD = 4, 3, 3  # accumulation steps, samples per micro-batch per rank, processes (3: 2 hide the order of sums)
VARIANTS = ["sync_every_micro_batch", "no_sync_around_backward_only", "no_sync_around_forward_and_backward",
            "accelerate_accumulate"]


def all_samples():
    generator = torch.Generator().manual_seed(3)
    n = STEPS * MICRO * WORLD
    return torch.randn(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def micro_batches_of(rank):
    images, labels = all_samples()
    per_rank = STEPS * MICRO
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return list(zip(images[mine].split(MICRO), labels[mine].split(MICRO)))


def model_and_optimizer():
    torch.manual_seed(0)
    model = BasicNet().eval()  # no dropout, so the check is exact arithmetic
    return model, torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: linear in the gradient


def one_process_on_everything():
    model, optimizer = model_and_optimizer()
    F.nll_loss(model(all_samples()[0]), all_samples()[1]).backward()
    optimizer.step()
    return [p.detach() for p in model.parameters()]


def warmed_up_counter(model, rank):
    """Count from the second backward on: DDP's first backward uses one bucket, then DDP rebuilds its
    buckets in the order the gradients really arrived (a 1 MiB first bucket, then 25 MB ones)."""
    counter = accumulation.count_all_reduces(model)
    images, labels = micro_batches_of(rank)[0]
    F.nll_loss(model(images), labels).backward()
    model.zero_grad(set_to_none=True)
    counter["all_reduces"] = 0
    return counter


def run_variant(rank, world_size, variant):
    model, optimizer = model_and_optimizer()
    if variant == "accelerate_accumulate":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
        model, optimizer = accelerator.prepare(model, optimizer)
        counter = warmed_up_counter(model, rank)
        accumulation.accelerate_accumulate(accelerator, model, optimizer, micro_batches_of(rank))
    else:
        model = DDP(model)
        counter = warmed_up_counter(model, rank)
        if variant == "one_backward":  # how many bucket all-reduces a single synced backward makes
            images, labels = micro_batches_of(rank)[0]
            F.nll_loss(model(images), labels).backward()
        else:
            getattr(accumulation, variant)(model, optimizer, micro_batches_of(rank))
    return {"params": [p.detach() for p in model.parameters()], "all_reduces": counter["all_reduces"]}


def run_every_variant(rank, world_size):
    """Each variant on a fresh model, one after the other in the same 3 processes."""
    return {variant: run_variant(rank, world_size, variant) for variant in ["one_backward", *VARIANTS]}


@pytest.fixture(scope="module")
def results():
    return run_in_process_group(run_every_variant, WORLD)


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_weights_as_one_process_on_the_whole_batch(results, variant):
    for got, want in zip(results[variant]["params"], one_process_on_everything()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_all_reduce_counts(results):
    calls = {variant: results[variant]["all_reduces"] for variant in results}
    once = calls["one_backward"]  # one all-reduce per gradient bucket
    assert once == 2  # BasicNet's 4.8 MB of gradients: fc2 + fc1 weight fill the 1 MiB first bucket, the rest the next
    assert calls["no_sync_around_forward_and_backward"] == once
    assert calls["sync_every_micro_batch"] == STEPS * once
    assert calls["no_sync_around_backward_only"] == STEPS * once, "the mistake saves nothing"
    assert calls["accelerate_accumulate"] == once
