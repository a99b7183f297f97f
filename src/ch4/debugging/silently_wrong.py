"""Silently wrong: six bugs that train on, print plausible numbers and exit with code 0.

Each check below plants one bug (`--fixed`: its fix) and prints, on rank 0, what gives it away:
- set_epoch forgotten: every epoch deals each rank the same order again.
- drift: a checkpoint loaded on rank 0 after the DDP wrap (the wrap broadcasts rank 0's weights once,
  at construction): the replicas train on apart; check_replicas (common/diagnose.py) names the tensor.
- batchnorm: each rank updates BatchNorm's running statistics from its own batches; DDP re-sends rank
  0's at the start of every forward, so they differ after the last one, in what each rank evaluates or
  saves. The fix averages them (SyncBatchNorm does it in every forward, on GPUs only).
- clip: a sharded optimizer (ZeRO-2, FSDP) clips each rank's shard by that shard's norm: each rank
  scales by a different factor. The fix all-reduces the squared norms first.
- metric: an accuracy printed from rank 0's share of the test set. The fix sums the counts over ranks.
- loss summed where it should be averaged: DDP averages the gradients over ranks, so with N ranks the
  step is 1/N of one process's step on the same global batch, and the learning rate depends on N.

    torchrun --nproc_per_node=2 src/ch4/debugging/silently_wrong.py
    torchrun --nproc_per_node=3 src/ch4/debugging/silently_wrong.py --fixed
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common.diagnose import ReplicaMismatch, check_replicas
from common.distributed import print0
from common.gallery import batches, start
from common.gather import sum_across_ranks


def set_epoch(fixed, device):
    sampler = DistributedSampler(range(12), shuffle=True, seed=0)
    orders = []
    for epoch in range(2):
        if fixed:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    same = "the same order again" if orders[0] == orders[1] else "a new order"
    return f"set_epoch: rank 0 sees {orders[0]} in epoch 0 and {orders[1]} in epoch 1: {same}"


def replicas(model) -> str:
    try:
        check_replicas(model)
    except ReplicaMismatch as error:
        return str(error)
    return "the replicas agree"


def train(model, device, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in batches(device, count=steps, seed=dist.get_rank()):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()


def drift(fixed, device):
    torch.manual_seed(dist.get_rank())  # each rank initialises differently, as it may
    model = torch.nn.Linear(16, 4).to(device)
    checkpoint = {name: value + 1 for name, value in model.state_dict().items()}
    if fixed:
        model.load_state_dict(checkpoint)  # on every rank, or on rank 0 before the wrap
        model = DDP(model)
    else:
        model = DDP(model)
        if dist.get_rank() == 0:
            model.module.load_state_dict(checkpoint)  # the bug: after the wrap, on rank 0 only
    train(model, device)
    return f"drift: {replicas(model)}"


def batchnorm(fixed, device):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.Linear(8, 4)).to(device))
    train(model, device)
    if fixed:
        for buffer in model.module.buffers():
            if buffer.is_floating_point():  # running mean and variance; the step count is equal
                dist.all_reduce(buffer)
                buffer /= dist.get_world_size()
    return f"batchnorm: {replicas(model)}"


def clip(fixed, device, max_norm=0.1):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4).to(device))
    inputs, labels = batches(device, count=1, seed=dist.get_rank())[0]
    F.cross_entropy(model(inputs), labels).backward()
    mine = [p for i, p in enumerate(model.parameters()) if i % dist.get_world_size() == dist.get_rank()]  # my shard
    squares = sum(p.grad.pow(2).sum() for p in mine) if mine else torch.zeros((), device=device)
    if fixed:
        dist.all_reduce(squares)  # the norm of the whole gradient, from every shard
    norm = squares.sqrt()
    for p in mine:
        p.grad.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))
    norms = [None] * dist.get_world_size()
    dist.all_gather_object(norms, round(norm.item(), 4))
    return f"clip: the ranks clip by the norms {norms}"


def metric(fixed, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(device)
    generator = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(101, 16, generator=generator), torch.randint(0, 4, (101,),
                                                                              generator=generator)
    mine = slice(dist.get_rank(), None, dist.get_world_size())  # this rank's share of the test set
    with torch.no_grad():
        correct = int((model(inputs[mine].to(device)).argmax(1) == labels[mine].to(device)).sum())
    seen = len(labels[mine])
    if fixed:
        correct, seen = sum_across_ranks(correct, seen, device=device)
    return f"metric: accuracy {correct}/{seen} test examples"


def loss_sum(fixed, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(device)
    inputs, labels = batches(device, count=1, size=4 * dist.get_world_size())[0]  # the global batch, on every rank
    reduction = "mean" if fixed else "sum"  # the bug: "sum"
    F.cross_entropy(model(inputs), labels, reduction=reduction).backward()  # one process on the global batch
    one_process = model.weight.grad.clone()
    model.zero_grad()
    ddp = DDP(model)
    mine = slice(dist.get_rank(), None, dist.get_world_size())
    F.cross_entropy(ddp(inputs[mine]), labels[mine], reduction=reduction).backward()
    ratio = (model.weight.grad.norm() / one_process.norm()).item()
    return (f"loss_sum: with reduction={reduction!r}, {dist.get_world_size()} ranks step {ratio:.2f} times "
            "as far as one process on the same global batch")


def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/silently_wrong.py")
    for check in (set_epoch, drift, batchnorm, clip, metric, loss_sum):
        print0(check(args.fixed, device))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
