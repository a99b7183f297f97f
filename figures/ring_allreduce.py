"""Figure: the ring all-reduce step by step, recorded from a real gloo run of common/lessons/allreduce.py's ring.

Four processes each hold a tensor cut into 4 chunks; rank r's chunk c starts as (c + 1) * 10^r, so
the digits of every partial sum say which ranks it already contains (2020: ranks 1 and 3). The ring
(common.lessons.allreduce.ring_all_reduce) runs with an observer that copies each rank's chunks after every
step; the drawing takes which chunk each rank sent and received from the same ring_schedule the
implementation follows. Writes a static SVG (every step, two side by side) and an animated GIF (one step a frame).

    python figures/ring_allreduce.py            # images/ring_allreduce.svg and images/ring_allreduce.gif
"""
import torch
import torch.distributed as dist
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

from common.lessons.allreduce import ring_all_reduce, ring_schedule
from common.spawn import run_in_process_group

WORLD_SIZE = 4
PHASE_COLOR = {"reduce-scatter": COLORS[1], "all-gather": COLORS[2]}


def starting_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.tensor([(chunk + 1) * 10.0**rank for chunk in range(world_size)])


def record(rank: int, world_size: int) -> dict:
    """Run the ring once and return, from every rank, its chunk values at the start and after each step,
    and the final tensor beside dist.all_reduce's result for the same inputs."""
    tensor = starting_tensor(rank, world_size)
    history = [[chunk.tolist() for chunk in tensor.tensor_split(world_size)]]
    ring_all_reduce(tensor, after_step=lambda phase, step, sent, received, chunks:
                    history.append([chunk.tolist() for chunk in chunks]))
    reference = starting_tensor(rank, world_size)
    dist.all_reduce(reference)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"history": history, "ring": tensor.tolist(), "all_reduce": reference.tolist()})
    return {"world_size": world_size, "ranks": everyone}


def states(recording: dict) -> list[dict]:
    """One state per picture: the title, each rank's chunk values, and what each rank sent and received."""
    world_size, ranks = recording["world_size"], recording["ranks"]
    schedules = [list(ring_schedule(rank, world_size)) for rank in range(world_size)]
    pictures = [{"short": "start", "title": "start: rank r holds (c+1)·10^r in chunk c", "phase": None,
                 "values": [ranks[rank]["history"][0] for rank in range(world_size)]}]
    for index, (phase, step, _, _) in enumerate(schedules[0]):
        verb = "adds" if phase == "reduce-scatter" else "copies"
        pictures.append({"short": f"{phase} {step + 1}/{world_size - 1}",
                         "title": f"{phase} {step + 1}/{world_size - 1}: each rank sends the outlined chunk right, the next {verb} it",
                         "phase": phase, "values": [ranks[rank]["history"][index + 1] for rank in range(world_size)],
                         "sent": [schedules[rank][index][2] for rank in range(world_size)],
                         "received": [schedules[rank][index][3] for rank in range(world_size)]})
    return pictures


def draw_state(ax, state: dict, total: list[list[float]], title: str) -> None:
    """Ranks as rows, chunks as columns; the received chunk filled in the phase's colour, the sent one
    outlined, with an arrow to the rank below (the one to its right in the ring), which receives the
    same chunk index; the last rank's arrow leaves at the bottom and comes back at the top."""
    values = state["values"]
    world_size = len(values)
    arrow = {"arrowstyle": "->", "color": COLORS[0], "lw": 1.2}
    for rank, chunks in enumerate(values):
        y = world_size - 1 - rank
        for chunk, value in enumerate(chunks):
            received = state["phase"] and state["received"][rank] == chunk
            sent = state["phase"] and state["sent"][rank] == chunk
            full = all(v == total[chunk][i] for i, v in enumerate(value))
            ax.add_patch(plt.Rectangle((chunk + 0.05, y + 0.22), 0.9, 0.6, linewidth=2.5 if sent else 0.8,
                                       edgecolor=COLORS[0] if sent else "#444444",
                                       facecolor=PHASE_COLOR[state["phase"]] if received else "white"))
            ax.text(chunk + 0.5, y + 0.52, " ".join(f"{v:g}" for v in value), ha="center", va="center",
                    fontweight="bold" if full else "normal", fontsize=8.5)
            if sent:
                bottom = y + 0.2 - (0.36 if rank == world_size - 1 else 0.2)
                ax.annotate("", xy=(chunk + 0.5, bottom), xytext=(chunk + 0.5, y + 0.2), arrowprops=arrow)
                if rank == world_size - 1:  # around the ring, back to rank 0
                    ax.text(chunk + 0.58, bottom, "to rank 0", va="bottom", ha="left", fontsize=7.5, color=COLORS[0])
                    ax.annotate("", xy=(chunk + 0.5, world_size - 0.16), xytext=(chunk + 0.5, world_size + 0.16),
                                arrowprops=arrow)
        ax.text(-0.1, y + 0.52, f"rank {rank}", ha="right", va="center")
    ax.text(-0.1, world_size + 0.2, "chunk", ha="right", va="center", fontsize=8)
    for chunk in range(world_size):
        ax.text(chunk + 0.5, world_size + 0.2, f"{chunk}", ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.0, world_size + 0.1)
    ax.set_ylim(-0.2, world_size + 0.4)
    ax.set_axis_off()
    ax.set_title(title, fontsize=9.5)


def final_sums(recording: dict) -> list[list[float]]:
    world_size = recording["world_size"]
    return [chunk.tolist() for chunk in torch.tensor(recording["ranks"][0]["all_reduce"]).tensor_split(world_size)]


def draw(recording: dict, svg_path, gif_path=None) -> None:
    from matplotlib.animation import FuncAnimation, PillowWriter
    stable_svg_style()
    pictures, total = states(recording), final_sums(recording)
    rows = (len(pictures) + 1) // 2  # two states side by side: legible in a 720-px column
    fig, axes = plt.subplots(rows, 2, figsize=(7.2, 2.45 * rows + 0.9), squeeze=False)
    for ax, state in zip(axes.flat, pictures):
        draw_state(ax, state, total, state["short"])
    for ax in list(axes.flat)[len(pictures):]:
        ax.set_axis_off()
    fig.suptitle(f"Ring all-reduce of {recording['world_size']} gloo processes (common/lessons/allreduce.py), recorded.\n"
                 "Reduce-scatter, then all-gather. Outlined: the chunk each rank sends to the next (arrow);\n"
                 "filled: the chunk it received (orange: added, green: copied); bold: the full sum", fontsize=9.5)
    fig.tight_layout()
    save(fig, svg_path)
    if gif_path is not None:
        fig, ax = plt.subplots(figsize=(6, 4.2))

        def frame(index):
            ax.clear()
            draw_state(ax, pictures[index], total, pictures[index]["title"])

        animation = FuncAnimation(fig, frame, frames=range(len(pictures)))
        animation.save(gif_path, writer=PillowWriter(fps=0.8), dpi=80)
        plt.close(fig)
        print(f"saved {gif_path}")


def main():
    args = parser(__doc__, IMAGES / "ring_allreduce.svg").parse_args()
    recording = run_in_process_group(record, WORLD_SIZE, timeout=120)
    draw(recording, args.out, args.out.with_suffix(".gif"))


if __name__ == "__main__":
    main()
