"""MultiNLI with BERT, full DDP version: one process per device, started by torchrun.

The same fine-tuning as data_parallel.py, with DistributedDataParallel: torchrun starts N processes,
each joins a process group, uses cuda:LOCAL_RANK, trains on its own 1/N of every global batch
(DistributedSampler, with set_epoch), and DDP averages the gradients during backward. Only rank 0
draws the progress bar and prints. Evaluation is exact: DistributedEvalSampler gives every pair to
exactly one rank and the correct/seen counts are summed, so the accuracy is over exactly the
evaluation set at any world size. (Averaging per-rank accuracies computed on DistributedSampler,
which pads, counts some pairs twice and weights ranks equally however many pairs each saw.)

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    torchrun --nproc_per_node=4 src/ch4/ddp.py                    # 4 GPUs, global batch 32 = 4 x 8
    torchrun --nproc_per_node=2 src/ch4/ddp.py --model path/to/bert --dataset pairs.jsonl   # CPU: gloo
Under SLURM: sbatch -N2 --gpus-per-node=4 slurm/torchrun.sbatch src/ch4/ddp.py

Lines marked `# STEP` are what this step changes in data_parallel.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.cli import add_compile_flag, nli_parser, per_process_batch
from common.compile import compiled
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    print0,
    processes,
    require_launcher,
)
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
def evaluate(model, loader, device, precision):
    """Count correct predictions and pairs seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        with autocast(device, precision):
            predictions = model(**batch).logits.argmax(dim=-1)
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main(args):
    launch = require_launcher("src/ch4/ddp.py")  # STEP: rank, local rank, world size from torchrun or srun
    device = device_for(launch)  # STEP: cuda:LOCAL_RANK, never the global rank; one GPU per process
    timeout = timedelta(seconds=args.dist_timeout)  # STEP: how long a process waits for its peers
    if device.type != "cpu":  # STEP
        torch.get_device_module(device).set_device(device)  # STEP: device_id does not; object collectives use the current GPU
    with exit_if_peers_missing(launch, args.dist_timeout):  # STEP: a peer that never arrives ends the run in one sentence
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,  # STEP: nccl on GPUs, gloo on the CPU
                                timeout=timeout, device_id=device if device.type != "cpu" else None)  # STEP: NCCL: this GPU, connected now
        dist.barrier(async_op=True).wait(timeout=timeout)  # STEP: every peer has joined, or an error within the timeout
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)  # STEP: own dropout masks per rank; DDP copies rank 0's weights to all

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = per_process_batch(args.batch_size, launch.world_size)  # STEP: each rank loads 1/N of the global batch
    train_sampler = DistributedSampler(train_set, seed=args.seed)  # STEP: a disjoint 1/N of the shuffled indices
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler)
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size, DistributedEvalSampler(eval_set))  # STEP

    model = model.to(device)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # STEP: all-reduce gradients in backward
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "  # STEP
           f"{args.batch_size} = {launch.world_size} x {batch_size}")  # STEP
    progress = tqdm(total=total_steps, desc="training", disable=launch.rank != 0)  # STEP: one bar, not N
    steps_done, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # STEP: a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        loss, steps = train_epoch(model, train_loader, optimizer, scheduler, scaler, device, precision,
                                  args.max_grad_norm, total_steps - steps_done, progress)
        train_seconds += time.perf_counter() - start
        steps_done += steps
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size  # STEP: the mean over ranks, not rank 0's
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()

    correct, seen = evaluate(model.module, eval_loader, device, precision)  # STEP: no DDP collectives: a rank may have no batch
    correct, seen = sum_across_ranks(correct, seen, device=device)  # STEP: every pair counted exactly once
    print0(f"train time {train_seconds:.1f} s, {steps_done / train_seconds:.2f} steps/s, "
           f"{steps_done * args.batch_size / train_seconds:.1f} samples/s")
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    dist.destroy_process_group()  # STEP


if __name__ == "__main__":
    main(add_compile_flag(nli_parser(__doc__)).parse_args())
