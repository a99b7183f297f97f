"""Figure: backward overlapped with bucketed all-reduce, measured, per rank.

Two gloo processes train a stack of equal linear layers (common.lessons.bucketing.linear_stack, 8 x
Linear(1024, 1024): 32 MiB of gradients, batch 64 each) with four configurations: ours
(common/lessons/bucketing.py) with one bucket after backward, with 1 MiB buckets and with 25 MiB buckets, and
torch's DistributedDataParallel (bucket_cap_mb is in MiB, 2**20 bytes, for both; the figure says MiB,
the recording keeps the configurations' names, "1 MB", that the tests read). One training step after
warm-up is timed on each rank:
- compute lane: forward, backward with a tick when each parameter's gradient is ready (a
  post-accumulate-grad hook registered after BucketedDataParallel's own, or beside DDP's), optimizer;
- all-reduce lane: each bucket from launch (ours: its hook returned the async work; DDP: the
  communication hook was called) to finish (the all-reduce's future completed).
time.perf_counter is one clock for all processes of a Linux machine, so the ranks share the time axis.
Drawn for a 720-px page column: buckets in flight together get rows of their own, each numbered left of
its bar, with room kept for the number.

    python figures/overlap_timeline.py          # images/overlap_timeline.png
    python figures/overlap_timeline.py --toy    # seconds: 4 x Linear(256, 256)
"""
import time

import torch
import torch.distributed as dist
from style import COLORS, IMAGES, parser, plt, save
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from common.lessons.bucketing import BucketedDataParallel, linear_stack
from common.machine import machine_name
from common.spawn import run_in_process_group

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


TITLES = {"ours, 1 MB buckets": "ours, 1 MiB buckets (bucket_cap_mb=1)", "ours, 25 MB buckets": "ours, 25 MiB buckets "
          "(bucket_cap_mb=25)", "torch DDP (bucket_cap_mb=25)": "torch DDP (bucket_cap_mb=25, in MiB)"}  # the cap is in MiB
# drawn for a 720-px page column: 7.5 in wide, saved at 120 dpi (900 px) and shown at 720 px, so 1 pt is 1.33 px
# there and no text is under 9 pt (12 px). Lengths below are in inches; the lanes' y axes are in inches too.
WIDTH, LEFT, RIGHT = 7.5, 1.45, 0.12  # the figure, the lanes' names to the left of the axes, the margin right of them
COMPUTE, PITCH, PAD = 0.3, 0.105, 0.06  # a compute lane; one row of buckets in flight together (a 9-pt digit is 6.6 pt
# tall: numbers in neighbouring rows do not touch); the space above and below a lane's rows
LABEL_PT = 9  # bucket numbers


def rows_for(intervals: list[tuple[float, float]], room: float) -> list[int]:
    """A row for each interval (start, end), the lowest whose last interval ended room before it starts: buckets in
    flight together get rows of their own, and each bucket's number has room to the left of its bar."""
    ends: list[float] = []
    rows = []
    for start, end in intervals:
        row = next((row for row, last in enumerate(ends) if last + room <= start), len(ends))
        ends[row:row + 1] = [end]
        rows.append(row)
    return rows


def draw(recording: dict, path) -> None:
    names = list(recording["timelines"])
    world_size = recording["world_size"]
    zeros = {name: min(rank["marks"]["start"] for rank in ranks) for name, ranks in recording["timelines"].items()}
    right_end = max((rank["marks"]["optimizer"] - zeros[name]) * 1e3 for name, ranks in recording["timelines"].items()
                    for rank in ranks) * 1.03
    ms_per_inch = right_end / (WIDTH - LEFT - RIGHT)
    digit = 0.62 * LABEL_PT / 72 * ms_per_inch  # a digit's width in ms (DejaVu Sans: 0.64 em)
    layouts = []  # per panel: per rank, the bucket indices, their (start, end) in ms and rows
    for name in names:
        ranks = recording["timelines"][name]
        layout = []
        for timeline in ranks:
            indices = sorted(timeline["launch"], key=lambda i: (timeline["launch"][i], i))
            spans = [tuple((timeline[key][i] - zeros[name]) * 1e3 for key in ("launch", "finish")) for i in indices]
            layout.append((indices, spans, rows_for(spans, digit * (len(str(max(indices))) + 1))))
        layouts.append(layout)
    lanes = [[max(COMPUTE, PITCH * (max(rows) + 1) + 2 * PAD) for _, _, rows in layout] for layout in layouts]  # all-reduce
    panels = [sum(lane + COMPUTE for lane in panel) for panel in lanes]
    title_gap, top, bottom = 0.4, 0.95, 1.0  # above each panel for its title; the figure's title; the axis and legend
    height = top + sum(panel + title_gap for panel in panels) + bottom
    fig = plt.figure(figsize=(WIDTH, height))
    axes = []
    for position, (name, layout, panel) in enumerate(zip(names, layouts, panels)):
        y0 = height - top - sum(panels[:position + 1]) - (position + 1) * title_gap  # the panel's bottom
        ax = fig.add_axes((LEFT / WIDTH, y0 / height, (WIDTH - LEFT - RIGHT) / WIDTH, panel / height),
                          sharex=axes[0] if axes else None)
        axes.append(ax)
        ranks = recording["timelines"][name]
        zero = zeros[name]
        ticks = []
        for rank, (timeline, (indices, spans, rows), reduce_lane) in enumerate(zip(ranks, layout, lanes[position])):
            ms = {key: (value - zero) * 1e3 for key, value in timeline["marks"].items()}
            lane = panel - sum(lanes[position][:rank + 1]) - (rank + 1) * COMPUTE  # the all-reduce lane's bottom
            middle = lane + reduce_lane + COMPUTE / 2
            ax.barh(middle, ms["forward"] - ms["start"], left=ms["start"], height=0.7 * COMPUTE, color="#cccccc")
            ax.barh(middle, ms["backward"] - ms["forward"], left=ms["forward"], height=0.7 * COMPUTE, color=COLORS[0], alpha=0.3)
            ax.vlines([(t - zero) * 1e3 for t in timeline["ticks"]], middle - 0.35 * COMPUTE, middle + 0.35 * COMPUTE,
                      color=COLORS[0], lw=1.2)
            ax.barh(middle, ms["optimizer"] - ms["synchronized"], left=ms["synchronized"], height=0.7 * COMPUTE, color=COLORS[2])
            ax.vlines(ms["synchronized"], lane, lane + reduce_lane + COMPUTE, color="#555555", lw=0.8, ls=":")
            for index, (start, end), row in zip(indices, spans, rows):
                y = lane + reduce_lane - PAD - (row + 0.5) * PITCH
                ax.barh(y, end - start, left=start, height=0.75 * PITCH, color=COLORS[(1, 3, 4, 5)[index % 4]])
                if len(indices) > 1:  # one bucket needs no number
                    ax.text(start, y, f"{index} ", va="center", ha="right", fontsize=LABEL_PT)
            if rank < world_size - 1:
                ax.axhline(lane, color="#bbbbbb", lw=0.8)
            ticks += [(middle, f"rank {rank} compute"), (lane + reduce_lane / 2, f"rank {rank} all-reduce")]
        ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=9)
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(0, panel)
        ax.set_xlim(0, right_end)
        step_seconds = max(r["marks"]["optimizer"] for r in ranks) - zero
        ax.set_title(f"{TITLES.get(name, name)}: step {step_seconds * 1e3:.0f} ms (slowest rank)", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
        if position < len(names) - 1:
            ax.tick_params(axis="x", labelbottom=False)
    axes[-1].tick_params(axis="x", labelsize=9)
    axes[-1].set_xlabel("milliseconds from the start of the step, both ranks on one clock", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color="#cccccc", label="forward"),
               plt.Rectangle((0, 0), 1, 1, color=COLORS[0], alpha=0.3, label="backward"),
               plt.Line2D([], [], color=COLORS[0], lw=1.2, label="a gradient ready"),
               plt.Rectangle((0, 0), 1, 1, color=COLORS[1], label="a bucket's all-reduce, numbered"),
               plt.Line2D([], [], color="#555555", lw=0.8, ls=":", label="gradients synchronized"),
               plt.Rectangle((0, 0), 1, 1, color=COLORS[2], label="optimizer")]
    fig.legend(handles=handles, loc="lower center", ncols=3, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.0))
    size = recording["size"]
    fig.text(0.5, 1 - 0.08 / height, f"Measured overlap of backward and gradient all-reduce: {world_size} gloo processes,\n"
             f"{size['layers']} x Linear({size['width']}, {size['width']}), batch {size['batch']} each, one step after "
             f"{size['warmup']} warm-up, {machine_name()}.\nOn a CPU, gloo's all-reduce runs in threads on the same cores as "
             "backward: overlapped\ncommunication slows the backward it overlaps, so the hiding is partial, unlike on GPUs.",
             ha="center", va="top", fontsize=9.5, linespacing=1.35)
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "overlap_timeline.png", toy=True).parse_args()
    draw(run_in_process_group(record, 2, "toy" if args.toy else "default", timeout=300), args.out)


if __name__ == "__main__":
    main()
