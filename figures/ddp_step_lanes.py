"""Draw one DDP training step as two lanes: compute, and the gradient all-reduces that overlap it.

A schematic of what common/lessons/bucketing.py and DDP do, before the measured timeline of
figures/overlap_timeline.py: backward produces the gradients last layer first, they fill buckets in
that order, and each full bucket's all-reduce starts while backward goes on with earlier layers;
only what is still in flight when backward ends delays the optimizer step. Durations are illustrative.

    python figures/ddp_step_lanes.py      # writes images/ddp_step_lanes.svg
"""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

LAYERS = 4
BUCKETS = [(4, 3), (2, 1)]  # layers whose gradients each bucket holds, in the order backward fills them
FORWARD, BACKWARD_PER_LAYER, ALL_REDUCE, OPTIMIZER = 3.0, 1.6, 2.4, 1.6


def schedule() -> dict:
    """Start and end of every box: forward, each layer's backward (last layer first), each bucket's
    all-reduce (from its last gradient, one at a time), the exposed wait, the optimizer step."""
    backward = {}
    clock = FORWARD
    for layer in range(LAYERS, 0, -1):
        backward[layer] = (clock, clock + BACKWARD_PER_LAYER)
        clock += BACKWARD_PER_LAYER
    reduces, link_free = [], 0.0
    for layers in BUCKETS:
        start = max(backward[min(layers)][1], link_free)  # the bucket is full when its earliest layer is done
        reduces.append((layers, start, start + ALL_REDUCE))
        link_free = start + ALL_REDUCE
    synced = max(clock, link_free)
    return {"forward": (0.0, FORWARD), "backward": backward, "reduces": reduces, "wait": (clock, synced),
            "optimizer": (synced, synced + OPTIMIZER)}


def draw(svg_path: Path) -> None:
    stable_svg_style()
    plan = schedule()
    fig, ax = plt.subplots(figsize=(10, 2.9))
    compute_y, comm_y, height = 1.6, 0.4, 0.7
    ax.set_xlim(-2.4, plan["optimizer"][1] + 0.2)
    ax.set_ylim(-0.75, 2.75)
    ax.axis("off")
    ax.text(-0.15, compute_y + height / 2, "compute", ha="right", va="center", fontsize=10)
    ax.text(-0.15, comm_y + height / 2, "communication\n(all-reduce)", ha="right", va="center", fontsize=10)

    def box(start, end, y, color, label, hatch=None, text_color="white"):
        ax.add_patch(Rectangle((start, y), end - start, height, facecolor=color,
                               edgecolor=COLORS[7] if hatch else "white", hatch=hatch))
        ax.text((start + end) / 2, y + height / 2, label, ha="center", va="center", fontsize=9, color=text_color)

    box(*plan["forward"], compute_y, COLORS[7], "forward")
    for layer, (start, end) in plan["backward"].items():
        box(start, end, compute_y, COLORS[0], f"backward\nlayer {layer}")
    for index, (layers, start, end) in enumerate(plan["reduces"]):
        box(start, end, comm_y, COLORS[1 + 2 * index], f"bucket {index}\nlayers {layers[0]}, {layers[1]}")
        ready = plan["backward"][min(layers)][1]
        ax.add_patch(FancyArrowPatch((ready, compute_y), (start, comm_y + height), arrowstyle="-|>",
                                     mutation_scale=9, color="black", linewidth=0.8))
    if plan["wait"][1] > plan["wait"][0]:
        box(*plan["wait"], compute_y, "white", "wait", hatch="///", text_color="black")
    box(*plan["optimizer"], compute_y, COLORS[2], "optimizer\nstep")
    ax.text(0, -0.3, "Backward produces gradients last layer first. A bucket's all-reduce starts as soon as its last "
            "gradient is ready,\nwhile backward goes on; only the part still running when backward ends (hatched) "
            "delays the optimizer step.", fontsize=9, va="top")
    ax.set_title("One DDP training step on one rank (every rank runs the same, in step)", fontsize=11)
    fig.tight_layout()
    save(fig, svg_path)


if __name__ == "__main__":
    draw(parser(__doc__, IMAGES / "ddp_step_lanes.svg").parse_args().out)
