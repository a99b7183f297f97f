"""Time the three hand-written all-reduces against dist.all_reduce, 1 KiB to 64 MiB, over gloo.

For each world size it starts that many processes on this machine, times each algorithm (median of
several runs, all ranks released together by a barrier) and prints a table with the algorithm
bandwidth (bytes reduced / time) and the textbook bytes each rank sends. --plot saves a figure of
the bus bandwidth, busbw = 2(N-1)/N * S / t: the rate at which the busiest link would carry a ring's
bytes, so that one number compares world sizes (nccl-tests' convention). The cost model is overlaid:
an algorithm that sends B bytes per rank where the ring sends 2(N-1)/N * S reaches the ring's busbw
times 2(N-1)/N * S / B, anchored at the ring's measured busbw at the largest size.

    python benchmarks/allreduce_speed.py --world-sizes 2 4 --plot images/allreduce_busbw.png
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common.lessons.allreduce import ALGORITHMS, bytes_sent_per_rank
from common.machine import machine_name
from common.spawn import run_in_process_group

SIZES = [2**10 * 4**k for k in range(9)]  # 1 KiB .. 64 MiB
CONTENDERS = {"dist.all_reduce (gloo)": dist.all_reduce, **ALGORITHMS}


def human(size: int) -> str:
    return f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"


def time_one(function, tensor: torch.Tensor, repeats: int) -> float:
    function(tensor)  # warm-up: buffers and connections
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        function(tensor)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an all-reduce ends when its slowest rank does
    return slowest.item()


def worker(rank: int, world_size: int, sizes: list[int]) -> list[tuple]:
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32)
        repeats = 20 if size <= 2**20 else 5
        for name, function in CONTENDERS.items():
            probe = torch.full((size // 4,), float(rank + 1))  # ranks hold 1, 2, ..., N: the sum is N(N+1)/2
            function(probe)
            exact = bool(torch.all(probe == world_size * (world_size + 1) / 2))
            rows.append((world_size, size, name, time_one(function, tensor, repeats), exact))
    return rows


def table(rows: list[tuple]) -> str:
    gloo = {(w, s): t for w, s, name, t, _ in rows if name.startswith("dist.")}
    lines = ["| ranks | size | algorithm | ms | algbw GB/s | model: MiB sent by busiest rank | vs gloo | sum exact |",
             "|---:|---:|---|---:|---:|---:|---:|---|"]
    for world_size, size, name, seconds, exact in rows:
        model = bytes_sent_per_rank(name, size, world_size) if name in ALGORITHMS else bytes_sent_per_rank("ring", size, world_size)
        lines.append(f"| {world_size} | {human(size)} | {name} | {seconds * 1e3:.2f} | {size / seconds / 1e9:.2f} "
                     f"| {model / 2**20:.2f} | {gloo[world_size, size] / seconds:.2f}x | {'yes' if exact else 'NO'} |")
    return "\n".join(lines)


def bus_bandwidth(size: int, seconds: float, world_size: int) -> float:
    """Bytes per second each link carries in a ring all-reduce of size bytes that took seconds."""
    return bytes_sent_per_rank("ring", size, world_size) / seconds


def model_bus_bandwidth(rows: list[tuple], world_size: int) -> dict[str, float]:
    """The cost model's busbw per algorithm: the ring's measured busbw at the largest size, scaled by
    how many more bytes the algorithm sends than the ring (gloo's own all-reduce is a ring)."""
    largest = max(r[1] for r in rows if r[0] == world_size)
    ring = next(bus_bandwidth(s, t, w) for w, s, n, t, _ in rows if w == world_size and s == largest and n == "ring")
    ratio = {name: bytes_sent_per_rank("ring", largest, world_size) / bytes_sent_per_rank(name, largest, world_size)
             for name in ALGORITHMS}
    return {name: ring * ratio.get(name, 1.0) for name in CONTENDERS}


def plot(rows: list[tuple], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import finish
    world_sizes = sorted({r[0] for r in rows})
    sizes = sorted({r[1] for r in rows})
    fig, axes = plt.subplots(1, len(world_sizes), figsize=(5.5 * len(world_sizes), 4.2), sharey=True, squeeze=False)
    for ax, world_size in zip(axes[0], world_sizes):
        model = model_bus_bandwidth(rows, world_size)
        for index, name in enumerate(CONTENDERS):
            color = f"C{index}"
            points = [(s, bus_bandwidth(s, t, w) / 1e9) for w, s, n, t, _ in rows if w == world_size and n == name]
            ax.plot(*zip(*points), marker="o", color=color, label=name)
            ax.axhline(model[name] / 1e9, color=color, ls="--", lw=1, alpha=0.7)
        same_model = {}  # algorithms the cost model gives one value share one dashed line: name them on it
        for name in CONTENDERS:
            same_model.setdefault(round(model[name] / 1e9, 9), []).append(name.split(" ")[0])
        for value, names in same_model.items():
            ax.annotate("model: " + ", ".join(names), (sizes[0], value), xytext=(0, 2), textcoords="offset points",
                        fontsize=7, va="bottom", bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [human(s) for s in sizes], rotation=45)
        ax.set_title(f"{world_size} processes", fontsize=9)
        ax.set_xlabel("tensor size S")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth 2(N-1)/N·S/t, GB/s")
    # beside the panels, not over them: the model lines' labels sit at the panels' upper left
    axes[0][-1].legend(fontsize=8, title="measured (dashed: cost model)", title_fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.02, 1))
    finish(fig, path, title)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=64, help="largest tensor, in MiB (default: 64)")
    parser.add_argument("--plot", help="also save a figure to this PNG")
    parser.add_argument("--title", default=f"All-reduce bus bandwidth over gloo, one machine: {machine_name()}",
                        help="plot title (default names the machine)")
    args = parser.parse_args()
    sizes = [size for size in SIZES if size <= args.max_mb * 2**20]
    rows = [row for world_size in args.world_sizes
            for row in run_in_process_group(worker, world_size, sizes, timeout=1800)]
    print(table(rows))
    if args.plot:
        plot(rows, args.plot, args.title)


if __name__ == "__main__":
    main()
