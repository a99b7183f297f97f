"""Figure: where one training step of mnist_1_single.py goes, eager against compiled, from torch.profiler.

BasicNet, batch 64, channels_last, the precision --precision auto picks on this machine, AdamW: the
step of src/ch4/mnist_1_single.py without its data loader (random images of MNIST's shape), in one
process. Each phase is a record_function range; inside forward and backward, the time of two kinds of
eager operator is taken out and shown on its own, because that is what the profile of the eager step
is made of besides the arithmetic:
  dropout masks     aten::uniform_ (torch.rand filling BasicNet's masks: common.mnist.Dropout)
  dtype casts       aten::_to_copy (autocast casting weights and activations to bf16 and back)
Compiled, both happen inside inductor's generated kernels, fused with the arithmetic around them,
and the two segments are (near) zero. The compile itself happens in the warm-up steps, not shown.
Bars: the median over the profiled steps.

    python figures/compile_breakdown.py       # images/compile_breakdown.png
    python figures/compile_breakdown.py --toy # seconds: 2 steps, aot_eager instead of inductor
"""
import statistics

import torch
import torch.nn.functional as F
from style import COLORS, IMAGES, parser, plt, save, stacked_milliseconds
from torch.profiler import ProfilerActivity, profile, record_function

from common.compile import compiled
from common.machine import machine_name
from common.mnist import BasicNet
from common.precision import auto_precision, autocast

SEGMENTS = ["dropout masks", "dtype casts", "forward, the rest", "backward, the rest", "optimizer"]
KINDS = {"dropout masks": "aten::uniform_", "dtype casts": "aten::_to_copy"}
SIZES = {"default": {"warmup": 5, "steps": 20, "backend": "inductor"},
         "toy": {"warmup": 1, "steps": 2, "backend": "aot_eager"}}


def step(model, optimizer, images, labels, device, precision):
    with record_function("forward"):
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
    with record_function("backward"):
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()


def inside(events, name: str, start: float, end: float) -> float:
    """Microseconds of the outermost `name` events within [start, end]."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == name
                   and start <= e.time_range.start and e.time_range.end <= end)
    total, reach = 0.0, -1.0
    for a, b in spans:
        if a >= reach:  # not nested in the one before
            total += b - a
            reach = b
    return total


def phases(events) -> list[dict]:
    """Per profiled step, milliseconds in each segment."""
    ranges = {name: sorted((e.time_range.start, e.time_range.end) for e in events if e.name == name)
              for name in ("forward", "backward", "optimizer")}
    steps = []
    for forward, backward, optimizer in zip(ranges["forward"], ranges["backward"], ranges["optimizer"]):
        kinds = {kind: inside(events, op, forward[0], backward[1]) for kind, op in KINDS.items()}
        in_forward = sum(inside(events, op, *forward) for op in KINDS.values())
        steps.append({**kinds, "forward, the rest": forward[1] - forward[0] - in_forward,
                      "backward, the rest": backward[1] - backward[0] - (sum(kinds.values()) - in_forward),
                      "optimizer": optimizer[1] - optimizer[0]})
    return [{segment: microseconds / 1e3 for segment, microseconds in s.items()} for s in steps]


def record(size: str = "default") -> dict:
    """Median milliseconds per segment, eager and compiled."""
    settings = SIZES[size]
    device = torch.device("cpu")
    precision = auto_precision(device)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 28, 28, generator=generator).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (64,), generator=generator)
    results = {}
    for name, backend in (("eager", None), (f"compiled ({settings['backend']})", settings["backend"])):
        torch.manual_seed(0)
        model = BasicNet().to(memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model = compiled(model, backend)
        for _ in range(settings["warmup"]):  # compiles, where compiled
            step(model, optimizer, images, labels, device, precision)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(settings["steps"]):
                step(model, optimizer, images, labels, device, precision)
        measured = phases(profiler.events())
        results[name] = {segment: statistics.median(s[segment] for s in measured) for segment in SEGMENTS}
    return {"results": results, "precision": precision, "steps": settings["steps"], "machine": machine_name(),
            "torch": torch.__version__}


def draw(recording: dict, path) -> None:
    bars = recording["results"]
    fig, ax = plt.subplots(figsize=(11, 2.6))
    stacked_milliseconds(ax, bars, SEGMENTS, [COLORS[3], COLORS[1], COLORS[7], COLORS[0], COLORS[2]],
                         "milliseconds per training step (median of the profiled steps)")
    ax.set_title(f"One step of mnist_1_single.py (BasicNet, batch 64, {recording['precision']}, AdamW, no data "
                 f"loading), eager and compiled:\n{recording['steps']} steps profiled, one process, "
                 f"{recording['machine']}, torch {recording['torch']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "compile_breakdown.png", toy=True).parse_args()
    recording = record("toy" if args.toy else "default")
    for name, segments in recording["results"].items():
        print(name, {segment: round(ms, 2) for segment, ms in segments.items()})
    draw(recording, args.out)


if __name__ == "__main__":
    main()
