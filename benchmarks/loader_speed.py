"""Does the input pipeline keep up? Training samples/s of the MNIST DDP step against DataLoader workers and
pin_memory, at 1 and 2 ranks, beside the step's compute alone.

Each rank trains BasicNet on its share of the global batch (64) with DDP over gloo (NCCL on GPUs), from a
DataLoader over the classic per-sample path (PIL image, ToTensor, Normalize; --loader tensor for whole batches
from memory) with the data-pipeline chapter's random shift drawn in the workers (common/worker_seeds.py).
"compute alone" trains the same steps on one batch already in memory: the most a pipeline can feed; "loader
alone" takes the batches and trains nothing: the most the pipeline delivers. Training runs at about the
lower of the two where the workers have cores of their own; a step that waits for its loader is one whose
loader alone is the lower. The workers are processes of their own: ranks x (1 +
workers) processes share the machine's cores, and past one process a core, the loader's work and the
step's take turns. pin_memory pins each batch in page-locked memory so that the copy to a GPU can overlap;
without an accelerator the DataLoader ignores it (and warns), so on a CPU its rows are not run.

    python benchmarks/loader_speed.py --data-dir data --plot images/loader_speed_cpu.png
"""
import argparse
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plotting import bar_chart, where_measured
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from common.mnist import BasicNet, load_mnist
from common.spawn import run_in_process_group
from common.worker_seeds import WorkerShift, seed_epoch, seed_worker

GLOBAL_BATCH = 64


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def train_steps(rank, world_size, data_dir, loader_kind, workers, pin, steps, warmup, train=True) -> float:
    """Samples/s of all ranks together over `steps` steps after `warmup`; workers=None: compute alone,
    train=False: the loader alone (its batches taken and moved to the device, nothing trained)."""
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(max(cores() // world_size, 1))  # as torchrun does per process, at most the cores
    torch.manual_seed(rank)
    train_set, _ = load_mnist(data_dir, loader_kind)
    batch = GLOBAL_BATCH // world_size
    model = DDP(BasicNet().to(device), device_ids=[rank] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if workers is None:
        images, labels = next(iter(DataLoader(train_set, batch, collate_fn=getattr(train_set, "collate", None))))
        batches = iter(lambda: (images, labels), None)
    else:
        dataset = WorkerShift(train_set, 2)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, world_size, rank, seed=0)
        loader = DataLoader(dataset, batch, sampler=sampler, collate_fn=dataset.collate, num_workers=workers,
                            worker_init_fn=seed_worker, generator=torch.Generator(), pin_memory=pin)
        seed_epoch(loader, 0, rank, 0)
        batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch, as long as asked
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if not train:
            continue
        loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return steps * GLOBAL_BATCH / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data", help="folder holding MNIST/raw/*-ubyte (default: ./data)")
    parser.add_argument("--loader", choices=["classic", "tensor"], default="classic",
                        help="classic: PIL + transforms per sample, as most pipelines decode; tensor: whole batches from memory")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per row, after 5 untimed (default: 60)")
    parser.add_argument("--plot", help="save a bar chart here (PNG)")
    args = parser.parse_args()
    if torch.cuda.is_available() and max(args.ranks) > torch.cuda.device_count():
        parser.error(f"--ranks {max(args.ranks)} needs as many GPUs; {torch.cuda.device_count()} visible")
    load_mnist(args.data_dir, args.loader)  # a download happens here, before any row is timed
    pins = [False, True] if torch.accelerator.is_available() else [False]
    where = where_measured(gpus=True)
    print(f"MNIST training steps of a global batch of {GLOBAL_BATCH}, {args.loader} loader, {args.steps} steps a row, "
          f"{where}, {cores()} cores")
    if len(pins) == 1:
        print("no accelerator: pin_memory has nothing to pin (the DataLoader ignores it), so its rows are not run")
    print("\n| ranks | num_workers | pin_memory | processes a core | loader alone, samples/s | training, samples/s | of compute alone |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    values, notes = {}, []
    for ranks in args.ranks:
        alone = run_in_process_group(train_steps, ranks, args.data_dir, args.loader, None, False, args.steps, 5)
        print(f"| {ranks} | compute alone | | {ranks / cores():.1f} | | {alone:,.0f} | 100% |", flush=True)
        values[f"{ranks} rank{'s' * (ranks > 1)}, compute alone"] = alone
        notes.append(f"{alone:,.0f}")
        for workers in args.workers:
            for pin in pins:
                rate = run_in_process_group(train_steps, ranks, args.data_dir, args.loader, workers, pin, args.steps, 5)
                feed = run_in_process_group(train_steps, ranks, args.data_dir, args.loader, workers, pin, args.steps, 5, False)
                share = ranks * (1 + workers) / cores()
                print(f"| {ranks} | {workers} | {'yes' if pin else 'no'} | {share:.1f} | {feed:,.0f} | {rate:,.0f} | "
                      f"{rate / alone:.0%} |", flush=True)
                values[f"{ranks} rank{'s' * (ranks > 1)}, {workers} workers{', pinned' * pin}"] = rate
                notes.append(f"{rate:,.0f} ({rate / alone:.0%})")
    if args.plot:
        bar_chart(values, notes, "training samples/s (higher is better)",
                  f"MNIST DDP step fed by DataLoader workers ({args.loader} loader) {where}", args.plot)


if __name__ == "__main__":
    main()
