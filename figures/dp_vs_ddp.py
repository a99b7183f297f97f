"""Figure: what moves between devices in one DataParallel step and in one DDP step, in bytes.

A schematic for 4 GPUs, with the real tensor shapes and sizes of BasicNet (global batch 64) and of
BERT with bert-base-cased's configuration (BertConfig(vocab_size=28996), built on the meta device: no
download, no memory; global batch 32 of 128 tokens). The sizes come from the models themselves;
the all-reduce bytes from common.allreduce.bytes_sent_per_rank. The splitting over several GPUs
cannot be measured on the CPU this repository is tested on, and the figure says so.

    python figures/dp_vs_ddp.py                 # images/dp_vs_ddp.svg
"""
import torch

from common.allreduce import bytes_sent_per_rank
from common.mnist import BasicNet
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style

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
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
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
            (f"backward + ring all-reduce in buckets: each GPU sends and receives 2(N-1)/N × {human(work['param_bytes'])}",
             round(2 * bytes_sent_per_rank("ring", work["param_bytes"], GPUS))),
            ("optimizer step on every GPU (same gradients, same weights)", 0)],
    }


def draw(path) -> None:
    stable_svg_style()
    works = workloads()
    fig, axes = plt.subplots(len(works), 2, figsize=(15, 7.4))
    for row, (title, work) in zip(axes, works.items()):
        for ax, (wrapper, steps) in zip(row, moves(work).items()):
            ax.set_axis_off()
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_title(f"{wrapper}\n{title}: {work['params']:,} parameters, {human(work['param_bytes'])} fp32",
                         fontsize=9)
            for gpu in range(GPUS):
                x = 0.06 + gpu * 0.24
                ax.add_patch(plt.Rectangle((x, 0.7), 0.16, 0.12, facecolor=COLORS[gpu], alpha=0.85))
                ax.text(x + 0.08, 0.76, f"GPU {gpu}", ha="center", va="center", color="white", fontweight="bold")
                if wrapper.startswith("DataParallel") and gpu:  # everything to and from GPU 0
                    ax.annotate("", xy=(x + 0.06, 0.82), xytext=(0.16, 0.82),
                                arrowprops={"arrowstyle": "<->", "color": "#444444", "connectionstyle": "arc3,rad=-0.12"})
                if wrapper.startswith("DDP") and gpu < GPUS - 1:  # a ring: each GPU to the next
                    ax.annotate("", xy=(x + 0.24, 0.76), xytext=(x + 0.16, 0.76), arrowprops={"arrowstyle": "->"})
            if wrapper.startswith("DDP"):
                ax.annotate("", xy=(0.14, 0.82), xytext=(0.86, 0.82),
                            arrowprops={"arrowstyle": "->", "connectionstyle": "arc3,rad=0.08"})
            for index, (step, size) in enumerate(steps):
                ax.text(0.0, 0.58 - index * 0.085, f"{index + 1}. {step}", fontsize=8, va="center")
                ax.text(1.0, 0.58 - index * 0.085, human(size) if size else "–", fontsize=8, va="center", ha="right",
                        fontweight="bold" if size else "normal")
            total = sum(size for _, size in steps)
            busiest = "GPU 0" if wrapper.startswith("DataParallel") else "each GPU"
            ax.text(1.0, 0.65, f"sent + received by {busiest}", fontsize=8, va="center", ha="right", style="italic")
            ax.text(1.0, 0.58 - len(steps) * 0.085, f"through {busiest} per step: {human(total)}", fontsize=8.5,
                    va="center", ha="right", fontweight="bold")
    fig.suptitle(f"What moves in one training step on {GPUS} GPUs: DataParallel copies the model out and the "
                 "gradients in through GPU 0 every step; DDP all-reduces the gradients, spread evenly over the GPUs.\n"
                 "A schematic computed from the real shapes and byte counts: this repository's CPU machines have no "
                 "GPUs, so the splitting over GPUs is not measured here.", fontsize=9.5)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, path)


def main():
    draw(parser(__doc__, IMAGES / "dp_vs_ddp.svg").parse_args().out)


if __name__ == "__main__":
    main()
