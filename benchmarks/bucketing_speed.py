"""Step time of a 2-process training step against the gradient bucket size, over gloo.

Compares BucketedDataParallel (common/lessons/bucketing.py) at several bucket_cap_mb values, including one
bucket all-reduced after backward (no overlap), with torch's DistributedDataParallel. The model is a
stack of equal linear layers, so the gradients arrive in even steps through backward and overlap has
something to hide. The configurations run one after the other in the same processes, each on a fresh
model after 3 warm-up steps; the table shows the median step.

    python benchmarks/bucketing_speed.py --plot images/bucketing_cpu.png
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from plotting import bar_chart, where_measured
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.accumulation import count_all_reduces
from common.lessons.bucketing import BucketedDataParallel, linear_stack
from common.spawn import run_in_process_group

CONFIGS = [("ours, one bucket after backward", None), ("ours, 1 MiB buckets", 1), ("ours, 4 MiB buckets", 4),
           ("ours, 16 MiB buckets", 16), ("ours, 25 MiB buckets", 25), ("torch DDP, bucket_cap_mb=25", "ddp")]


def every_config(rank, world_size, layers, width, batch, steps):
    return {name: time_config(cap, layers, width, batch, steps) for name, cap in CONFIGS}


def time_config(bucket_cap_mb, layers, width, batch, steps):
    torch.manual_seed(0)
    module = linear_stack(layers, width)
    model = DDP(module) if bucket_cap_mb == "ddp" else BucketedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    ddp_counter = count_all_reduces(model) if bucket_cap_mb == "ddp" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(batch, width)
    times = []
    for step in range(steps + 3):
        dist.barrier()
        start = time.perf_counter()
        model(inputs).square().mean().backward()
        if isinstance(model, BucketedDataParallel):
            all_reduces = len(model._in_flight)  # buckets whose all-reduce backward started
            model.wait_for_gradients()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 3:  # the first steps warm up buffers (and let DDP rebuild its buckets)
            times.append(time.perf_counter() - start)
    if ddp_counter is not None:
        all_reduces = ddp_counter["all_reduces"] / (steps + 3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), all_reduces


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024, help="each layer is width x width (4 MiB at 1024)")
    parser.add_argument("--batch", type=int, default=64, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--plot", help="also save a bar chart to this PNG")
    parser.add_argument("--title", default="Step time vs bucket size",
                        help="plot title; the processes and the machine's name are added after it")
    args = parser.parse_args()
    gradient_mb = args.layers * (args.width + 1) * args.width * 4 / 2**20
    print(f"{args.layers} x Linear({args.width}, {args.width}): {gradient_mb:.0f} MiB of gradients, "
          f"{args.nproc} processes, batch {args.batch} each")
    results = run_in_process_group(every_config, args.nproc, args.layers, args.width, args.batch, args.steps)
    no_overlap = results[CONFIGS[0][0]][0]
    print("| configuration | ms per step | all-reduces per step | vs one bucket after backward |\n|---|---:|---:|---:|")
    for name, (seconds, all_reduces) in results.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {all_reduces:g} | {no_overlap / seconds:.2f}x |")
    if args.plot:
        bar_chart({name: seconds * 1e3 for name, (seconds, _) in results.items()},
                  [f"{seconds * 1e3:.0f} ms" for seconds, _ in results.values()],
                  "milliseconds per training step (lower is better)",
                  f"{args.title}, {args.nproc} gloo processes {where_measured()}", args.plot)

if __name__ == "__main__":
    main()
