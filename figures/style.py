"""What every figure script shares: a headless matplotlib, byte-stable SVGs, the machine's name.

A schematic is saved so that the same data gives the same bytes: a fixed SVG hash salt (matplotlib
otherwise draws random ids), no creation date, text kept as text (no font outlines, which differ
between matplotlib versions). tests/test_figures.py regenerates each schematic and compares bytes.
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

IMAGES = Path(__file__).resolve().parent.parent / "images"
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"]


def stable_svg_style() -> None:
    plt.rcParams.update({"svg.hashsalt": "data-parallel-pytorch", "svg.fonttype": "none", "font.size": 9})


def save(fig, *paths) -> None:
    """Save a figure to each path; an SVG without a date, so that regenerating it from the same data
    changes no byte."""
    for path in map(Path, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".svg":
            fig.savefig(path, metadata={"Date": None})  # the Creator entry keeps the matplotlib version
        else:
            fig.savefig(path, dpi=120)
        print(f"saved {path}")
    plt.close(fig)


def parser(doc: str, default: Path, toy: bool = False) -> argparse.ArgumentParser:
    """--out (default: the file in images/) and, for measured figures, --toy (the small size the tests run)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default, help=f"where to write (default: {default.relative_to(IMAGES.parent)})")
    if toy:
        parser.add_argument("--toy", action="store_true", help="the small size the tests run, in seconds")
    return parser


def stacked_milliseconds(ax, bars: dict[str, dict[str, float]], segments: list[str], colors: list[str], xlabel: str) -> None:
    """One horizontal bar per name (the first on top), its segments stacked left to right, its total written
    at its end; for the profiled step breakdowns."""
    names = list(bars)[::-1]
    left = [0.0] * len(names)
    for segment, color in zip(segments, colors):
        widths = [bars[name][segment] for name in names]
        ax.barh(names, widths, left=left, color=color, label=segment)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} ms", va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.15)
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
