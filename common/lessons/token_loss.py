"""A causal language model's loss over micro-batches and ranks: the mean over every real token of the
global batch, the loss one process would take on all of it.

Sequences have different lengths, so micro-batches hold different numbers of real (non-padding)
tokens. Averaging each micro-batch's mean, then averaging those over the k micro-batches and (DDP)
the N ranks, weights a token of a short micro-batch more than one of a long micro-batch: a mean
of means, not the mean: the gradient-accumulation bug transformers' Trainer fixed in 2024.

The right way sums each micro-batch's token losses and divides by the global batch's token count T,
counted before the first backward and all-reduced over the ranks. DDP then averages the ranks'
gradients, dividing by N, so each rank multiplies its loss by N: N · sum_r / T, averaged over the
ranks, is the sum over every rank / T. (transformers' Trainer does the same since that fix:
num_items_in_batch, and the loss times the number of processes.)
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100  # the label cross_entropy skips: padding
WAYS = ("global_tokens", "local_tokens", "micro_batch_means")


def token_loss_sum(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of predicting each next real token, and how many there were."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (targets != IGNORE).sum()


def local_token_count(micro_batches: list[dict]) -> torch.Tensor:
    """The real tokens to predict in this rank's micro-batches (the first token of each is not predicted)."""
    return sum((batch["attention_mask"][:, 1:] != 0).sum() for batch in micro_batches)


def global_token_count(micro_batches: list[dict]) -> torch.Tensor:
    """The real tokens to predict in this optimizer step, over all micro-batches and all ranks."""
    count = local_token_count(micro_batches).clone()
    if dist.is_initialized():
        dist.all_reduce(count)
    return count


def accumulate(model, micro_batches: list[dict], way: str = "global_tokens") -> None:
    """Backward over the k micro-batches (DDP all-reduces once, after the last), leaving in .grad:
      global_tokens      the gradient of the global batch's token mean (right);
      local_tokens       the mean over ranks of each rank's token mean (the count not all-reduced);
      micro_batch_means  the mean of each micro-batch's mean (the common bug)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tokens = global_token_count(micro_batches)
    local_tokens = local_token_count(micro_batches)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            loss_sum, count = token_loss_sum(model, batch["input_ids"], batch["attention_mask"])
            if way == "global_tokens":
                loss = loss_sum * world_size / tokens
            elif way == "local_tokens":
                loss = loss_sum / local_tokens
            else:
                loss = loss_sum / count / len(micro_batches)
            loss.backward()
