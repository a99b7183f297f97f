"""Figure: who sends what in the three all-reduces of common/allreduce.py, recorded from a real run.

Four gloo processes all-reduce a 4 MB tensor with each algorithm inside common.allreduce's
recording_sends(), which lists every message a rank posts (destination and bytes). Each arrow is one
sender -> receiver pair, labelled with its messages; under each rank, the bytes it sent, beside the
cost model's bytes for the busiest rank (common.allreduce.bytes_sent_per_rank).

    python figures/allreduce_algorithms.py      # images/allreduce_algorithms.svg
"""
import math

import torch
import torch.distributed as dist

from common.allreduce import ALGORITHMS, bytes_sent_per_rank, recording_sends
from common.spawn import run_in_process_group
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

WORLD_SIZE, SIZE_BYTES = 4, 4 * 2**20
TITLES = {"reduce_broadcast": "reduce + broadcast", "all_to_all": "all-to-all", "ring": "ring"}


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


def mb(size: float) -> str:
    return f"{size / 2**20:g} MB"


def draw(recording: dict, path) -> None:
    stable_svg_style()
    world_size, size = recording["world_size"], recording["size_bytes"]
    fig, axes = plt.subplots(1, len(ALGORITHMS), figsize=(5.2 * len(ALGORITHMS), 5.2))
    where = {rank: (math.sin(2 * math.pi * rank / world_size), math.cos(2 * math.pi * rank / world_size))
             for rank in range(world_size)}
    for ax, name in zip(axes, ALGORITHMS):
        sent = bytes_sent(recording, name)
        for (sender, receiver), sizes in sorted(pairs(recording, name).items()):
            (x0, y0), (x1, y1) = where[sender], where[receiver]
            ax.annotate("", xy=(x1 * 0.82 + x0 * 0.18, y1 * 0.82 + y0 * 0.18), xytext=(x0 * 0.82 + x1 * 0.18, y0 * 0.82 + y1 * 0.18),
                        arrowprops={"arrowstyle": "-|>", "color": COLORS[sender], "lw": 1.4,
                                    "connectionstyle": "arc3,rad=0.18", "shrinkA": 12, "shrinkB": 12})
            label = mb(sizes[0]) if len(sizes) == 1 else f"{len(sizes)} × {mb(sizes[0])}"
            # the label sits beside the arrow's bend, on the side that arc3 bends it to
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            nx, ny = (y1 - y0), -(x1 - x0)
            ax.text(mx * 0.9 + 0.16 * nx, my * 0.9 + 0.16 * ny, label, ha="center", va="center", fontsize=7,
                    color=COLORS[sender], bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
        for rank, (x, y) in where.items():
            ax.add_patch(plt.Circle((x, y), 0.17, facecolor=COLORS[rank], edgecolor="black", alpha=0.9))
            ax.text(x, y, f"{rank}", ha="center", va="center", color="white", fontweight="bold")
            ax.text(x * 1.42, y * 1.32, f"rank {rank}\nsent {mb(sent[rank])}", ha="center", va="center", fontsize=8)
        model = bytes_sent_per_rank(name, size, world_size)
        ax.set_title(f"{TITLES[name]}\nbusiest rank sent {mb(max(sent))}; cost model {mb(model)}", fontsize=9)
        ax.set_xlim(-1.75, 1.75)
        ax.set_ylim(-1.65, 1.65)
        ax.set_aspect("equal")
        ax.set_axis_off()
    fig.suptitle(f"Who sends what: one all-reduce of S = {mb(size)} on {world_size} gloo processes "
                 "(common/allreduce.py), every message recorded; arrows coloured by sender", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "allreduce_algorithms.svg").parse_args()
    draw(run_in_process_group(record, WORLD_SIZE, timeout=120), args.out)


if __name__ == "__main__":
    main()
