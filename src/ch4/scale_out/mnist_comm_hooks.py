"""MNIST with fewer bytes on the wire: mnist_3_ddp.py with a DDP communication hook.

DDP all-reduces every gradient at every step: 4 bytes per parameter in fp32, 4.8 MB per step for this
1.2 M-parameter model, from every rank. Inside a node that is cheap; between nodes it can be the step's
cost. A communication hook replaces what DDP does with each gradient bucket (torch's hooks, in
torch.distributed.algorithms.ddp_comm_hooks; common/lessons/comm_hooks.py says what each sends):
  - --comm-hook fp16 or bf16: the bucket cast to 16 bits, all-reduced, cast back: half the bytes;
  - --comm-hook powersgd --powersgd-rank r: each weight's gradient, an n×m matrix, sent as two factors
    of r(n+m) numbers; biases whole; the first 2 steps plain (PowerSGD's warm-up). What the factors
    miss is added to the next step's gradient (error feedback), so little is lost for good;
  - --comm-hook none: allreduce_hook, DDP's own all-reduce written in Python, so that it is counted too.
The script counts the bytes of every tensor each rank hands to all_reduce while it trains
(common.lessons.comm_hooks.AllReduceCounter) and prints them per step against plain DDP's.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    torchrun --nproc_per_node=2 src/ch4/scale_out/mnist_comm_hooks.py --comm-hook powersgd --powersgd-rank 4
    # one process per GPU
    torchrun --nproc_per_node=gpu src/ch4/scale_out/mnist_comm_hooks.py --comm-hook bf16
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        src/ch4/scale_out/mnist_comm_hooks.py --comm-hook powersgd
On a CPU torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_comm_hook_flags, add_compile_flag, mnist_parser, per_process_batch
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
from common.lessons.comm_hooks import AllReduceCounter, bucket_cap_mb, bytes_report, register_comm_hook
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
    args = add_comm_hook_flags(add_compile_flag(mnist_parser(__doc__))).parse_args()  # STEP: --comm-hook, --powersgd-rank

    launch = require_launcher("src/ch4/scale_out/mnist_comm_hooks.py")  # STEP: its own name in the message
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
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None,  # STEP
                bucket_cap_mb=bucket_cap_mb(args.comm_hook, model))  # STEP: PowerSGD on gloo needs one bucket
    register_comm_hook(model, args.comm_hook, args.powersgd_rank)  # STEP: DDP hands each gradient bucket to the hook
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, "  # STEP
           f"global batch {args.batch_size} = {launch.world_size} x {batch_size}, "  # STEP
           f"comm hook {args.comm_hook}" + (f", rank {args.powersgd_rank}"  # STEP
                                            if args.comm_hook == "powersgd" else ""))  # STEP
    sent = AllReduceCounter()  # STEP: adds up the tensors this rank hands to all_reduce
    train_seconds = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        with sent:  # STEP: while it trains; the metrics' all-reduces after it are not counted
            loss = train_epoch(model, train_loader, optimizer, scaler, device, precision)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model.module, test_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(bytes_report(sent.bytes, args.epochs * len(train_loader), model, launch.world_size))  # STEP
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
