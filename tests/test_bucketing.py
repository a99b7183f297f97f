"""BucketedDataParallel leaves the same gradients as torch's DistributedDataParallel."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.bucketing import BucketedDataParallel
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


def compare_with_ddp(rank, world_size, bucket_cap_mb):
    torch.manual_seed(rank)  # different weights per rank: both wrappers must start from rank 0's
    ours = BucketedDataParallel(BasicNet(), bucket_cap_mb=bucket_cap_mb)
    torch.manual_seed(rank)
    reference = DDP(BasicNet())
    if bucket_cap_mb == 0.5:
        assert len(ours.buckets) > 2  # fc1 alone, then the small layers
    if bucket_cap_mb is None:
        assert len(ours.buckets) == 1
    for got, want in zip(gradients(ours, rank), gradients(reference, rank)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def bucket_order(rank, world_size):
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


def test_buckets_follow_backward_and_launch_in_order():
    assert run_in_process_group(bucket_order, 2) == [0, 1, 2]


@pytest.mark.parametrize("bucket_cap_mb", [0.5, 25, None])
def test_gradients_equal_ddp(bucket_cap_mb):
    run_in_process_group(compare_with_ddp, 2, bucket_cap_mb)


def forgot_backward(rank, world_size):
    model = BucketedDataParallel(BasicNet())
    with pytest.raises(RuntimeError, match="call backward"):
        model.wait_for_gradients()


def test_waiting_without_backward_is_an_error():
    run_in_process_group(forgot_backward, 2)
