"""Figure: where a training step's time goes, from torch.profiler events of real runs.

Two gloo processes train the same stack of linear layers as figures/overlap_timeline.py (8 x
Linear(1024, 1024), batch 64 each) with each configuration, under torch.profiler. Each phase of the
step is a record_function range; the end of the last AccumulateGrad event inside backward is the
moment the last gradient was ready. Per step:
  forward                    the forward range
  backward                   from the start of backward to the last gradient ready (ours includes
                             packing each bucket; all-reduces that overlap it are hidden in it)
  exposed communication      the rest of backward (DDP waits for its all-reduces there) plus
                             wait_for_gradients() (ours): time the step waits on the network alone
  optimizer                  the optimizer range (SGD step and zero_grad)
Bars: the median over the profiled steps, averaged over the two ranks. bucket_cap_mb is in MiB
(2**20 bytes): the bars say "1 MiB buckets"; the recording keeps overlap_timeline's configuration
names ("1 MB"), which the tests read.

    python figures/step_time_breakdown.py       # images/step_time_breakdown.png
    python figures/step_time_breakdown.py --toy # seconds: 4 x Linear(256, 256), 2 steps
"""
import statistics

import torch
import torch.distributed as dist
from overlap_timeline import CONFIGS, SIZES, step, wrap
from style import COLORS, IMAGES, parser, plt, save, stacked_milliseconds
from torch.profiler import ProfilerActivity, profile

from common.lessons.bucketing import linear_stack
from common.machine import machine_name
from common.spawn import run_in_process_group

CONFIGURATIONS = {"each process alone (no communication)": "alone", **CONFIGS}
PHASES = ["forward", "backward", "exposed communication", "optimizer"]
STEPS = {"default": 10, "toy": 2}
LABELS = {"ours, 1 MB buckets": "ours, 1 MiB buckets", "ours, 25 MB buckets": "ours, 25 MiB buckets",
          "torch DDP (bucket_cap_mb=25)": "torch DDP (bucket_cap_mb=25, in MiB)"}  # displayed; the keys stay


def ranges(events, name: str) -> list[tuple[float, float]]:
    return sorted((e.time_range.start, e.time_range.end) for e in events if e.name == name)


def phases(events) -> list[dict]:
    """Per profiled step, milliseconds in each phase."""
    gradients_ready = [e.time_range.end for e in events if "AccumulateGrad" in e.name]
    steps = []
    for forward, backward, wait, optimizer in zip(*(ranges(events, name) for name in
                                                    ("forward", "backward", "wait for gradients", "optimizer"))):
        last_gradient = max(t for t in gradients_ready if backward[0] <= t <= backward[1])
        steps.append({"forward": forward[1] - forward[0], "backward": last_gradient - backward[0],
                      "exposed communication": backward[1] - last_gradient + wait[1] - wait[0],
                      "optimizer": optimizer[1] - optimizer[0]})
    return [{phase: microseconds / 1e3 for phase, microseconds in s.items()} for s in steps]


def profiled_run(config, layers, width, batch, warmup, steps) -> dict:
    torch.manual_seed(0)
    model = wrap(linear_stack(layers, width), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(batch, width)
    for _ in range(warmup):
        step(model, optimizer, inputs, {})
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            dist.barrier()
            step(model, optimizer, inputs, {})
    measured = phases(profiler.events())
    return {phase: statistics.median(s[phase] for s in measured) for phase in PHASES}


def record(rank: int, world_size: int, size: str = "default") -> dict:
    """Per configuration, each rank's median milliseconds per phase."""
    results = {}
    for name, config in CONFIGURATIONS.items():
        everyone = [None] * world_size
        dist.all_gather_object(everyone, profiled_run(config, **SIZES[size], steps=STEPS[size]))
        results[name] = everyone
    return {"size": SIZES[size], "steps": STEPS[size], "world_size": world_size, "results": results}


def averaged(recording: dict) -> dict[str, dict[str, float]]:
    return {name: {phase: statistics.fmean(rank[phase] for rank in ranks) for phase in PHASES}
            for name, ranks in recording["results"].items()}


def draw(recording: dict, path) -> None:
    bars = {LABELS.get(name, name): phases for name, phases in averaged(recording).items()}
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.5 * len(bars)))
    stacked_milliseconds(ax, bars, PHASES, [COLORS[7], COLORS[0], COLORS[3], COLORS[2]],
                         "milliseconds per training step (median of the profiled steps, mean of the ranks)")
    size = recording["size"]
    ax.set_title(f"Where a step's time goes, from torch.profiler events: {recording['world_size']} gloo processes, "
                 f"{size['layers']} x Linear({size['width']}, {size['width']}),\nbatch {size['batch']} each, "
                 f"{recording['steps']} steps profiled, {machine_name()}.\nCommunication shares the cores with compute "
                 "here, so hidden communication still lengthens backward.", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "step_time_breakdown.png", toy=True).parse_args()
    draw(run_in_process_group(record, 2, "toy" if args.toy else "default", timeout=300), args.out)


if __name__ == "__main__":
    main()
