"""BucketedDataParallel leaves the same gradients as torch's DistributedDataParallel, with and without no_sync."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.bucketing import BucketedDataParallel
from common.mnist import BasicNet
from common.spawn import run_in_process_group


def batch_for(rank):
    generator = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    return torch.randn(6, 1, 28, 28, generator=generator), torch.randint(0, 10, (6,), generator=generator)


def gradients(model, rank, steps=2):
    """Two backward passes, as in training, to check that the buckets reset between steps."""
    model.eval()  # no dropout: both wrappers must see the same arithmetic
    for _ in range(steps):
        model.zero_grad()
        images, labels = batch_for(rank)
        F.nll_loss(model(images), labels).backward()
        if isinstance(model, BucketedDataParallel):
            model.wait_for_gradients()
    return [p.grad for p in model.parameters()]


def largest_difference_from_ddp(rank, bucket_cap_mb):
    """How far our gradients end from DDP's beyond a relative 1e-5 (what torch.testing.assert_close allows
    in float32), for one bucket cap, with the bucket count it gave."""
    torch.manual_seed(rank)  # different weights per rank: both wrappers must start from rank 0's
    ours = BucketedDataParallel(BasicNet(), bucket_cap_mb=bucket_cap_mb)
    torch.manual_seed(rank)
    reference = DDP(BasicNet())
    differences = torch.stack([((got - want).abs() - 1e-5 * want.abs()).max()
                               for got, want in zip(gradients(ours, rank), gradients(reference, rank))])
    largest = differences.max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # every rank's gradients checked, not rank 0's alone
    return largest.item(), len(ours.buckets)


def bucket_order(rank):
    """Buckets hold the parameters in reverse (the order backward produces their gradients), so that
    the first bucket fills, and its all-reduce starts, while backward still works on earlier layers."""
    model = BucketedDataParallel(BasicNet(), bucket_cap_mb=0.5)
    params = list(model.module.parameters())
    assert [p for bucket in model.buckets for p in bucket] == params[::-1]
    model.eval()
    images, labels = batch_for(rank)
    F.nll_loss(model(images), labels).backward()
    launched = [index for index, _, _ in model._in_flight]
    model.wait_for_gradients()
    return launched


def forgot_backward():
    try:
        BucketedDataParallel(BasicNet()).wait_for_gradients()
    except RuntimeError as error:
        return str(error)


MICRO_BATCHES = 3


def micro_batches(rank, world_size):
    """Rank rank's micro-batches: over all ranks, MICRO_BATCHES * world_size different batches."""
    return [batch_for(rank + world_size * index) for index in range(MICRO_BATCHES)]


def accumulated_gradients(model, batches):
    """One optimizer step's gradients, accumulated the way DDP documents: every micro-batch but the last
    (forward and backward) inside no_sync(), the loss divided by their number."""
    model.eval()
    for index, (images, labels) in enumerate(batches):
        with model.no_sync() if index < len(batches) - 1 else contextlib.nullcontext():
            (F.nll_loss(model(images), labels) / len(batches)).backward()
    if isinstance(model, BucketedDataParallel):
        model.wait_for_gradients()
    return [p.grad for p in model.parameters()]


def accumulation_gaps(rank, world_size):
    """How far our accumulated gradients end, beyond a relative 1e-5, from DDP's and from one process's
    on every rank's micro-batches at once (one mean loss over the global batch: the same gradient)."""
    torch.manual_seed(rank)
    ours = accumulated_gradients(BucketedDataParallel(BasicNet(), bucket_cap_mb=0.5), micro_batches(rank, world_size))
    torch.manual_seed(rank)
    ddp = accumulated_gradients(DDP(BasicNet()), micro_batches(rank, world_size))
    torch.manual_seed(0)  # rank 0's weights, which both wrappers start from
    one_process = BasicNet().eval()
    every_batch = [batch for r in range(world_size) for batch in micro_batches(r, world_size)]
    F.nll_loss(one_process(torch.cat([images for images, _ in every_batch])),
               torch.cat([labels for _, labels in every_batch])).backward()
    gaps = torch.stack([torch.stack([((got - want).abs() - 1e-5 * want.abs()).max() for got, want in zip(ours, reference)]).max()
                        for reference in (ddp, [p.grad for p in one_process.parameters()])])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    return gaps.tolist()


def backward_twice(rank):
    """A second backward outside no_sync() before wait_for_gradients(): what it raises."""
    model = BucketedDataParallel(BasicNet(), bucket_cap_mb=0.5).eval()
    images, labels = batch_for(rank)
    F.nll_loss(model(images), labels).backward()
    try:
        F.nll_loss(model(images), labels).backward()
    except RuntimeError as error:
        return str(error)
    finally:
        model.wait_for_gradients()  # the first backward's all-reduces, in flight on every rank


def accumulation_checks(rank, world_size):
    return {"accumulation": accumulation_gaps(rank, world_size), "twice": backward_twice(rank)}


BUCKETS = {0.5: 3, 25: 1, None: 1}  # bucket_cap_mb: the buckets BasicNet's parameters fill


def every_check(rank, world_size):
    """All checks in one group of 3 processes (3, not 2: with two, a + b == b + a hides the order of sums)."""
    return {"order": bucket_order(rank), "forgot": forgot_backward(), **accumulation_checks(rank, world_size),
            **{cap: largest_difference_from_ddp(rank, cap) for cap in BUCKETS}}


@pytest.fixture(scope="module")
def checks():
    return run_in_process_group(every_check, 3, timeout=180)


def test_buckets_follow_backward_and_launch_in_order(checks):
    assert checks["order"] == [0, 1, 2]


@pytest.mark.parametrize("bucket_cap_mb, buckets", BUCKETS.items())
def test_gradients_equal_ddp(checks, bucket_cap_mb, buckets):
    """bucket_cap_mb 0.5 (MiB): fc2 and fc1's bias, fc1's weight alone, then the convolutions; 25 and None: one bucket."""
    difference, made = checks[bucket_cap_mb]
    assert made == buckets and difference <= 1e-7, difference


def test_waiting_without_backward_is_an_error(checks):
    assert checks["forgot"] is not None and "call backward" in checks["forgot"]


@pytest.fixture(scope="module", params=[3, 2], ids=lambda n: f"{n}_processes")
def accumulation(request):
    """At 3 processes, from the group every check runs in; at 2, in a group of its own."""
    if request.param == 3:
        return request.getfixturevalue("checks")
    return run_in_process_group(accumulation_checks, 2, timeout=120)


def test_no_sync_accumulation_equals_ddp_and_one_process(accumulation):
    from_ddp, from_one_process = accumulation["accumulation"]
    assert from_ddp <= 1e-7 and from_one_process <= 1e-7, (from_ddp, from_one_process)


def test_a_second_backward_outside_no_sync_is_an_error(accumulation):
    """Without the error, wait_for_gradients() would leave the first backward's gradients alone."""
    assert accumulation["twice"] is not None and "no_sync()" in accumulation["twice"]
