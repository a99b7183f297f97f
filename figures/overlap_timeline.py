"""Figure: backward overlapped with bucketed all-reduce, measured, per rank.

Two gloo processes train a stack of equal linear layers (common.bucketing.linear_stack, 8 x
Linear(1024, 1024): 32 MB of gradients, batch 64 each) with four configurations: ours
(common/bucketing.py) with one bucket after backward, with 1 MB buckets and with 25 MB buckets, and
torch's DistributedDataParallel. One training step after warm-up is timed on each rank:
- backward lane: a tick when each parameter's gradient is ready (a post-accumulate-grad hook
  registered after BucketedDataParallel's own, or beside DDP's);
- all-reduce lane: each bucket from launch (ours: its hook returned the async work; DDP: the
  communication hook was called) to finish (the all-reduce's future completed).
time.perf_counter is one clock for all processes of a Linux machine, so the ranks share the time axis.

    python figures/overlap_timeline.py          # images/overlap_timeline.png
    python figures/overlap_timeline.py --toy    # seconds: 4 x Linear(256, 256)
"""
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from common.bucketing import BucketedDataParallel, linear_stack
from common.machine import machine_name
from common.spawn import run_in_process_group
from style import COLORS, IMAGES, parser, plt, save

CONFIGS = {"ours, one bucket after backward": None, "ours, 1 MB buckets": 1, "ours, 25 MB buckets": 25,
           "torch DDP (bucket_cap_mb=25)": "ddp"}
SIZES = {"default": {"layers": 8, "width": 1024, "batch": 64, "warmup": 3},
         "toy": {"layers": 4, "width": 256, "batch": 4, "warmup": 1}}


def wrap(module, config):
    """The model in the configuration's wrapper: DDP, ours with bucket_cap_mb=config, or none ("alone")."""
    if config == "alone":
        return module
    return DDP(module) if config == "ddp" else BucketedDataParallel(module, bucket_cap_mb=config)


def step(model, optimizer, inputs, marks: dict) -> None:
    """One training step; marks gets the time each phase ended, and a profiler sees each phase as a range."""
    marks["start"] = time.perf_counter()
    with record_function("forward"):
        loss = model(inputs).square().mean()
    marks["forward"] = time.perf_counter()
    with record_function("backward"):
        loss.backward()
    marks["backward"] = time.perf_counter()
    with record_function("wait for gradients"):
        if isinstance(model, BucketedDataParallel):
            model.wait_for_gradients()
    marks["synchronized"] = time.perf_counter()
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    marks["optimizer"] = time.perf_counter()


def timed_run(config, layers, width, batch, warmup) -> dict:
    """warmup steps, then one step with every gradient tick and every bucket's launch and finish."""
    torch.manual_seed(0)
    model = wrap(linear_stack(layers, width), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(batch, width)
    timeline = {"ticks": [], "launch": {}, "finish": {}, "recording": False}
    callbacks = []  # ours: the futures of the finish callbacks, which may run just after wait() returns

    def finished(index):
        def record(future):
            timeline["finish"][index] = time.perf_counter()
            return future.value()
        return record

    def gradient_ready(param):
        if not timeline["recording"]:
            return
        timeline["ticks"].append(time.perf_counter())
        if isinstance(model, BucketedDataParallel) and len(model._in_flight) > len(timeline["launch"]):
            index, _, work = model._in_flight[-1]  # the bucket this gradient completed was just launched
            timeline["launch"][index] = timeline["ticks"][-1]
            callbacks.append(work.get_future().then(finished(index)))

    def timed_all_reduce(state, bucket):
        if timeline["recording"]:
            timeline["launch"][bucket.index()] = time.perf_counter()
            return default_hooks.allreduce_hook(None, bucket).then(finished(bucket.index()))
        return default_hooks.allreduce_hook(None, bucket)

    if config == "ddp":
        model.register_comm_hook(None, timed_all_reduce)
    hooks = [param.register_post_accumulate_grad_hook(gradient_ready) for param in model.parameters()]
    marks = {}
    for index in range(warmup + 1):
        timeline["recording"] = index == warmup
        dist.barrier()
        step(model, optimizer, inputs, marks)
    torch.futures.wait_all(callbacks)
    for hook in hooks:  # gradient_ready holds the model: left on DDP's parameters, that cycle runs through DDP's
        hook.remove()  # reducer (C++, out of the garbage collector's sight) and keeps the process group alive
    timeline.pop("recording")
    return {**timeline, "marks": marks}


def record(rank: int, world_size: int, size: str = "default") -> dict:
    """Every rank's timeline for each configuration, gathered on every rank."""
    timelines = {}
    for name, config in CONFIGS.items():
        mine = timed_run(config, **SIZES[size])
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        timelines[name] = everyone
    return {"size": SIZES[size], "world_size": world_size, "timelines": timelines}


def draw(recording: dict, path) -> None:
    names = list(recording["timelines"])
    world_size = recording["world_size"]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.6 + 1.35 * len(names) * world_size / 2), sharex=True)
    for ax, name in zip(axes, names):
        ranks = recording["timelines"][name]
        zero = min(rank["marks"]["start"] for rank in ranks)
        labels = []
        for rank, timeline in enumerate(ranks):
            ms = {key: (value - zero) * 1e3 for key, value in timeline["marks"].items()}
            lane = (world_size - 1 - rank) * 2
            ax.barh(lane + 1, ms["forward"] - ms["start"], left=ms["start"], height=0.6, color="#dddddd")
            ax.barh(lane + 1, ms["backward"] - ms["forward"], left=ms["forward"], height=0.6, color=COLORS[0], alpha=0.25)
            ax.vlines([(t - zero) * 1e3 for t in timeline["ticks"]], lane + 0.72, lane + 1.28, color=COLORS[0], lw=1)
            for index in sorted(timeline["launch"]):
                start, end = ((timeline[key][index] - zero) * 1e3 for key in ("launch", "finish"))
                row = lane - 0.27 + 0.18 * (index % 4)  # buckets in flight together get rows of their own
                ax.barh(row, end - start, left=start, height=0.16, color=COLORS[(1, 3, 4, 5)[index % 4]])
                ax.text(start, row, f"{index} ", va="center", ha="right", fontsize=5)
            ax.barh(lane + 1, ms["optimizer"] - ms["synchronized"], left=ms["synchronized"], height=0.6, color=COLORS[2])
            ax.axvline(ms["synchronized"], ymin=0, ymax=1, color="#888888", lw=0.5, ls=":")
            labels += [(lane, f"rank {rank} all-reduce"), (lane + 1, f"rank {rank} fwd / bwd / opt")]
        ax.set_yticks([lane for lane, _ in labels], [label for _, label in labels], fontsize=7)
        step_seconds = max(r["marks"]["optimizer"] for r in ranks) - zero
        ax.set_title(f"{name}: step {step_seconds * 1e3:.0f} ms (slowest rank)", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("milliseconds from the start of the step, both ranks on one clock\ngrey: forward, blue: "
                        "backward with a tick per gradient ready, numbered bars: bucket all-reduces from launch to "
                        "finish, dotted: gradients synchronized, green: optimizer", fontsize=8)
    size = recording["size"]
    fig.suptitle(f"Measured overlap of backward and gradient all-reduce: {world_size} gloo processes, "
                 f"{size['layers']} x Linear({size['width']}, {size['width']}), batch {size['batch']} each, "
                 f"one step after {size['warmup']} warm-up,\n{machine_name()}. On a CPU, gloo's all-reduce runs in "
                 "threads on the same cores as backward:\noverlapped communication slows the backward it overlaps, so "
                 "the hiding is partial, unlike on GPUs with links of their own.", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "overlap_timeline.png", toy=True).parse_args()
    draw(run_in_process_group(record, 2, "toy" if args.toy else "default", timeout=300), args.out)


if __name__ == "__main__":
    main()
