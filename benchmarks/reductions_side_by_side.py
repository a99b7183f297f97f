"""Reductions done wrong and done right, side by side with one process on the whole global batch.

Starts N gloo processes on this machine (common/spawn.py); each takes its slice of one global batch,
in float64, and computes each quantity of docs/reductions.md the wrong way and the right way, with
the functions of common/. Every rank's numbers are printed beside the number one process computes
on the whole global batch (no process group):
  gradient clipping     the total gradient norm clip_grad_norm_ measures, under DDP (each rank's own
                        gradient, as inside no_sync, or the averaged one) and under ZeRO stage 2
                        (common/lessons/zero.py: the shards' own norm, or ZeRO.clip_grad_norm_)
  token-weighted loss   a tiny next-token model over 2 micro-batches of padded sequences of different
                        lengths per rank (common/lessons/token_loss.py): the loss whose gradient DDP leaves,
                        and how far that gradient is from one process's token-mean gradient
  BatchNorm             BatchNormNet (common/lessons/batch_norm.py) after one training forward under DDP: the
                        first norm's running mean (channel 0) and the output's distance from one
                        process's, with plain BatchNorm2d and with AllRanksBatchNorm2d
  printed loss          rank 0's own mean loss, and the mean over the ranks (common/gather.py)

    python benchmarks/reductions_side_by_side.py             # 2 processes; seconds, mostly starting them
    python benchmarks/reductions_side_by_side.py --nproc 3
"""
import argparse
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.gather import sum_across_ranks
from common.lessons.batch_norm import AllRanksBatchNorm2d, BatchNormNet
from common.lessons.token_loss import accumulate, token_loss_sum
from common.lessons.zero import ZeRO
from common.spawn import run_in_process_group

PER_RANK = 4  # samples (or images) per rank
MICRO_BATCHES, SEQUENCES, VOCAB = 2, 2, 16  # per rank: micro-batches of SEQUENCES padded sequences
MAX_NORM = 0.01  # below every norm here, so that clipping scales


# ---- the data: one global batch, of which rank r takes slice r ----

def global_batch(world_size):
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(world_size * PER_RANK, 6, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (world_size * PER_RANK,), generator=generator)


def global_images(world_size):
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(world_size * PER_RANK, 1, 28, 28, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (world_size * PER_RANK,), generator=generator))


def global_sequences(world_size):
    """MICRO_BATCHES x SEQUENCES token sequences per rank; each micro-batch pairs lengths from one range
    (short, then long), so that micro-batches hold very different numbers of real tokens."""
    generator = torch.Generator().manual_seed(3)
    lengths = [int(torch.randint(*((2, 5) if index // SEQUENCES % 2 == 0 else (9, 13)), (1,), generator=generator))
               for index in range(world_size * MICRO_BATCHES * SEQUENCES)]
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def mine(items, rank, per_rank):
    return items[rank * per_rank:(rank + 1) * per_rank]


def padded(sequences):
    """Right-padded input_ids and the attention mask that marks the real tokens."""
    longest = max(len(s) for s in sequences)
    return {"input_ids": torch.stack([F.pad(s, (0, longest - len(s))) for s in sequences]),
            "attention_mask": torch.stack([F.pad(torch.ones_like(s), (0, longest - len(s))) for s in sequences])}


# ---- the models ----

def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)).double()


class NextToken(nn.Module):
    """The smallest next-token model: each token's embedding predicts the token after it. It returns
    .logits, as a transformers causal language model does, for common/lessons/token_loss.py."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 8).double(), nn.Linear(8, VOCAB).double()

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.head(self.embed(input_ids)))


def batch_norm_net(norm=nn.BatchNorm2d):
    """Training mode (batch statistics) with dropout off, so that every process does the same arithmetic."""
    torch.manual_seed(0)
    model = BatchNormNet(norm).double().train()
    model.dropout1.eval(), model.dropout2.eval()
    return model


def first_norm(model):
    return (model.module if isinstance(model, DDP) else model).conv1[1]


def flat_gradient(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def distance(got, want) -> float:
    """Relative distance: |got - want| / |want|."""
    return ((got - want).norm() / want.norm()).item()


# ---- one process, the whole global batch ----

def one_process(world_size) -> dict:
    model = classifier()
    inputs, labels = global_batch(world_size)
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()

    language_model = NextToken()
    loss_sum, tokens = token_loss_sum(language_model, **padded(global_sequences(world_size)))
    (loss_sum / tokens).backward()

    net = batch_norm_net()
    images, image_labels = global_images(world_size)
    output = net(images)
    return {"norm": norm, "loss": loss.item(), "token_loss": (loss_sum / tokens).item(),
            "token_gradient": flat_gradient(language_model), "output": output.detach(),
            "running_mean": first_norm(net).running_mean[0].item()}


# ---- N processes, each its slice, wrong and right ----

def clip_norms(rank, world_size) -> dict:
    inputs, labels = (mine(t, rank, PER_RANK) for t in global_batch(world_size))
    norms = {}
    for name in ("ddp, own gradient", "ddp, averaged gradient"):
        model = DDP(classifier())
        with model.no_sync() if name == "ddp, own gradient" else torch.enable_grad():
            F.cross_entropy(model(inputs), labels).backward()
        norms[name] = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    for name in ("zero-2, shards' own norm", "zero-2, clip_grad_norm_"):
        zero = ZeRO(classifier(), 2, lambda params: torch.optim.SGD(params, lr=0.1))
        F.cross_entropy(zero(inputs), labels).backward()
        if name == "zero-2, shards' own norm":
            norms[name] = nn.utils.clip_grad_norm_([unit.shard for unit in zero.units], MAX_NORM).item()
        else:
            norms[name] = zero.clip_grad_norm_(MAX_NORM).item()
    return norms


def token_losses(rank, world_size, reference_gradient) -> dict:
    """Per way: the loss whose gradient DDP's average is (the same on every rank), and that gradient's
    distance from one process's token-mean gradient."""
    micro_batches = [padded(mine(global_sequences(world_size), rank, MICRO_BATCHES * SEQUENCES)[i:i + SEQUENCES])
                     for i in range(0, MICRO_BATCHES * SEQUENCES, SEQUENCES)]
    sums, counts = zip(*(token_loss_sum(NextToken(), **batch) for batch in micro_batches))
    with torch.no_grad():
        losses = {"micro_batch_means": sum(s / c for s, c in zip(sums, counts)) / len(micro_batches),
                  "local_tokens": sum(sums) / sum(counts),
                  "global_tokens": sum(sums) * world_size / sum_across_ranks(int(sum(counts)), device="cpu")[0]}
    results = {}
    for way, loss in losses.items():
        model = DDP(NextToken())
        accumulate(model, micro_batches, way)
        averaged = sum_across_ranks(loss.item(), device="cpu")[0] / world_size  # what DDP's averaged gradient is the gradient of
        results[way] = (averaged, distance(flat_gradient(model), reference_gradient))
    return results


def batch_norms(rank, world_size, reference_output) -> dict:
    images, labels = (mine(t, rank, PER_RANK) for t in global_images(world_size))
    results = {}
    for name, norm in (("plain BatchNorm2d", nn.BatchNorm2d), ("AllRanksBatchNorm2d", AllRanksBatchNorm2d)):
        model = DDP(batch_norm_net(norm))
        output = model(images)
        F.nll_loss(output, labels).backward()
        results[name] = (first_norm(model).running_mean[0].item(),
                         distance(output.detach(), mine(reference_output, rank, PER_RANK)))
    return results


def printed_losses(rank, world_size) -> dict:
    model = classifier()
    inputs, labels = (mine(t, rank, PER_RANK) for t in global_batch(world_size))
    loss = F.cross_entropy(model(inputs), labels).item()
    return {"rank 0's own": loss, "mean over the ranks": sum_across_ranks(loss, device="cpu")[0] / world_size}


def on_each_rank(rank, world_size, reference) -> list[dict]:
    """This rank's numbers, wrong and right; every rank's, gathered."""
    # common/lessons/zero.py's reduce_scatter_tensor warns on this torch that it is deprecated: not this page's lesson
    warnings.filterwarnings("ignore", "`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning)
    mine_now = {"clipping": clip_norms(rank, world_size),
                "token_loss": token_losses(rank, world_size, reference["token_gradient"]),
                "batch_norm": batch_norms(rank, world_size, reference["output"]),
                "printed_loss": printed_losses(rank, world_size)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine_now)
    return everyone


def measure(world_size: int) -> dict:
    """One process's numbers, and each rank's, wrong and right."""
    reference = one_process(world_size)
    return {"one_process": reference, "ranks": run_in_process_group(on_each_rank, world_size, reference, timeout=120)}


# ---- the side-by-side print ----

def row(label, values):
    return f"  {label:<40}" + "".join(f"{value:>12.6f}" for value in values)


def header(*columns):
    return f"  {'':<40}" + "".join(f"{column:>12}" for column in columns)


def report(measured: dict) -> list[str]:
    one, ranks = measured["one_process"], measured["ranks"]
    every_rank = header(*(f"rank {r}" for r in range(len(ranks))))
    lines = [f"{len(ranks)} processes, each its slice of one global batch, in float64; "
             "one process: the whole global batch",
             "", "Gradient clipping: the total norm that clip_grad_norm_ measures", every_rank,
             row("one process", [one["norm"]])]
    for name, verdict in (("ddp, own gradient", "wrong"), ("ddp, averaged gradient", "right"),
                          ("zero-2, shards' own norm", "wrong"), ("zero-2, clip_grad_norm_", "right")):
        lines.append(row(f"{verdict}  {name}", [rank["clipping"][name] for rank in ranks]))
    lines += ["", "Token-weighted loss: the loss whose gradient DDP leaves on every rank, and how far",
              "that gradient is from one process's (relative distance)", header("loss", "distance"),
              row("one process, mean over every real token", [one["token_loss"], 0.0])]
    for way, label in (("micro_batch_means", "wrong  mean of micro-batch means"),
                       ("local_tokens", "wrong  each rank's own token count"),
                       ("global_tokens", "right  the global token count")):
        lines.append(row(label, ranks[0]["token_loss"][way]))
    lines += ["", "BatchNorm: the first norm's running mean (channel 0) after one training forward", every_rank,
              row("one process", [one["running_mean"]])]
    for name, verdict in (("plain BatchNorm2d", "wrong"), ("AllRanksBatchNorm2d", "right")):
        lines.append(row(f"{verdict}  {name}", [rank["batch_norm"][name][0] for rank in ranks]))
    lines += ["", "BatchNorm: each rank's output, its relative distance from one process's output", every_rank]
    for name, verdict in (("plain BatchNorm2d", "wrong"), ("AllRanksBatchNorm2d", "right")):
        lines.append(row(f"{verdict}  {name}", [rank["batch_norm"][name][1] for rank in ranks]))
    lines += ["", "Printed loss: the number rank 0 prints", row("one process", [one["loss"]])]
    for name, verdict in (("rank 0's own", "wrong"), ("mean over the ranks", "right")):
        lines.append(row(f"{verdict}  {name}", [ranks[0]["printed_loss"][name]]))
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (default: 2)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    measured = measure(args.nproc)
    print("\n".join(report(measured)), flush=True)
    return measured


if __name__ == "__main__":
    main()
