"""Figure: which micro-batches all-reduce, for the four ways to accumulate gradients in common/lessons/accumulation.py.

Two gloo processes run one optimizer step of 4 micro-batches with each variant on BasicNet, wrapped
in DDP (or prepared by Accelerate), after one warm-up backward that lets DDP rebuild its buckets.
common.lessons.accumulation.count_all_reduces's communication hook records, for every bucket all-reduce,
how many forward passes had run: the micro-batch it belongs to. tests/test_accumulation.py takes
the same counts and checks the totals.

    python figures/accumulation_syncs.py        # images/accumulation_syncs.svg
"""
import torch
import torch.nn.functional as F
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons import accumulation
from common.mnist import BasicNet
from common.spawn import run_in_process_group

MICRO_BATCHES, SAMPLES = 4, 3  # micro-batches per optimizer step, samples in each (per process)
VARIANTS = {"sync every micro-batch (baseline)": "sync_every_micro_batch",
            "no_sync() around backward only (the mistake)": "no_sync_around_backward_only",
            "no_sync() around forward and backward": "no_sync_around_forward_and_backward",
            "accelerator.accumulate(model)": "accelerate_accumulate"}


def record(rank: int, world_size: int) -> dict:
    """For each variant, the micro-batch (1..k) of every bucket all-reduce in one optimizer step."""
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(SAMPLES, 1, 28, 28, generator=generator), torch.randint(0, 10, (SAMPLES,), generator=generator))
               for _ in range(MICRO_BATCHES)]
    syncs = {}
    for title, variant in VARIANTS.items():
        torch.manual_seed(0)
        model = BasicNet().eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if variant == "accelerate_accumulate":
            from accelerate import Accelerator
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO_BATCHES)
            model, optimizer = accelerator.prepare(model, optimizer)
            run = lambda: accumulation.accelerate_accumulate(accelerator, model, optimizer, batches)  # noqa: E731
        else:
            model = DDP(model)
            run = lambda: getattr(accumulation, variant)(model, optimizer, batches)  # noqa: E731
        counter = accumulation.count_all_reduces(model)
        F.nll_loss(model(batches[0][0]), batches[0][1]).backward()  # warm-up: DDP rebuilds its buckets
        model.zero_grad(set_to_none=True)
        counter.update(all_reduces=0, forwards=0, after_forward=[])
        run()
        syncs[title] = counter["after_forward"]
    return {"micro_batches": MICRO_BATCHES, "world_size": world_size, "syncs": syncs}


def draw(recording: dict, path) -> None:
    stable_svg_style()
    k, syncs = recording["micro_batches"], recording["syncs"]
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(syncs)))
    for row, (title, micro_batches) in enumerate(syncs.items()):
        y = len(syncs) - 1 - row
        ax.text(-0.1, y + 0.5, title, ha="right", va="center", fontsize=10)
        for micro in range(1, k + 1):
            count = micro_batches.count(micro)
            ax.add_patch(plt.Rectangle((micro - 1 + 0.05, y + 0.15), 0.9, 0.7, facecolor=COLORS[1] if count else "#eeeeee",
                                       edgecolor="#444444", lw=0.8))
            label = f"fwd + bwd\n{count} all-reduce{'s' if count != 1 else ''}" if count else "fwd + bwd\nlocal only"
            ax.text(micro - 0.5, y + 0.5, label, ha="center", va="center", fontsize=10)
        ax.add_patch(plt.Rectangle((k + 0.1, y + 0.15), 0.7, 0.7, facecolor=COLORS[2], alpha=0.6, edgecolor="#444444", lw=0.8))
        ax.text(k + 0.45, y + 0.5, "optimizer\nstep", ha="center", va="center", fontsize=10)
        ax.text(k + 0.95, y + 0.5, f"{len(micro_batches)} all-reduces", ha="left", va="center", fontsize=10, fontweight="bold")
    for micro in range(1, k + 1):
        ax.text(micro - 0.5, len(syncs) + 0.1, f"micro-batch {micro}", ha="center", va="bottom", fontsize=10)
    ax.set_xlim(-3.3, k + 2.0)
    ax.set_ylim(-0.1, len(syncs) + 0.5)
    ax.set_axis_off()
    ax.set_title(f"Gradient accumulation over {k} micro-batches under DDP, {recording['world_size']} gloo processes, "
                 "BasicNet: bucket all-reduces counted by a DDP communication hook\n(2 buckets per synchronized backward; "
                 "no_sync() must cover the forward pass, since DDP decides in forward whether backward syncs)", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "accumulation_syncs.svg").parse_args()
    draw(run_in_process_group(record, 2, timeout=120), args.out)


if __name__ == "__main__":
    main()
