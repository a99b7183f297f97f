"""Figure: which parameters share a gradient bucket, in ours (common/lessons/bucketing.py) and in torch's DDP.

Drawn for BasicNet (4.58 MiB of parameters) at the default bucket_cap_mb=25; recorded also for the
tests' tiny BERT (tests/nli_files.py's configuration, 91.6 KiB of parameters) at bucket_cap_mb=0.02,
so that the tests check a model that needs several buckets. bucket_cap_mb is in MiB (2**20 bytes),
and the figure labels sizes in MiB and KiB. Ours:
BucketedDataParallel(...).buckets, filled in reverse parameter order, closed before a parameter
would overflow the cap. DDP's: recorded by a communication hook (GradBucket.parameters()) in two
backward passes (of three) in a real gloo group: the first uses one bucket for everything, then DDP rebuilds
its buckets in the order the gradients really arrived, with a 1 MiB first bucket at the default cap,
closing a bucket once it reaches the cap. DDP's own _get_ddp_logging_data() (bucket_sizes,
rebuilt_bucket_sizes) is recorded beside it, and the tests check that both agree.

    python figures/bucket_assignment.py         # images/bucket_assignment.svg
"""
import torch
import torch.nn.functional as F
from style import COLORS, IMAGES, parser, plt, save, stable_svg_style
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.bucketing import BucketedDataParallel
from common.mnist import BasicNet
from common.spawn import run_in_process_group

# tests/nli_files.py's tiny BERT (31 tokens in its vocabulary); tests/test_figures.py checks they agree
TINY_BERT = {"vocab_size": 31, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 128, "num_labels": 3}
MODELS = {"BasicNet": None, "tiny BERT": 0.02}  # bucket_cap_mb: None for the default, 25


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "BasicNet":
        return BasicNet().eval()
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(**TINY_BERT)).eval()


def loss_of(name: str, model) -> torch.Tensor:
    if name == "BasicNet":
        return F.nll_loss(model(torch.randn(2, 1, 28, 28)), torch.tensor([1, 2]))
    return model(input_ids=torch.randint(0, TINY_BERT["vocab_size"], (2, 8)), labels=torch.tensor([0, 2])).loss


def short(name: str) -> str:
    for long, brief in (("bert.", ""), ("encoder.layer.", "layer "), ("attention.", "attn."), ("embeddings", "emb"),
                        ("LayerNorm", "LN"), ("intermediate", "inter"), ("_emb", "")):
        name = name.replace(long, brief)
    return name


def record(rank: int, world_size: int) -> dict:
    """For each model: the parameters' names and bytes, ours, and DDP's buckets in two backward passes."""
    layouts = {}
    for name, cap in MODELS.items():
        options = {} if cap is None else {"bucket_cap_mb": cap}
        model = build(name)
        names = {param: short(param_name) for param_name, param in model.named_parameters()}
        sizes = {names[p]: p.numel() * p.element_size() for p in model.parameters()}
        ours = BucketedDataParallel(build(name), **options)
        ours_names = {param: short(param_name) for param_name, param in ours.module.named_parameters()}
        ddp = DDP(model, **options)
        backward_passes = []

        def recording_hook(state, bucket):
            backward_passes[-1].append([names[p] for p in bucket.parameters()])
            return default_hooks.allreduce_hook(None, bucket)  # then what DDP does anyway

        ddp.register_comm_hook(None, recording_hook)
        for _ in range(3):  # DDP's logging data reports the rebuilt buckets from the third backward on
            backward_passes.append([])
            loss_of(name, ddp).backward()
        assert backward_passes[2] == backward_passes[1], "DDP rebuilds its buckets once"
        logged = ddp._get_ddp_logging_data()
        layouts[name] = {
            "cap_mb": 25 if cap is None else cap, "sizes": sizes,
            "ours": [[ours_names[p] for p in bucket] for bucket in ours.buckets],
            "ddp_first": backward_passes[0], "ddp_rebuilt": backward_passes[1],
            "logged": {key: logged.get(key) for key in ("bucket_sizes", "rebuilt_bucket_sizes")}}
    return layouts


def human(size: float) -> str:
    if size >= 2**20:
        return f"{size / 2**20:.2f} MiB"
    return f"{size / 2**10:.1f} KiB" if size >= 2**10 else f"{size} B"


def draw_column(ax, x: float, top: int, buckets: list[list[str]], sizes: dict, title: str) -> None:
    ax.text(x + 0.5, top + 0.3, title, ha="center", va="bottom", fontsize=8.5, fontweight="bold")
    y = top
    for index, bucket in enumerate(buckets):
        top = y
        for name in bucket:
            y -= 1
            ax.add_patch(plt.Rectangle((x, y + 0.06), 1.0, 0.88, facecolor=COLORS[index % len(COLORS)], alpha=0.35,
                                       edgecolor="none"))
            ax.text(x + 0.02, y + 0.5, name, va="center", fontsize=8)
            ax.text(x + 0.98, y + 0.5, human(sizes[name]), va="center", ha="right", fontsize=8)
        ax.add_patch(plt.Rectangle((x, y + 0.03), 1.0, top - y - 0.06, fill=False, edgecolor=COLORS[index % len(COLORS)], lw=1.5))
        ax.text(x + 1.03, (top + y) / 2, f"bucket {index}\n{human(sum(sizes[n] for n in bucket))}", va="center",
                fontsize=8, color=COLORS[index % len(COLORS)])


def draw(layouts: dict, path) -> None:
    """BasicNet only, so that its eight tensors read at page width; the tiny BERT is recorded for the tests."""
    stable_svg_style()
    layout = layouts["BasicNet"]
    rows = len(layout["sizes"])
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.32 * rows))
    cap = layout["cap_mb"]
    columns = [(f"ours, bucket_cap_mb={cap:g}", layout["ours"]),
               ("DDP, first backward", layout["ddp_first"]),
               ("DDP, rebuilt after it", layout["ddp_rebuilt"])]
    for column, (title, buckets) in enumerate(columns):
        draw_column(ax, column * 1.45, rows, buckets, layout["sizes"], title)
    ax.set_title(f"BasicNet: {human(sum(layout['sizes'].values()))} of gradients, bucket_cap_mb={cap:g}, first bucket "
                 "at the top.\nDDP rebuilt: a 1 MiB first bucket, then 25 MiB, each closed once full; ours: closed before "
                 "overflowing", fontsize=9)
    ax.set_xlim(-0.05, 3 * 1.45)
    ax.set_ylim(-0.2, rows + 1.2)
    ax.set_axis_off()
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "bucket_assignment.svg").parse_args()
    draw(run_in_process_group(record, 2, timeout=120), args.out)


if __name__ == "__main__":
    main()
