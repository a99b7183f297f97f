"""MNIST with DeepSpeed ZeRO: the sharded training of mnist_fsdp.py, by the library most fine-tuners type.

mnist_fsdp.py shards with torch's fully_shard (ZeRO stage 3). DeepSpeed's engine does the same and
more, chosen by one number, --zero-stage: 0 is plain data parallelism (every rank holds everything),
1 shards AdamW's state, 2 also the gradients, 3 also the parameters (common/lessons/zero.py writes each out).
What changes from mnist_fsdp.py:
  - the set-up is one config dict (common/deepspeed_config.py: the batch sizes, the stage, the
    precision, and gradient clipping turned off, which DeepSpeed turns on by default);
  - deepspeed.initialize wraps the model and AdamW in one engine, which shards per the stage and
    starts every rank from rank 0's weights, as DDP does: no broadcast, no per-layer wrap;
  - engine.backward(loss) and engine.step() replace backward, the scaler and optimizer.step(): the
    engine scales an fp16 loss itself and averages the gradients in backward (at stages 2-3 piece by
    piece, each rank keeping its shard), then steps AdamW on this rank's shard and zeroes the gradients;
  - the engine's own checkpoint: every rank writes its shards into DIR/step-N/ every
    --checkpoint-every steps; client_state carries the position and every rank's random state
    (gathered: at stages 0-2 only rank 0's file keeps it), and a rerun of the same command resumes
    from the newest (bitwise, docs/deepspeed.md), at the world size that wrote it. The trained
    weights go to DIR/final.pt, gathered in full (stage 3 holds only pieces);
  - with --precision bf16 or fp16 the engine holds 16-bit weights, and its forward turns autocast
    off: the images are cast to the weights' dtype instead.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    # 2 GPUs, or 2 CPU processes (gloo)
    torchrun --nproc_per_node=2 src/ch4/sharded/mnist_deepspeed.py --zero-stage 2
    # DeepSpeed's own launcher, 4 GPUs
    deepspeed --num_gpus 4 src/ch4/sharded/mnist_deepspeed.py --zero-stage 3
    # ... on the CPU, 2 processes
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 src/ch4/sharded/mnist_deepspeed.py
Needs DeepSpeed: pip install -e '.[deepspeed]'. On a CPU torchrun sets OMP_NUM_THREADS=1 per process.

It rewrites much of mnist_fsdp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/sharded/mnist_fsdp.py src/ch4/sharded/mnist_deepspeed.py` shows the change.
"""
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from common.checkpoint import Position, exit_finished, rng_state, set_rng_state, write_atomically
from common.cli import add_checkpoint_flags, add_deepspeed_flags, mnist_parser, per_process_batch
from common.deepspeed_config import (
    deepspeed_config,
    input_dtype,
    refuse_another_run,
    remove_old_checkpoints,
    require_deepspeed,
)
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    exit_process,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import resolve_precision
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler

deepspeed = require_deepspeed()  # import deepspeed, or one sentence on how to install it


def train_epoch(engine, loader, device, dtype, position, args, fingerprint):
    """One pass over this process's share of the training set; returns the mean training loss."""
    engine.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in loader:
        images = images.to(device, dtype, memory_format=torch.channels_last, non_blocking=True)  # the weights' dtype
        labels = labels.to(device, non_blocking=True)
        loss = F.nll_loss(engine(images), labels)  # no autocast: the engine's forward turns it off
        engine.backward(loss)  # fp16 loss scaling; averages the gradients (stages 2-3: as backward makes each)
        engine.step()  # clip if configured, AdamW on this rank's shard, gather (stages 1-2), zero the gradients
        loss_sum += loss.detach()
        position.advance(loader.sampler.global_batch, len(loader.dataset))  # the samples all ranks trained on
        if position.step % args.checkpoint_every == 0:
            save_checkpoint(engine, args.checkpoint_dir, position, device, fingerprint)
    return loss_sum.item() / len(loader)


def save_checkpoint(engine, folder, position, device, fingerprint):
    """The engine writes its own checkpoint, every rank its shards; client_state rides in rank 0's file
    (stage 3: every rank's)."""
    every_rng = [None] * dist.get_world_size()
    dist.all_gather_object(every_rng, rng_state(device))  # each rank's dropout masks go on as they would have
    engine.save_checkpoint(folder, tag=f"step-{position.step}",
                           client_state={"position": asdict(position), "rng": every_rng,
                                         "fingerprint": fingerprint})
    if dist.get_rank() == 0:
        remove_old_checkpoints(folder)  # DeepSpeed keeps every tag


@torch.no_grad()
def evaluate(model, loader, device, dtype, unpadded):
    """Count correct predictions and images seen among this rank's first `unpadded` images."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, dtype, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        predictions = model(images).argmax(dim=1)
        keep = min(labels.numel(), unpadded - seen)
        correct += (predictions[:keep] == labels[:keep]).sum().item()
        seen += keep
    return correct, seen


def main():
    args = add_deepspeed_flags(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/mnist-deepspeed",
                                                    every=200)).parse_args()

    launch = require_launcher("src/ch4/sharded/mnist_deepspeed.py")
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

    train_set, test_set = load_mnist(args.data_dir, args.loader, launch.local_rank)
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)  # can start mid-epoch
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers, torch.Generator())  # not the global RNG
    test_loader = mnist_loader(test_set, args.eval_batch_size,
                               DistributedSampler(test_set, shuffle=False), args.num_workers)
    unpadded = len(DistributedEvalSampler(test_set))

    model = BasicNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = deepspeed_config(args, launch.world_size, precision)  # batch sizes, stage, precision, no clipping
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)  # rank 0's weights, sharded per the stage
    fingerprint = {"ZeRO stage": engine.zero_optimization_stage(), "precision": precision,
                   "global batch": args.batch_size, "training images": len(train_set), "seed": args.seed}  # what must match to resume
    client_state = None
    if (Path(args.checkpoint_dir) / "latest").exists():  # DeepSpeed's file naming the newest tag
        refuse_another_run(args.checkpoint_dir, launch.world_size, fingerprint)  # one file of shards per rank, and these settings
        _, client_state = engine.load_checkpoint(args.checkpoint_dir)  # every rank reads its shards
    position = Position(**client_state["position"]) if client_state else Position()
    if client_state:
        set_rng_state(client_state["rng"][launch.rank], device)
        print0(f"resumed at step {position.step}: epoch {position.epoch}, "
               f"{position.samples_done} samples into it")
        if position.epoch >= args.epochs:  # a rerun of a finished run
            exit_finished(Path(args.checkpoint_dir), position, longer="a larger --epochs")
    first_step = position.step

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, "
           f"ZeRO stage {engine.zero_optimization_stage()}, "
           f"global batch {args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(position.epoch, args.epochs):
        train_sampler.set_epoch(epoch, position.samples_done)  # the same shuffle, from the global cursor on
        start = time.perf_counter()
        loss = train_epoch(engine, train_loader, device, input_dtype(precision), position, args, fingerprint)
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")
    save_checkpoint(engine, args.checkpoint_dir, position, device, fingerprint)  # a later --epochs N continues from here
    final = Path(args.checkpoint_dir) / "final.pt"
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3 all-gathers; 0-2 hold them whole
        if launch.rank == 0:
            write_atomically({k: v.float().cpu() for k, v in engine.module.state_dict().items()}, final)
    print0(f"final weights in {final}")

    correct, seen = evaluate(engine, test_loader, device, input_dtype(precision), unpadded)  # stage 3: every rank runs every forward
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "  # this run's
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()
    exit_process()


if __name__ == "__main__":
    main()
