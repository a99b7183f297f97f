"""Draw the shifts that each DataLoader worker of each rank really draws, seeded two ways.

For the data-pipeline chapter (docs/data_pipeline.md): 2 ranks x 2 workers, each loading batches of 4
images through WorkerShift (common/worker_seeds.py) in a real DataLoader. Left, as the rungs seed them:
the loader's generator from (seed, rank, epoch), each worker's own generator from the seed the DataLoader
gives it (seed_worker). Right, the trap: one generator made in the dataset's __init__ from the run's seed,
copied into every worker of every rank. Each cell lists the (rows, columns) shift of the worker's first
images, read back from where a single bright pixel ended up.

    python figures/worker_seeds.py      # writes images/worker_seeds.svg
"""
from pathlib import Path

import torch
from matplotlib.patches import FancyBboxPatch
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style
from torch.utils.data import DataLoader

from common.worker_seeds import WorkerShift, seed_epoch, seed_worker

PIXEL, IMAGES_PER_WORKER, BATCH = 14, 4, 4


class Dots(torch.utils.data.Dataset):
    """Images that are black but for one pixel in the middle: a shift is where that pixel went."""

    def __len__(self):
        return 2 * BATCH

    def __getitem__(self, index):
        image = torch.zeros(1, 28, 28)
        image[0, PIXEL, PIXEL] = 1
        return image, index


def shifts(rank: int, seeded: bool) -> list[list[tuple[int, int]]]:
    """The shifts of worker 0's and worker 1's first batch on `rank`, epoch 0, seed 0."""
    dataset = WorkerShift(Dots(), 2)
    if not seeded:
        dataset.generator.manual_seed(0)  # the trap: made once, from the run's seed, in the main process
    loader = DataLoader(dataset, BATCH, num_workers=2, worker_init_fn=seed_worker if seeded else None,
                        generator=torch.Generator())
    if seeded:
        seed_epoch(loader, 0, rank, 0)
    found = []
    for images, _ in loader:  # batch 0 from worker 0, batch 1 from worker 1
        where = images.flatten(1).argmax(dim=1)
        found.append([(int(i) // 28 - PIXEL, int(i) % 28 - PIXEL) for i in where])
    return found


def draw(svg_path: Path) -> None:
    stable_svg_style()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    titles = ["seed_worker, loader seeded from (seed, rank, epoch)", "the trap: a generator made in __init__"]
    for ax, seeded, title in zip(axes, (True, False), titles):
        ax.set_xlim(0, 2)
        ax.set_ylim(0, 2.35)
        ax.axis("off")
        ax.set_title(title, fontsize=9)
        for rank in (0, 1):
            for worker, drawn in enumerate(shifts(rank, seeded)):
                x, y = worker + 0.04, 1 - rank + 0.06
                ax.add_patch(FancyBboxPatch((x, y), 0.92, 0.84, boxstyle="round,pad=0.01,rounding_size=0.05",
                                            facecolor=COLORS[rank], edgecolor="none", alpha=0.85))
                ax.text(x + 0.46, y + 0.7, f"rank {rank}, worker {worker}", ha="center", va="center", fontsize=9,
                        color="white")
                cells = "\n".join(f"({rows:+d}, {columns:+d})" for rows, columns in drawn[:IMAGES_PER_WORKER])
                ax.text(x + 0.46, y + 0.33, cells, ha="center", va="center", fontsize=9, color="white",
                        family="monospace", linespacing=1.1)
        ax.text(1, 2.22, "shifts (rows, columns) of each worker's first 4 images", ha="center", fontsize=9)
    fig.tight_layout()
    save(fig, svg_path)


if __name__ == "__main__":
    draw(parser(__doc__, IMAGES / "worker_seeds.svg").parse_args().out)
