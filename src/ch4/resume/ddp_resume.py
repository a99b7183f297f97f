"""MultiNLI with BERT, full DDP version made restartable: killed, restarted, and bitwise where it
would have been.

ddp.py with the checkpoints of mnist_3_ddp_resume.py (read that one first: the same lesson on a
smaller model). What a BERT run adds: the learning-rate schedule is part of the state (a resumed
linear decay must continue from its step, not restart at the peak), and dropout inside every layer
makes the restored per-rank random state visible in the weights. Every --checkpoint-every optimizer
steps all ranks save together (weights, optimizer, scheduler, loss scaler, position, each rank's
random state); at start-up the newest checkpoint that loads is restored; a resumed epoch continues
at the next unseen global batch of the same shuffle (the position is a global sample cursor, so at
another world size too); SIGTERM/SIGUSR1 stop all ranks at one step after a checkpoint; the trained
weights go to DIR/final.pt.

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=4 --max-restarts=3 \\
        src/ch4/resume/ddp_resume.py --checkpoint-dir checkpoints/bert
    sbatch -N2 --gpus-per-node=4 slurm/requeue.sbatch src/ch4/resume/ddp_resume.py \\
        --checkpoint-dir checkpoints/bert
(Why the variable: docs/resume.md.)

Lines marked `# STEP` are what this step changes in ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.checkpoint import Checkpoints, Position
from common.cli import add_checkpoint_flags, nli_parser, per_process_batch
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
from common.resume_buckets import rebuild_buckets
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler
from common.stop_signal import StopSignal


def train_epoch(model, loader, optimizer, scheduler, scaler, device, precision,  # STEP
                max_grad_norm, steps_left, progress,  # STEP
                position, checkpoints, stop):  # STEP
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
        position.advance(loader.sampler.global_batch, len(loader.dataset))  # STEP: the samples all ranks trained on
        if stop.agreed() or checkpoints.due(position):  # STEP: one small all-reduce, on the CPU: all ranks stop at one step
            checkpoints.save(position, training_state(model, optimizer, scheduler, scaler))  # STEP: every rank calls it
        if stop.signum:  # STEP
            stop.exit(position.step)  # STEP
    return loss_sum.item() / max(steps, 1), steps


def training_state(model, optimizer, scheduler, scaler) -> dict:  # STEP
    """What a checkpoint holds besides the position and each rank's random state."""  # STEP
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),  # STEP
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}  # STEP


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
    launch = require_launcher("src/ch4/resume/ddp_resume.py")  # STEP
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
    train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)  # STEP: can start mid-epoch
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler, torch.Generator())  # STEP: not the global RNG
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size, DistributedEvalSampler(eval_set))

    model = model.to(device)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    scaler = grad_scaler(device, precision)
    checkpoints = Checkpoints(args.checkpoint_dir, args.checkpoint_every, device=device,  # STEP: what must match to resume:
                              fingerprint={"global batch": args.batch_size, "training pairs": len(train_set),  # STEP
                                           "seed": args.seed, "steps": total_steps, "model": args.model,  # STEP
                                           "precision": precision})  # STEP: only fp16 has a loss-scaler state to resume
    state = checkpoints.load_newest()  # STEP: None on a fresh start; this rank's random state back, or reseeded at another world size
    position = Position(**state["position"]) if state else Position()  # STEP
    checkpoints.exit_if_finished(position, position.step >= total_steps)  # STEP: a rerun of a finished run (more steps are another run)
    if state:  # STEP
        model.module.load_state_dict(state["model"])  # STEP
        optimizer.load_state_dict(state["optimizer"])  # STEP
        scheduler.load_state_dict(state["scheduler"])  # STEP: the schedule goes on from its step
        scaler.load_state_dict(state["scaler"])  # STEP
        rebuild_buckets(model, autocast(device, precision),  # STEP: the first run's buckets
                        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))  # STEP
    stop = StopSignal()  # STEP: SIGTERM and SIGUSR1 only set a flag

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    progress = tqdm(total=total_steps, initial=position.step, desc="training", disable=launch.rank != 0)  # STEP
    steps_done, train_seconds = 0, 0.0
    for epoch in range(position.epoch, args.epochs):  # STEP
        train_sampler.set_epoch(epoch, position.samples_done)  # STEP: the same shuffle, from the global cursor on
        start = time.perf_counter()
        loss, steps = train_epoch(model, train_loader, optimizer, scheduler, scaler, device, precision,
                                  args.max_grad_norm, total_steps - position.step, progress,  # STEP
                                  position, checkpoints, stop)  # STEP
        train_seconds += time.perf_counter() - start
        steps_done += steps
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()
    checkpoints.save(position, training_state(model, optimizer, scheduler, scaler))  # STEP: the end, for a rerun to find
    print0(f"final weights in {checkpoints.save_final(model.module.state_dict())}")  # STEP

    correct, seen = evaluate(model.module, eval_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, {steps_done / max(train_seconds, 1e-9):.2f} steps/s, "  # STEP: this run's
           f"{steps_done * args.batch_size / max(train_seconds, 1e-9):.1f} samples/s")  # STEP
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(add_checkpoint_flags(nli_parser(__doc__), "checkpoints/bert", every=500).parse_args())  # STEP
