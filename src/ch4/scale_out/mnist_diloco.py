"""MNIST with local SGD and DiLoCo: mnist_3_ddp.py with the replicas meeting every H steps, not every step.

DDP all-reduces the gradients at every step. Here each rank trains its own replica with its own AdamW
for H steps (--sync-every H), without any communication; then the ranks all-reduce once, and an outer
optimizer moves the shared weights (common/lessons/local_sgd.py):
  - the pseudo-gradient is start − (the mean of the replicas' weights): how far the replicas moved,
    on average, since the last synchronisation;
  - DiLoCo (the default): outer SGD with Nesterov momentum 0.9 at learning rate 0.7 on it;
  - local SGD: --outer-lr 1 --outer-momentum 0, which is the plain average of the replicas;
  - one all-reduce of the weights every H steps: 1/H of DDP's bytes. The replicas also meet at the
    end of each epoch, so that every rank evaluates the same model.
No DDP wrapper: nothing is reduced in backward. Rank 0's weights are broadcast first, as DDP's
constructor does, and the script counts what each rank hands to all_reduce (as mnist_comm_hooks.py).

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    # DiLoCo
    torchrun --nproc_per_node=2 src/ch4/scale_out/mnist_diloco.py --sync-every 8
    # local SGD
    torchrun --nproc_per_node=2 src/ch4/scale_out/mnist_diloco.py --outer-lr 1 --outer-momentum 0
    # one process per GPU
    torchrun --nproc_per_node=gpu src/ch4/scale_out/mnist_diloco.py
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        src/ch4/scale_out/mnist_diloco.py --sync-every 32
On a CPU torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_compile_flag, add_local_sgd_flags, mnist_parser, per_process_batch
from common.compile import compiled
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.lessons.comm_hooks import AllReduceCounter, bytes_report
from common.lessons.local_sgd import OuterOptimizer
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import DistributedEvalSampler


def train_epoch(model, loader, optimizer, scaler, device, precision, outer):  # STEP
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        outer.inner_step_done()  # STEP: every H-th step: all-reduce the pseudo-gradient, take the outer step
        loss_sum += loss.detach()
    outer.sync()  # STEP: and at the end of the epoch, so that every rank evaluates the same model
    return loss_sum.item() / len(loader)


@torch.no_grad()
def evaluate(model, loader, device, precision):
    """Count correct predictions and images seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main():
    args = add_local_sgd_flags(add_compile_flag(mnist_parser(__doc__))).parse_args()  # STEP: --sync-every, --outer-lr, --outer-momentum

    launch = require_launcher("src/ch4/scale_out/mnist_diloco.py")  # STEP: its own name in the message
    device = device_for(launch)
    timeout = timedelta(seconds=args.dist_timeout)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    with exit_if_peers_missing(launch, args.dist_timeout):
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, device_id=device if device.type != "cpu" else None)
        dist.barrier(async_op=True).wait(timeout=timeout)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)

    train_set, test_set = load_mnist(args.data_dir, args.loader, launch.local_rank)
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size, DistributedEvalSampler(test_set),
                               args.num_workers)

    model = BasicNet().to(device, memory_format=torch.channels_last)
    outer = OuterOptimizer(model, args.sync_every, args.outer_lr, args.outer_momentum)  # STEP: broadcasts rank 0's weights
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, "  # STEP
           f"global batch {args.batch_size} = {launch.world_size} x {batch_size}, "  # STEP
           f"synchronised every {args.sync_every} steps by outer SGD, "  # STEP
           f"lr {args.outer_lr:g}, Nesterov momentum {args.outer_momentum:g}")  # STEP
    sent = AllReduceCounter()  # STEP: adds up the tensors this rank hands to all_reduce
    train_seconds = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        with sent:  # STEP: while it trains; the metrics' all-reduces after it are not counted
            loss = train_epoch(model, train_loader, optimizer, scaler, device, precision, outer)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model, test_loader, device, precision)  # STEP: no DDP wrapper to unwrap
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(bytes_report(sent.bytes, args.epochs * len(train_loader), model, launch.world_size))  # STEP
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
