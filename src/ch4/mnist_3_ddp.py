"""MNIST, step 3 of 5: DistributedDataParallel, one process per device, started by torchrun.

Every process holds a full model replica and trains on its own 1/N of each global batch. During
backward, DDP all-reduces (averages) the gradients in buckets while the rest of backward still runs,
so after optimizer.step() every replica holds the same weights. What changes from step 2:
  - torchrun starts N processes and tells each its RANK, LOCAL_RANK and WORLD_SIZE; each joins a
    process group (NCCL for GPUs, gloo for the CPU) and uses device cuda:LOCAL_RANK;
  - DistributedSampler deals each rank a disjoint 1/N of the shuffled training set, and
    set_epoch(epoch) makes the shuffle differ between epochs (forget it and every epoch repeats);
  - the global batch of 64 is split: each of N processes loads 64/N;
  - evaluation uses DistributedEvalSampler, so each test image is scored exactly once, and the
    counts are summed over ranks before the accuracy is printed (by rank 0 only).

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    torchrun --nproc_per_node=2 src/ch4/mnist_3_ddp.py       # 2 processes: 2 GPUs, or 2 CPU processes
    torchrun --nproc_per_node=gpu src/ch4/mnist_3_ddp.py     # one process per visible GPU
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        src/ch4/mnist_3_ddp.py
On a CPU torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_2_data_parallel.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_compile_flag, mnist_parser, per_process_batch
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
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import DistributedEvalSampler


def train_epoch(model, loader, optimizer, scaler, device, precision):
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
        loss_sum += loss.detach()
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
    args = add_compile_flag(mnist_parser(__doc__)).parse_args()

    launch = require_launcher("src/ch4/mnist_3_ddp.py")  # STEP: rank, local rank, world size from torchrun or srun
    device = device_for(launch)  # STEP: cuda:LOCAL_RANK, never the global rank; one GPU per process
    timeout = timedelta(seconds=args.dist_timeout)  # STEP: how long a process waits for its peers
    if device.type != "cpu":  # STEP
        torch.get_device_module(device).set_device(device)  # STEP: device_id does not; object collectives use the current GPU
    with exit_if_peers_missing(launch, args.dist_timeout):  # STEP: a peer that never arrives ends the run in one sentence
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,  # STEP: nccl on GPUs, gloo on the CPU
                                timeout=timeout, device_id=device if device.type != "cpu" else None)  # STEP: NCCL: this GPU, connected now
        dist.barrier(async_op=True).wait(timeout=timeout)  # STEP: every peer has joined, or an error within the timeout
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)  # STEP: own dropout masks per rank; DDP copies rank 0's weights to all

    train_set, test_set = load_mnist(args.data_dir, args.loader, launch.local_rank)  # STEP: local rank 0 downloads
    batch_size = per_process_batch(args.batch_size, launch.world_size)  # STEP: each rank loads 1/N of the global batch
    train_sampler = DistributedSampler(train_set, seed=args.seed)  # STEP: a disjoint 1/N of the shuffled indices
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size, DistributedEvalSampler(test_set),  # STEP
                               args.num_workers)  # STEP

    model = BasicNet().to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # STEP: all-reduce gradients in backward
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "  # STEP
           f"{args.batch_size} = {launch.world_size} x {batch_size}")  # STEP
    train_seconds = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # STEP: a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision)
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size  # STEP: the mean over ranks, not rank 0's
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model.module, test_loader, device, precision)  # STEP: no DDP collectives: a rank may have no batch
    correct, seen = sum_across_ranks(correct, seen, device=device)  # STEP: every test image counted exactly once
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()  # STEP


if __name__ == "__main__":
    main()
