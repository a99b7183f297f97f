"""Gradient accumulation under DDP: seconds per optimizer step and all-reduces, four ways.

Reproduces the comparison in Accelerate's "gradient synchronization" guide on this machine, with
gloo: 2 processes, 4 micro-batches per optimizer step, the MNIST BasicNet. The variants are in
common/lessons/accumulation.py; they run one after the other in the same processes, each on a fresh model
after 2 warm-up steps, and a DDP communication hook counts the bucket all-reduces.

    python benchmarks/grad_sync.py
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons import accumulation
from common.mnist import BasicNet
from common.spawn import run_in_process_group

VARIANTS = {
    "sync every micro-batch (baseline)": "sync_every_micro_batch",
    "no_sync around backward only (mistake)": "no_sync_around_backward_only",
    "no_sync around forward + backward": "no_sync_around_forward_and_backward",
    "accelerator.accumulate": "accelerate_accumulate",
}


def every_variant(rank, world_size, accumulation_steps, micro_batch, optimizer_steps):
    return {name: time_variant(rank, variant, accumulation_steps, micro_batch, optimizer_steps)
            for name, variant in VARIANTS.items()}


def time_variant(rank, variant, accumulation_steps, micro_batch, optimizer_steps):
    torch.manual_seed(rank)
    model = BasicNet().to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "accelerate_accumulate":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation_steps)
        model, optimizer = accelerator.prepare(model, optimizer)
        step = lambda batches: accumulation.accelerate_accumulate(accelerator, model, optimizer, batches)  # noqa: E731
    else:
        model = DDP(model)
        step = lambda batches: getattr(accumulation, variant)(model, optimizer, batches)  # noqa: E731
    counter = accumulation.count_all_reduces(model)
    batches = [(torch.randn(micro_batch, 1, 28, 28).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (micro_batch,))) for _ in range(accumulation_steps)]
    times = []
    for index in range(optimizer_steps + 2):
        if index == 2:  # after warm-up and DDP's bucket rebuild
            counter["all_reduces"] = 0
        dist.barrier()
        start = time.perf_counter()
        step(batches)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times[2:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), counter["all_reduces"] / optimizer_steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per process per micro-batch")
    parser.add_argument("--optimizer-steps", type=int, default=15)
    args = parser.parse_args()
    print(f"{args.nproc} processes, {args.accumulation_steps} micro-batches of {args.micro_batch} per process "
          "per optimizer step, BasicNet (4.6 MiB of gradients), gloo")
    print("| variant | s per optimizer step | all-reduces per optimizer step | vs baseline |\n|---|---:|---:|---:|")
    results = run_in_process_group(every_variant, args.nproc, args.accumulation_steps, args.micro_batch,
                                   args.optimizer_steps)
    baseline = None
    for name, (seconds, calls) in results.items():
        baseline = baseline or seconds
        print(f"| {name} | {seconds:.3f} | {calls:g} | {baseline / seconds:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
