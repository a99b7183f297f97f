"""Draw what happens between a stop signal and a resumed run, in order, with the code that does each.

A schematic of the resume chapter (docs/resume.md): the signal only sets a flag; the ranks agree at a
step boundary; rank 0 writes a temporary file, fsyncs it and renames it, so that a file named
step-N.pt is always complete; the job exits and comes back (SLURM requeue or a torchrun restart); the
newest checkpoint that loads is restored and the epoch continues at the next unseen batch.

    python figures/resume_sequence.py      # writes images/resume_sequence.svg
"""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

STEPS = [  # what happens, where in the code; one color per actor
    ("SIGTERM / SIGUSR1\nsets a flag", "StopSignal", 3),
    ("all ranks agree at\nthe step boundary", "8-byte all-reduce\nevery step", 0),
    ("rank 0 writes\nstep-N.pt.tmp", "Checkpoints.save", 0),
    ("flush + fsync\nthe file", "os.fsync", 0),
    ("rename to step-N.pt,\nfsync the folder", "atomic os.replace", 0),
    ("exit 128 + signal;\nrequeue or restart", "scontrol requeue,\ntorchrun --max-restarts", 3),
    ("resume: newest file\nthat loads", "Checkpoints.load_newest", 2),
    ("continue at the next\nunseen batch", "ResumableDistributed-\nSampler", 2),
]
PER_ROW = 4


def draw(svg_path: Path) -> None:
    stable_svg_style()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width, height, gap = 2.1, 0.95, 0.55
    ax.set_xlim(-0.1, PER_ROW * (width + gap) - gap + 0.1)
    ax.set_ylim(-0.55, 3.75)
    ax.axis("off")
    centers = []
    for index, (what, where, color) in enumerate(STEPS):
        row, column = divmod(index, PER_ROW)
        x, y = column * (width + gap), 2.0 - row * 1.75
        ax.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor=COLORS[color], edgecolor="none", alpha=0.9))
        ax.text(x + width / 2, y + height / 2, what, ha="center", va="center", fontsize=9, color="white")
        ax.text(x + width / 2, y - 0.08, where, ha="center", va="top", fontsize=9, family="monospace")
        ax.text(x + 0.06, y + height - 0.06, str(index + 1), ha="left", va="top", fontsize=9, color="white")
        centers.append((x, y))
    for (x0, y0), (x1, y1) in zip(centers, centers[1:]):
        if y0 == y1:
            start, end = (x0 + width, y0 + height / 2), (x1, y1 + height / 2)
        else:  # the end of a row to the start of the next
            start, end = (x0 + width / 2, y0 - 0.45), (x1 + width / 2, y1 + height)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color="black", linewidth=0.9,
                                     connectionstyle="arc3,rad=0" if y0 == y1 else "angle3,angleA=0,angleB=90"))
    ax.text(0, 3.7, "From a stop signal to a resumed run. Red: the signal and the job, blue: every rank and "
            "rank 0 saving, green: the next run.\nA kill anywhere before step 5 leaves step-N.pt.tmp, which "
            "loading skips: the checkpoint before it is resumed.", fontsize=9, va="top")
    fig.tight_layout()
    save(fig, svg_path)


if __name__ == "__main__":
    draw(parser(__doc__, IMAGES / "resume_sequence.svg").parse_args().out)
