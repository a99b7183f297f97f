"""Figure: who sends what in the three all-reduces of common/lessons/allreduce.py, recorded from a real run.

Four gloo processes all-reduce a 4 MB tensor with each algorithm inside common.lessons.allreduce's
recording_sends(), which lists every message a rank posts (destination and bytes). One row per
algorithm, stacked to fit a 720-px page column: each arrow is one sender -> receiver pair; beside the
diagram, the pairs' messages (once, where every arrow carries the same), the bytes each rank sent and
the cost model's bytes for the busiest rank (common.lessons.allreduce.bytes_sent_per_rank). MiB = 2**20 bytes.

    python figures/allreduce_algorithms.py      # images/allreduce_algorithms.svg
"""
import math
import textwrap

import torch
import torch.distributed as dist
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

from common.lessons.allreduce import ALGORITHMS, bytes_sent_per_rank, recording_sends
from common.spawn import run_in_process_group

WORLD_SIZE, SIZE_BYTES = 4, 4 * 2**20
TITLES = {"reduce_broadcast": "reduce + broadcast", "all_to_all": "all-to-all", "ring": "ring"}
HOW = {"reduce_broadcast": "every rank sends its tensor to rank 0,\nwhich adds them up and sends the sum back",
       "all_to_all": "every rank sends its whole tensor\nto every other rank and adds up what it gets",
       "ring": "N\u22121 steps of reduce-scatter, then N\u22121 of all-gather,\none chunk of S/N to the right neighbour each step"}


def record(rank: int, world_size: int, size_bytes: int = SIZE_BYTES) -> dict:
    """Every rank's messages for each algorithm: a list of exchange rounds, each a list of (destination, bytes)."""
    messages = {}
    for name, algorithm in ALGORITHMS.items():
        tensor = torch.full((size_bytes // 4,), float(rank + 1))
        with recording_sends() as rounds:
            algorithm(tensor)
        assert torch.all(tensor == world_size * (world_size + 1) / 2), f"{name} did not sum"
        everyone = [None] * world_size
        dist.all_gather_object(everyone, rounds)
        messages[name] = everyone
    return {"world_size": world_size, "size_bytes": size_bytes, "messages": messages}


def bytes_sent(recording: dict, algorithm: str) -> list[int]:
    """Bytes each rank sent, summed over its messages."""
    return [sum(size for round_ in rounds for _, size in round_) for rounds in recording["messages"][algorithm]]


def pairs(recording: dict, algorithm: str) -> dict[tuple[int, int], list[int]]:
    """(sender, receiver) -> the sizes of the messages between them, in order."""
    found: dict[tuple[int, int], list[int]] = {}
    for sender, rounds in enumerate(recording["messages"][algorithm]):
        for round_ in rounds:
            for receiver, size in round_:
                found.setdefault((sender, receiver), []).append(size)
    return found


def mib(size: float) -> str:
    return f"{size / 2**20:g} MiB"


def message_label(sizes: list[int]) -> str:
    """A sender -> receiver pair's messages: "1 message of 4 MiB", "6 messages of 1 MiB", "1 MiB + 0.5 MiB"."""
    if len(set(sizes)) > 1:
        return " + ".join(map(mib, sizes))
    return f"{len(sizes)} message{'s' if len(sizes) > 1 else ''} of {mib(sizes[0])}"


def sent_by_ranks(sent: list[int]) -> str:
    """"12 MiB by rank 0, 4 MiB each by ranks 1-3": runs of ranks that sent the same bytes, merged."""
    runs: list[list[int]] = []
    for rank, size in enumerate(sent):
        if runs and sent[runs[-1][-1]] == size:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    if len(runs) == 1:
        return f"{mib(sent[0])} by every rank"
    return ", ".join(f"{mib(sent[run[0]])} by rank {run[0]}" if len(run) == 1 else
                     f"{mib(sent[run[0]])} each by ranks {run[0]}\u2013{run[-1]}" for run in runs)


# drawn for a 720-px page column: 7.5 in wide (540 pt = 720 CSS px), no text under 9.5 pt (12.7 px)
WIDTH, ROW, HEAD, FOOT, DIAGRAM = 7.5, 2.3, 0.62, 0.08, 2.7  # inches: figure, a row, title, bottom margin, a row's diagram


def draw(recording: dict, path) -> None:
    """One row per algorithm: the ranks and their messages on the left, what they add up to on the right."""
    stable_svg_style()
    world_size, size = recording["world_size"], recording["size_bytes"]
    height = HEAD + ROW * len(ALGORITHMS) + FOOT
    fig = plt.figure(figsize=(WIDTH, height))
    where = {rank: (math.sin(2 * math.pi * rank / world_size), math.cos(2 * math.pi * rank / world_size))
             for rank in range(world_size)}
    for row, name in enumerate(ALGORITHMS):
        bottom = (height - HEAD - ROW * (row + 1)) / height
        if row:
            fig.add_artist(plt.Line2D((0.03, 0.97), (bottom + ROW / height,) * 2, color="#cccccc", lw=0.8))
        ax = fig.add_axes((0.0, bottom, DIAGRAM / WIDTH, ROW / height))
        found = pairs(recording, name)
        labels = {message_label(sizes) for sizes in found.values()}
        for (sender, receiver), sizes in sorted(found.items()):
            (x0, y0), (x1, y1) = where[sender], where[receiver]
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops={"arrowstyle": "-|>,head_length=0.5,head_width=0.25", "color": COLORS[sender], "lw": 1.4,
                                    "connectionstyle": "arc3,rad=0.2", "shrinkA": 13, "shrinkB": 13})
        for rank, (x, y) in where.items():
            ax.add_patch(plt.Circle((x, y), 0.2, facecolor=COLORS[rank], edgecolor="black", alpha=0.9))
            ax.text(x, y, f"{rank}", ha="center", va="center", color="white", fontweight="bold", fontsize=10.5)
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.32, 1.32)
        ax.set_aspect("equal")
        ax.set_axis_off()
        sent = bytes_sent(recording, name)
        if len(labels) == 1:
            arrows = "every arrow: " + labels.pop()
        else:  # arrows that differ are listed one by one, here rather than on the crowded diagram
            arrows = textwrap.fill("arrows: " + ", ".join(f"{sender}\u2192{receiver} {message_label(sizes)}" for (sender, receiver), sizes
                                                          in sorted(found.items())), 58)
        lines = [HOW[name], "", arrows,
                 f"sent: {sent_by_ranks(sent)}",
                 f"busiest rank sent {mib(max(sent))}; the cost model says {mib(bytes_sent_per_rank(name, size, world_size))}"]
        middle = bottom + ROW / 2 / height
        fig.text(DIAGRAM / WIDTH + 0.01, middle + 0.78 / height, TITLES[name], fontsize=11, fontweight="bold", va="baseline")
        fig.text(DIAGRAM / WIDTH + 0.01, middle + 0.62 / height, "\n".join(lines), fontsize=9.5, va="top", linespacing=1.45)
    fig.text(0.5, 1 - 0.1 / height, f"Who sends what in one all-reduce of S = {mib(size)} on {world_size} gloo processes\n"
             "(common/lessons/allreduce.py), every message recorded; arrows coloured by sender", ha="center", va="top",
             fontsize=10.5, linespacing=1.4)
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "allreduce_algorithms.svg").parse_args()
    draw(run_in_process_group(record, WORLD_SIZE, timeout=120), args.out)


if __name__ == "__main__":
    main()
