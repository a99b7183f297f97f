"""Draw what each of 4 ranks holds under DDP and ZeRO stages 1-3, and which collective moves what.

Each rank holds three bars: parameters (4Ψ bytes in fp32), gradients (4Ψ) and AdamW's optimizer state
(8Ψ), drawn to scale and cut into 4 shards. A filled shard is held by that rank, an empty one is not.
The SVG is byte-stable (fixed hash salt, no date), so tests/test_figures.py redraws it and compares.

    python figures/zero_stages.py      # writes images/zero_stages.svg and images/zero_stages.png
"""
from pathlib import Path

from matplotlib.patches import Rectangle
from style import IMAGES, parser, plt, save, stable_svg_style

RANKS = 4
TERMS = [("parameters 4Ψ", 4, "#1f77b4"), ("gradients 4Ψ", 4, "#ff7f0e"), ("optimizer state 8Ψ", 8, "#2ca02c")]
ROWS = [  # name, how many of the three terms are sharded, per-rank bytes, what moves in one step
    ("DDP", 0, "16Ψ", "all-reduce the gradients (in buckets, during backward)\nsent per rank: 2(N−1)/N · 4Ψ"),
    ("ZeRO-1", 1, "8Ψ + 8Ψ/N", "reduce-scatter the gradients: rank r gets the average of shard r\n"
                               "step AdamW on shard r; all-gather the parameters\nsent per rank: 2(N−1)/N · 4Ψ, as DDP"),
    ("ZeRO-2", 2, "4Ψ + 12Ψ/N", "reduce-scatter each layer's gradient as backward produces it,\n"
                                "then free it; step shard r; all-gather the parameters\nsent per rank: 2(N−1)/N · 4Ψ, as DDP"),
    ("ZeRO-3\n(FSDP)", 3, "16Ψ/N", "all-gather each layer's parameters before its forward and again\n"
                                   "before its backward, free them after; reduce-scatter gradients\n"
                                   "sent per rank: 3(N−1)/N · 4Ψ, 1.5× DDP"),
]


def draw(svg_path: Path) -> None:
    """The SVG at svg_path, and a PNG beside it for the docs: 9 inches wide, so that its smallest text is
    about 11 px in a 720-px column."""
    stable_svg_style()
    row_h = 3.1  # drawing units per row: the ranks' three bars, then what moves, under them
    fig, ax = plt.subplots(figsize=(9, 10.4))
    ax.set_xlim(0, 19)
    ax.set_ylim(-1.6, len(ROWS) * row_h + 0.5)
    ax.axis("off")
    scale, bar_h = 0.1125, 0.36  # drawing units per Ψ-byte, bar height
    for row, (name, sharded, total, moves) in enumerate(ROWS):
        top = (len(ROWS) - row) * row_h
        ax.text(0.1, top - 0.45, name, fontsize=13, fontweight="bold", va="center")
        ax.text(0.1, top - 1.15, f"{total}\nper rank", fontsize=10.5, va="center")
        for rank in range(RANKS):
            left = 2.9 + rank * 4.1
            if row == 0:
                ax.text(left + 1.8, top + 0.2, f"rank {rank}", fontsize=11, ha="center")
            for term, (label, size, color) in enumerate(TERMS):
                y = top - 0.45 - term * (bar_h + 0.14)
                shard_w = size * scale
                for shard in range(RANKS):
                    held = term < 3 - sharded or shard == rank  # the last `sharded` terms are cut over ranks
                    ax.add_patch(Rectangle((left + shard * shard_w, y), shard_w, bar_h, linewidth=0.6,
                                           edgecolor=color, facecolor=color if held else "white"))
        ax.text(2.9, top - 1.75, moves, fontsize=10.5, va="top", linespacing=1.4)
    for term, (label, _, color) in enumerate(TERMS):
        ax.add_patch(Rectangle((0.1 + term * 5.6, -0.85), 0.5, 0.3, facecolor=color, edgecolor=color))
        ax.text(0.75 + term * 5.6, -0.7, label, fontsize=10.5, va="center")
    ax.add_patch(Rectangle((0.1, -1.45), 0.5, 0.3, facecolor="white", edgecolor="black", linewidth=0.6))
    ax.text(0.75, -1.3, "a shard this rank does not hold;   Ψ parameters, fp32 AdamW, N = 4 ranks",
            fontsize=10.5, va="center")
    ax.set_title("What each rank holds, and what moves in one training step", fontsize=14)
    fig.tight_layout()
    save(fig, svg_path, svg_path.with_suffix(".png"))


def main():
    draw(parser(__doc__, IMAGES / "zero_stages.svg").parse_args().out)


if __name__ == "__main__":
    main()
