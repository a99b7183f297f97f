"""MNIST, the stateful-loader rung reading a stream: Parquet shards through a `datasets` IterableDataset.

A dataset too large to index is read as a stream: no length, no sampler, each rank a share of the shards.
What changes from mnist_stateful.py (common/stream.py holds the pieces):
  - the training set is --stream-dir's Parquet shards (written there from MNIST by local rank 0 if the folder
    has none), opened with load_dataset(..., streaming=True) and split with split_dataset_by_node: rank r of
    N reads whole shards r, r + N, ..., and each of its workers a share of those; a number of shards that
    does not split over ranks x workers is refused in one sentence;
  - rows are shuffled through a buffer of --shuffle-buffer rows and decoded and shifted on the fly, in the
    workers; the buffer's rows are part of each worker's state (datasets' own buffer is refilled on resume,
    and the rows it held are never trained on);
  - the epoch ends when a rank runs out: one small all-reduce a step asks whether every rank has a batch,
    where a rank whose share is longer would otherwise wait in DDP's all-reduce until the timeout;
  - the loader states resume the same ranks with the same workers only: a stream's place is each worker's
    place in its shards, which another world size splits otherwise. Such a run is refused mid-epoch (change
    the world size at an epoch's end).

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        src/ch4/data_pipeline/mnist_stream.py --num-workers 2 --augment 2 --checkpoint-dir checkpoints/stream

Lines marked `# STEP` are what this step changes in data_pipeline/mnist_stateful.py.
"""
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import Checkpoints, Position
from common.cli import add_augment_flag, add_checkpoint_flags, mnist_parser, per_process_batch
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    pin_memory,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.loader_state import StatefulDataLoader, gather_loader_states, restore_loader
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.resume_buckets import rebuild_buckets
from common.samplers import DistributedEvalSampler
from common.stop_signal import StopSignal
from common.stream import ShuffleBuffer, add_stream_flags, every_rank_has, mnist_stream, shards_in
from common.worker_seeds import seed_epoch, seed_worker, warn_if_oversubscribed


def train_epoch(model, loader, optimizer, scaler, device, precision, position, checkpoints, stop):
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    start = position.step
    batches = iter(loader)  # STEP
    while every_rank_has(batch := next(batches, None)):  # STEP: the epoch ends on every rank when one runs out
        images, labels, _ = batch  # STEP: and each row's index
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        position.advance(len(labels) * dist.get_world_size(), math.inf)  # STEP: a stream has no length
        if stop.agreed() or checkpoints.due(position):
            checkpoints.save(position, training_state(model, optimizer, scaler, loader))
        if stop.signum:
            stop.exit(position.step)
    steps = position.step - start  # STEP: none where a checkpoint at the epoch's last step resumed
    return loss_sum.item() / steps if steps else math.nan  # STEP


def training_state(model, optimizer, scaler, loader) -> dict:
    """What a checkpoint holds besides the position and each rank's random state."""
    return {"model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "loaders": gather_loader_states(loader)}


@torch.no_grad()
def evaluate(model, loader, device, precision):
    """Count correct predictions and images seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main():
    args = add_stream_flags(add_augment_flag(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/stream",  # STEP
                                                                  every=200))).parse_args()  # STEP

    launch = require_launcher("src/ch4/data_pipeline/mnist_stream.py")  # STEP
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
    warn_if_oversubscribed(args.num_workers, launch.local_world_size)
    stream = ShuffleBuffer(mnist_stream(shards_in(args.stream_dir, train_set, launch.local_rank),  # STEP: written once
                                        launch.rank, launch.world_size, args.num_workers),  # STEP: this rank's shards
                           args.shuffle_buffer, args.augment)  # STEP: shuffled and shifted in the workers
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_loader = StatefulDataLoader(
        stream, batch_size,  # STEP: no sampler: the stream is this rank's
        num_workers=args.num_workers, worker_init_fn=seed_worker,
        generator=torch.Generator(), pin_memory=pin_memory())
    test_loader = mnist_loader(test_set, args.eval_batch_size, DistributedEvalSampler(test_set),
                               args.num_workers)

    model = BasicNet().to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)
    checkpoints = Checkpoints(args.checkpoint_dir, args.checkpoint_every, device=device,
                              fingerprint={"global batch": args.batch_size,
                                           "training images": len(train_set), "seed": args.seed,
                                           "precision": precision, "augment": args.augment})
    state = checkpoints.load_newest()
    position = Position(**state["position"]) if state else Position()
    checkpoints.exit_if_finished(position, position.epoch >= args.epochs, longer="a larger --epochs")
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        rebuild_buckets(model, autocast(device, precision), torch.zeros(1, 1, 28, 28, device=device))
    stop = StopSignal()
    if state and position.samples_done:  # STEP: mid-epoch: the same ranks and workers, or one sentence and exit
        restore_loader(train_loader, state["loaders"], launch.rank, launch.world_size, cursor=False)  # STEP
    first_step = position.step

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(position.epoch, args.epochs):
        stream.set_epoch(epoch)  # STEP
        seed_epoch(train_loader, args.seed, launch.rank, epoch)
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision,
                           position, checkpoints, stop)
        train_seconds += time.perf_counter() - start
        position.epoch, position.samples_done = epoch + 1, 0  # STEP: the stream ran out
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")
    checkpoints.save(position, training_state(model, optimizer, scaler, train_loader))
    print0(f"final weights in {checkpoints.save_final(model.module.state_dict())}")

    correct, seen = evaluate(model.module, test_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
