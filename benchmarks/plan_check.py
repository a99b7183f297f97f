"""planner.plan's predictions beside measurements on this machine: bytes per rank and time per step.

For each world size N it starts N gloo processes and, in them,
  - measures the two inputs the plan needs for a CPU: the FLOP/s one process reaches in a matrix product
    of the model's shape while all N run at once (they share the cores), and the loopback link's
    bandwidth and latency, fitted to the ring's cost model from all-reduces of 4 KiB and 16 MiB;
  - times the same training step with no wrapper and no collective, all N at once: the compute alone.
    The plan's MFU is calibrated on it (the step's FLOPs over that time, over the matrix product's
    FLOP/s): on a CPU most of a small model's step is not matrix products (layer norms, softmax, GELU,
    AdamW's update, Python), and one measured step says how much;
  - trains a small BERT in fp32 under DDP, the repo's ZeRO-1/2/3 (common/lessons/zero.py) and FSDP2, with
    benchmarks/sharded_memory.py's measure(): bytes of parameters, gradients and optimizer state on the
    busiest rank, and the median step time of the slowest rank;
and prints each beside planner.plan.plan() for the same Ψ, batch, sequence length and N, and the
collectives each strategy issues per step (the repo's ZeRO: one per module that has parameters). The repo's ZeRO calls its
collectives synchronously, so nothing overlaps there; DDP and FSDP2 issue theirs asynchronously and get
the plan's overlap rule. gloo's reduce-scatter is a whole all-reduce (common/lessons/zero.py), and the plan is
told so. It lives among the benchmarks because it starts processes and reuses sharded_memory.py;
planner.plan itself stays an instant calculator.

    python benchmarks/plan_check.py --plot images/plan_check_cpu.png        # about 2 minutes of CPU time
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from sharded_memory import RUNS, measure

from common.machine import machine_name
from common.spawn import run_in_process_group
from planner.plan import GPU, Link, Model, model_of_config, plan, step_flops

PARTS = ("params", "grads", "optimizer")


def small_bert(vocab: int = 3000, hidden: int = 192, layers: int = 2):
    """A BERT config whose sizes divide by 1, 2, 3 and 4, so that shards need no padding."""
    from transformers import BertConfig
    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=4 * hidden, max_position_embeddings=132, num_labels=3)


def slowest_rank(seconds: float) -> float:
    """The largest of the ranks' values."""
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def timed(function, repeats: int) -> float:
    """The slowest rank's median seconds for function(), all ranks released together."""
    function()
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        function()
        times.append(time.perf_counter() - began)
    return slowest_rank(statistics.median(times))


def machine_inputs(tokens: int, hidden: int) -> tuple[float, Link]:
    """FLOP/s of one process's (tokens x hidden) @ (hidden x 4 hidden) while all run; the ring's link."""
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    flops = 2 * tokens * hidden * 4 * hidden * 10 / timed(lambda: [a @ b for _ in range(10)], 5)
    n = dist.get_world_size()
    if n == 1:
        return flops, Link("none", float("inf"), 0.0)
    small, large = torch.ones(1024), torch.ones(4 * 2**20)
    t_small, t_large = timed(lambda: dist.all_reduce(small), 20), timed(lambda: dist.all_reduce(large), 5)
    latency = t_small / (2 * (n - 1))  # the ring's 2(N-1) steps, each one message
    bandwidth = 2 * (n - 1) / n * large.numel() * 4 / (t_large - t_small)
    return flops, Link("loopback (gloo)", bandwidth, latency)


def worker(rank, world_size, config, batch, length, steps):
    torch.set_num_threads(1)
    measure("DDP", config, batch, length, 2)  # a run to throw away: the first pays for loading kernels and libraries
    flops, link = machine_inputs(batch * length, config.hidden_size)
    compute_s = slowest_rank(measure("local", config, batch, length, steps)["step_s"])
    results = {run: measure(run, config, batch, length, steps) for run in RUNS}
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, results)
    return {"flops": flops, "link": link, "compute_s": compute_s, "ranks": every_rank}


def zero_units(config) -> int:
    """Collectives of each kind the repo's ZeRO issues per step: one per module that has parameters."""
    from transformers import AutoModelForSequenceClassification
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(1 for module in model.modules() if next(module.parameters(recurse=False), None) is not None)


def predictions(run: str, model: Model, world_size: int, flops: float, mfu: float, link: Link, batch: int,
                length: int, units: int):
    cpu = GPU("CPU", flops, flops, float("inf"))
    return plan(RUNS[run], model, world_size, world_size, cpu, link, link, "fp32", batch, length, mfu=mfu,
                overlap=not run.startswith("ZeRO"), gloo=True, pieces=units if run.startswith("ZeRO") else None)


def check(config, world_sizes, batch, length, steps) -> list[dict]:
    """One row per (world size, run): predicted and measured bytes and step time."""
    from transformers import AutoModelForSequenceClassification
    shape = model_of_config(config, AutoModelForSequenceClassification)
    rows, units = [], zero_units(config)
    for world_size in world_sizes:
        result = run_in_process_group(worker, world_size, config, batch, length, steps, timeout=600)
        mfu = min(1.0, step_flops(shape, batch * length, length) / (result["flops"] * result["compute_s"]))
        for run in RUNS:
            ranks = [every[run] for every in result["ranks"]]
            predicted = predictions(run, shape, world_size, result["flops"], mfu, result["link"], batch, length, units)
            rows.append({"ranks": world_size, "run": run, "flops": result["flops"], "link": result["link"], "mfu": mfu,
                         "collectives": predicted.collectives,
                         "measured": {part: max(rank[part] for rank in ranks) for part in PARTS}
                         | {"step_s": max(rank["step_s"] for rank in ranks)},
                         "predicted": {"params": predicted.param_bytes, "grads": predicted.grad_bytes,
                                       "optimizer": predicted.optimizer_bytes, "step_s": predicted.step_s}})
    return rows


def table(rows: list[dict], params: int) -> str:
    lines = [f"Ψ = {params:,} parameters, fp32 AdamW; bytes on the busiest rank, measured (predicted); "
             "step time of the slowest rank",
             "| ranks | run | parameters B | gradients B | optimizer state B | worst byte error "
             "| GFLOP/s per process | MFU | link GB/s, µs | collectives | step ms measured | step ms predicted "
             "| step error |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        measured, predicted, link = row["measured"], row["predicted"], row["link"]
        cells = [f"{measured[part]:,} ({predicted[part]:,.0f})" for part in PARTS]
        worst = max(abs(measured[part] / predicted[part] - 1) for part in PARTS)
        network = "-" if row["ranks"] == 1 else f"{link.bandwidth / 1e9:.2f}, {link.latency * 1e6:.0f}"
        lines.append(f"| {row['ranks']} | {row['run']} | {' | '.join(cells)} | {worst:.2%} | {row['flops'] / 1e9:.1f} "
                     f"| {row['mfu']:.2f} | {network} | {row['collectives']} | {measured['step_s'] * 1e3:.1f} | {predicted['step_s'] * 1e3:.1f} "
                     f"| {predicted['step_s'] / measured['step_s'] - 1:+.0%} |")
    errors = [abs(row["predicted"]["step_s"] / row["measured"]["step_s"] - 1) for row in rows]
    lines.append(f"step time: median error {statistics.median(errors):.0%}, largest {max(errors):.0%}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import finish
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for index, run in enumerate(RUNS):
        mine = [row for row in rows if row["run"] == run]
        for ax, key, unit in ((axes[0], "bytes", 1e6), (axes[1], "step_s", 1e-3)):
            if key == "bytes":
                points = [(sum(row["predicted"][p] for p in PARTS) / unit, sum(row["measured"][p] for p in PARTS) / unit)
                          for row in mine]
            else:
                points = [(row["predicted"][key] / unit, row["measured"][key] / unit) for row in mine]
            ax.scatter(*zip(*points), color=f"C{index}", label=run, s=28)
            for (x, y), row in zip(points, mine):
                ax.annotate(str(row["ranks"]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax, name in ((axes[0], "parameters + gradients + optimizer state per rank, MB"), (axes[1], "time per step, ms")):
        low, high = min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([low, high], [low, high], color="grey", lw=0.8, ls="--")
        ax.fill_between([low, high], [low * 0.75, high * 0.75], [low * 1.25, high * 1.25], color="grey", alpha=0.1)
        ax.set_xlabel(f"predicted {name}", fontsize=9)
        ax.set_ylabel(f"measured {name}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, title="run (label: processes)", title_fontsize=8)
    axes[1].set_title("shaded: within 25 %", fontsize=8)
    finish(fig, path, title)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model folder whose config.json to use (default: a small BERT, "
                                        "hidden 192, 2 layers)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--batch", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is left out of the timing")
    parser.add_argument("--plot", help="also save predicted against measured to this PNG")
    args = parser.parse_args()
    if args.model:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(args.model, num_labels=3)
    else:
        config = small_bert()
    rows = check(config, args.world_sizes, args.batch, args.length, args.steps)
    from transformers import AutoModelForSequenceClassification
    print(table(rows, model_of_config(config, AutoModelForSequenceClassification).params))
    if args.plot:
        plot(rows, args.plot, f"planner.plan predicted vs measured, gloo processes on one {machine_name()}")


if __name__ == "__main__":
    main()
