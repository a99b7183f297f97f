"""MultiNLI with BERT and FSDP2 (`fully_shard`): ddp.py with the parameters, gradients and optimizer
state sharded.

The same fine-tuning as ddp.py, but each of the N ranks keeps only 1/N of the model, of its gradients
and of AdamW's moments (ZeRO stage 3; common/lessons/zero.py writes the idea out). Each encoder layer is
wrapped on its own, then the whole model (which keeps the embeddings, the pooler and the classifier
as one more group): a layer all-gathers its parameters just before its forward and again before its
backward, and frees them after, so at most about one layer is held in full besides the root's group.
Backward reduce-scatters the gradients: each rank receives the average of its own piece, and AdamW
updates that piece. What changes from ddp.py:
  - fully_shard keeps rank r's piece of rank r's OWN copy, and the classifier head is initialized at
    random, differently per rank: rank 0's weights are broadcast first, as DDP does, so that the
    model starts as DDP's, not as a patchwork of N heads;
  - evaluation must run the same forward passes on every rank, because every layer's forward is an
    all-gather all ranks join: DistributedSampler (which repeats a few pairs so that every rank gets as
    many) replaces DistributedEvalSampler, and each rank scores only the pairs before its repeats
    (they come last), so every pair still counts exactly once, even with fewer pairs than ranks.

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    # 4 GPUs, global batch 32 = 4 x 8
    torchrun --nproc_per_node=4 src/ch4/sharded/nli_fsdp.py
    # CPU: gloo
    torchrun --nproc_per_node=2 src/ch4/sharded/nli_fsdp.py --model path/to/bert --dataset pairs.jsonl

Lines marked `# STEP` are what this step changes in ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.cli import nli_parser, per_process_batch
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    exit_process,
    print0,
    processes,
    require_launcher,
)
from common.fsdp import fully_shard_blocks
from common.gather import sum_across_ranks
from common.nli import load_model_and_tokenizer, load_pairs, nli_loader, to_device, tokenize_pairs
from common.precision import autocast, grad_scaler, optimizer_step, resolve_precision
from common.samplers import DistributedEvalSampler


def train_epoch(model, loader, optimizer, scheduler, scaler, device, precision, max_grad_norm,
                steps_left, progress):
    """One pass over this process's share of the pairs, or fewer if steps_left runs out first."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    steps = 0
    for batch in loader:
        if steps == steps_left:
            break
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        with autocast(device, precision):
            loss = nn.functional.cross_entropy(model(**batch).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # fp16: the true gradients, so that the norm is measured on them
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # the total norm of the whole averaged gradient
        if optimizer_step(optimizer, scaler):  # False where fp16 loss scaling skipped the step
            scheduler.step()
        loss_sum += loss.detach()
        steps += 1
        progress.update()
    return loss_sum.item() / max(steps, 1), steps


@torch.no_grad()
def evaluate(model, loader, device, precision, unpadded):  # STEP
    """Count correct predictions and pairs seen among this rank's first `unpadded` pairs."""  # STEP
    model.eval()
    correct = seen = 0
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        with autocast(device, precision):
            predictions = model(**batch).logits.argmax(dim=-1)
        keep = min(labels.numel(), unpadded - seen)  # STEP: DistributedSampler's repeats come last: skip them
        correct += (predictions[:keep] == labels[:keep]).sum().item()  # STEP
        seen += keep  # STEP
    return correct, seen


def main(args):
    launch = require_launcher("src/ch4/sharded/nli_fsdp.py")  # STEP
    device = device_for(launch)
    timeout = timedelta(seconds=args.dist_timeout)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    with exit_if_peers_missing(launch, args.dist_timeout):
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, device_id=device if device.type != "cpu" else None)
        dist.barrier(async_op=True).wait(timeout=timeout)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler)
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size,  # STEP: as many batches on every rank
                             DistributedSampler(eval_set, shuffle=False))  # STEP
    unpadded = len(DistributedEvalSampler(eval_set))  # STEP: this rank's share before DistributedSampler's repeats

    model = model.to(device)
    for tensor in model.state_dict().values():  # STEP: shard rank 0's weights, not a patchwork of N
        dist.broadcast(tensor, src=0)  # STEP
    fully_shard_blocks(model)  # STEP: fully_shard each encoder layer (one all-gather each, then freed), then the root
    # STEP: the root holds embeddings, pooler and classifier; model.parameters() are now this rank's pieces
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    progress = tqdm(total=total_steps, desc="training", disable=launch.rank != 0)
    steps_done, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss, steps = train_epoch(model, train_loader, optimizer, scheduler, scaler, device, precision,
                                  args.max_grad_norm, total_steps - steps_done, progress)
        train_seconds += time.perf_counter() - start
        steps_done += steps
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()

    correct, seen = evaluate(model, eval_loader, device, precision, unpadded)  # STEP: through FSDP, on every rank, the same batches
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, {steps_done / train_seconds:.2f} steps/s, "
           f"{steps_done * args.batch_size / train_seconds:.1f} samples/s")
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    dist.destroy_process_group()
    exit_process()  # STEP: FSDP2 holds the process group past its destruction: exit before the teardown races gloo


if __name__ == "__main__":
    main(nli_parser(__doc__).parse_args())  # STEP: no --compile here; mnist_fsdp.py compiles per block
