"""Figure: what moves between devices in one DataParallel step and in one DDP step; the bytes as a table.

A schematic for 4 GPUs, with the real tensor shapes and sizes of BasicNet (global batch 64) and of
BERT with bert-base-cased's configuration (BertConfig(vocab_size=28996), built on the meta device: no
download, no memory; global batch 32 of 128 tokens). The sizes come from the models themselves;
the all-reduce bytes from common.lessons.allreduce.bytes_sent_per_rank. The splitting over several GPUs
cannot be measured on the CPU this repository is tested on, and the figure says so.

    python figures/dp_vs_ddp.py                 # images/dp_vs_ddp.svg, and prints the byte counts as Markdown
"""
import torch
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

from common.lessons.allreduce import bytes_sent_per_rank
from common.mnist import BasicNet

GPUS = 4


def bert_base_cased():
    from transformers import BertConfig, BertForSequenceClassification
    with torch.device("meta"):  # shapes only: nothing allocated, nothing downloaded
        return BertForSequenceClassification(BertConfig(vocab_size=28996, num_labels=3))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def workloads() -> dict:
    """Per model: parameter count and bytes, buffer bytes, the inputs (names, shape of each for the global
    batch, dtype) and the output's shape and bytes per element."""
    mnist, bert = BasicNet(), bert_base_cased()
    batch, tokens = 64, (32, 128)
    return {
        "BasicNet (MNIST), global batch 64": {
            "params": sum(p.numel() for p in mnist.parameters()), "param_bytes": nbytes(mnist.parameters()),
            "buffer_bytes": nbytes(mnist.buffers()),
            "inputs": ("images", (batch, 1, 28, 28), torch.float32), "outputs": ((batch, 10), 4)},
        "BERT, bert-base-cased config, global batch 32 × 128 tokens": {
            "params": sum(p.numel() for p in bert.parameters()), "param_bytes": nbytes(bert.parameters()),
            "buffer_bytes": nbytes(bert.buffers()),
            "inputs": ("input_ids, attention_mask, token_type_ids", tokens, torch.int64),
            "outputs": ((tokens[0], 3), 4)},
    }


def size_of(shape, itemsize) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * itemsize


def per_gpu(shape) -> tuple:
    return (shape[0] // GPUS, *shape[1:])


def human(size: float) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):  # SI units, as on every page
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:g} B"


def moves(work: dict) -> dict[str, list[tuple[str, int]]]:
    """The steps of each wrapper, each with the bytes that pass through the busiest device (GPU 0 for
    DataParallel, every GPU alike for DDP), sent plus received; 0 where nothing moves between devices."""
    others = GPUS - 1
    names, shape, dtype = work["inputs"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    input_bytes = len(names.split(", ")) * size_of(shape, itemsize)
    output_bytes = size_of(*work["outputs"])
    share = f"{names} {per_gpu(shape)} {str(dtype).removeprefix('torch.')}"
    weights = work["param_bytes"] + work["buffer_bytes"]
    return {
        "DataParallel: one process, GPU 0 drives all": [
            (f"scatter the batch from GPU 0: {share} to each", others * input_bytes // GPUS),
            (f"replicate the model from GPU 0: {human(weights)} of weights and buffers to each", others * weights),
            ("forward: one thread per GPU", 0),
            (f"gather the outputs {per_gpu(work['outputs'][0])} on GPU 0, loss on GPU 0", others * output_bytes // GPUS),
            ("backward: gradients of the outputs scattered back", others * output_bytes // GPUS),
            (f"reduce gradients on GPU 0: {human(work['param_bytes'])} from each other GPU", others * work["param_bytes"]),
            ("optimizer step on GPU 0 only", 0)],
        "DDP: one process per GPU": [
            ("once, at DDP(model): broadcast rank 0's weights (not per step)", 0),
            (f"each process loads its own share: {share}", 0),
            ("forward on every GPU", 0),
            (f"backward + ring all-reduce in buckets: each GPU sends 2(N-1)/N × {human(work['param_bytes'])} and receives as much",
             round(2 * bytes_sent_per_rank("ring", work["param_bytes"], GPUS))),
            ("optimizer step on every GPU (same gradients, same weights)", 0)],
    }


def draw(path) -> None:
    """Arrows only: who sends to whom in one step. The byte counts are in markdown_tables(), for the page."""
    stable_svg_style()
    fig, (dp, ddp) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax in (dp, ddp):
        ax.set_axis_off()
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")

    def gpu(ax, x, y, index, note=""):
        ax.add_patch(plt.Rectangle((x - 0.09, y - 0.06), 0.18, 0.12, facecolor=COLORS[index], alpha=0.9))
        ax.text(x, y, f"GPU {index}", ha="center", va="center", color="white", fontweight="bold", fontsize=9)
        if note:
            ax.text(x, y - 0.1, note, ha="center", va="top", fontsize=9)

    gpu(dp, 0.2, 0.5, 0, "the process,\nthe loss, the optimizer")
    for index, y in zip(range(1, GPUS), (0.85, 0.5, 0.15)):
        gpu(dp, 0.8, y, index)
        dp.annotate("", xy=(0.7, y + 0.02), xytext=(0.3, 0.52), arrowprops={"arrowstyle": "->", "color": "#444444"})
        dp.annotate("", xy=(0.3, 0.48), xytext=(0.7, y - 0.02), arrowprops={"arrowstyle": "->", "color": COLORS[3]})
    dp.text(0.5, 0.98, "→ batch share, a fresh copy of the weights", ha="center", fontsize=9, color="#444444")
    dp.text(0.5, 0.01, "← outputs, then gradients, to GPU 0", ha="center", fontsize=9, color=COLORS[3])
    dp.set_title("DataParallel: one process; every step passes through GPU 0", fontsize=9.5)

    corners = [(0.25, 0.78), (0.75, 0.78), (0.75, 0.22), (0.25, 0.22)]
    for index, (x, y) in enumerate(corners):
        gpu(ddp, x, y, index)
        (x0, y0), (x1, y1) = (x, y), corners[(index + 1) % GPUS]
        start = (x0 + (0.1 if x1 > x0 else -0.1 if x1 < x0 else 0), y0 + (0.07 if y1 > y0 else -0.07 if y1 < y0 else 0))
        end = (x1 - (0.1 if x1 > x0 else -0.1 if x1 < x0 else 0), y1 - (0.07 if y1 > y0 else -0.07 if y1 < y0 else 0))
        ddp.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": COLORS[2], "linewidth": 1.5})
    ddp.text(0.5, 0.5, "gradient chunks\naround the ring,\nduring backward", ha="center", va="center", fontsize=9,
             color=COLORS[2])
    ddp.text(0.5, 0.01, "each GPU: its own process, data, optimizer", ha="center", fontsize=9)
    ddp.set_title("DDP: one process per GPU; only gradients move", fontsize=9.5)
    fig.tight_layout()
    save(fig, path)


def markdown_tables() -> str:
    """The bytes of every step that moves data, per model, as the Markdown docs/mnist.md shows."""
    tables = []
    for title, work in workloads().items():
        rows = [f"| {title}: {work['params']:,} parameters, {human(work['param_bytes'])} fp32 | bytes |", "|---|---:|"]
        for wrapper, steps in moves(work).items():
            name, busiest = wrapper.split(":")[0], "GPU 0" if wrapper.startswith("DataParallel") else "each GPU"
            rows += [f"| {name}: {step} | {human(size)} |" for step, size in steps if size]
            rows.append(f"| **{name}: through {busiest} per step** | **{human(sum(size for _, size in steps))}** |")
        tables.append("\n".join(rows))
    return "\n\n".join(tables)


def main():
    args = parser(__doc__, IMAGES / "dp_vs_ddp.svg").parse_args()
    draw(args.out)
    print(markdown_tables())


if __name__ == "__main__":
    main()
