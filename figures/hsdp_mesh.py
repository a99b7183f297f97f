"""Draw HSDP's 2-D device mesh: 2 nodes of 4 GPUs, which rank holds which piece, which collective runs along which axis.

A schematic of the HSDP chapter (docs/hsdp.md), for src/ch4/scale_out/mnist_hsdp.py: the mesh's
rows are the nodes (shard groups: all-gather and reduce-scatter over the fast links inside a node), its
columns the replicate groups (GPU g of every node holds the same piece and all-reduces its gradients
with the others, the only traffic between nodes). The layout is init_device_mesh's, rank r at
(r // S, r % S); tests/test_hsdp.py checks it against a real mesh and the bytes of the SVG.

    python figures/hsdp_mesh.py      # writes images/hsdp_mesh.svg
"""
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

REPLICAS, SHARDS = 2, 4  # R nodes of S GPUs


def layout(replicas: int, shards: int) -> list[list[int]]:
    """The global rank at each (replica, shard) position: torchrun numbers ranks node by node, and
    init_device_mesh fills the mesh row by row."""
    return [[replica * shards + shard for shard in range(shards)] for replica in range(replicas)]


def draw(svg_path: Path) -> None:
    stable_svg_style()
    fig, ax = plt.subplots(figsize=(10, 5.4))
    width, height, gap, row_gap = 1.7, 1.15, 0.35, 1.55
    left = 1.6
    ax.set_xlim(0, left + SHARDS * (width + gap) + 2.6)
    ax.set_ylim(-1.2, REPLICAS * (height + row_gap) - row_gap + 0.75)
    ax.axis("off")
    for replica, ranks in enumerate(layout(REPLICAS, SHARDS)):
        y = (REPLICAS - 1 - replica) * (height + row_gap) + 0.25
        ax.add_patch(FancyBboxPatch((left - 0.2, y - 0.2), SHARDS * (width + gap) - gap + 0.4, height + 0.4,
                                    boxstyle="round,pad=0.02,rounding_size=0.1", facecolor="#f2f2f2", edgecolor="#999999"))
        ax.text(left - 0.35, y + height / 2, f"node {replica}\n(replica {replica})", ha="right", va="center", fontsize=9)
        for shard, rank in enumerate(ranks):
            x = left + shard * (width + gap)
            ax.add_patch(Rectangle((x, y), width, height, facecolor="white", edgecolor="black", linewidth=0.8))
            ax.text(x + width / 2, y + height - 0.2, f"rank {rank}  (GPU {shard})", ha="center", va="center", fontsize=9)
            for piece in range(SHARDS):  # every layer's parameters, gradients, AdamW state: S pieces, this one held
                held = piece == shard
                ax.add_patch(Rectangle((x + 0.15 + piece * (width - 0.3) / SHARDS, y + 0.2), (width - 0.3) / SHARDS, 0.38,
                                       facecolor=COLORS[piece] if held else "white", edgecolor=COLORS[piece], linewidth=0.7))
            ax.text(x + width / 2, y + 0.08, f"holds piece {shard}", ha="center", va="center", fontsize=9)
            if shard:  # a link to the rank before it in the node
                ax.add_patch(FancyArrowPatch((x - gap + 0.03, y + height / 2), (x - 0.03, y + height / 2), arrowstyle="<|-|>",
                                             mutation_scale=8, color=COLORS[0], linewidth=1.4))
        ax.text(left + SHARDS * (width + gap) + 0.15, y + height / 2, f"shard group ({SHARDS} ranks):\nall-gather parameters,\n"
                "reduce-scatter gradients,\ninside the node (NVLink)", fontsize=9, va="center", color=COLORS[0])
    for shard in range(SHARDS):  # each column: the same piece on every node
        x = left + shard * (width + gap) + width / 2
        ax.add_patch(FancyArrowPatch((x, 0.25 + height + 0.05), (x, height + row_gap + 0.2), arrowstyle="<|-|>",
                                     mutation_scale=9, color=COLORS[3], linewidth=1.4))
    ax.text(left + SHARDS * (width + gap) + 0.15, height + row_gap / 2 + 0.25,
            f"replicate group ({REPLICAS} ranks):\nall-reduce the gradient\npiece across nodes (network)",
            fontsize=9, va="center", color=COLORS[3])
    ax.text(0.05, -0.55, f"mesh (replicate, shard) = {REPLICAS} x {SHARDS}; rank r at (r // {SHARDS}, r % {SHARDS}). Per step, "
            "for each of L wrapped layers: 2 all-gathers and 1 reduce-scatter\nin every shard group, 1 all-reduce of 1/S of the "
            "layer's gradients in every replicate group. Each rank holds 1/S of the parameters,\ngradients and AdamW state.",
            fontsize=9, va="top")
    fig.tight_layout()
    save(fig, svg_path)


if __name__ == "__main__":
    draw(parser(__doc__, IMAGES / "hsdp_mesh.svg").parse_args().out)
