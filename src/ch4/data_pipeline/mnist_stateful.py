"""MNIST, the workers' rung with torchdata's StatefulDataLoader: a resume takes each worker's state from the checkpoint.

mnist_workers.py resumes exactly by making the workers load and augment again every batch the epoch had
trained on. StatefulDataLoader has a state_dict() instead (common/loader_state.py says what it holds):
  - every checkpoint holds each rank's loader state, gathered to rank 0: where the loader is in the epoch,
    its workers' base seed, and the state each worker last sent with a batch, here the worker's generator
    (WorkerShift.state_dict). Prefetched batches the loop has not taken yet are not in it;
  - a resumed rank hands its own state back to its loader, which starts each worker from it and skips the
    sampler's first indices without loading them: no replay, and bitwise the run that never stopped;
  - at another world size or --num-workers the states do not fit the new ranks and workers: the run says
    so and goes on from the checkpoint's global sample cursor with new worker seeds (every sample of the
    epoch once, other augmentations).

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        src/ch4/data_pipeline/mnist_stateful.py --num-workers 2 --augment 2 --checkpoint-dir checkpoints/stateful

Lines marked `# STEP` are what this step changes in data_pipeline/mnist_workers.py.
"""
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
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler
from common.stop_signal import StopSignal
from common.worker_seeds import WorkerShift, seed_epoch, seed_worker, warn_if_oversubscribed


def train_epoch(model, loader, optimizer, scaler, device, precision, position, checkpoints, stop):  # STEP
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    start = position.step  # STEP
    for images, labels in loader:  # STEP: a restored loader starts at the next batch
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        position.advance(loader.sampler.global_batch, len(loader.dataset))
        if stop.agreed() or checkpoints.due(position):
            checkpoints.save(position, training_state(model, optimizer, scaler, loader))  # STEP
        if stop.signum:
            stop.exit(position.step)
    return loss_sum.item() / (position.step - start)  # STEP: the batches trained on; a restored loader's len is the epoch's


def training_state(model, optimizer, scaler, loader) -> dict:  # STEP
    """What a checkpoint holds besides the position and each rank's random state."""
    return {"model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),  # STEP
            "loaders": gather_loader_states(loader)}  # STEP: every rank's, a collective


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
    args = add_augment_flag(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/stateful",  # STEP
                                                 every=200)).parse_args()

    launch = require_launcher("src/ch4/data_pipeline/mnist_stateful.py")  # STEP
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
    train_set = WorkerShift(train_set, args.augment)
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)
    train_loader = StatefulDataLoader(  # STEP: a DataLoader with a state_dict
        train_set, batch_size, sampler=train_sampler, collate_fn=train_set.collate,
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
    restored = bool(state and position.samples_done) and restore_loader(  # STEP: mid-epoch, where the ranks and workers fit
        train_loader, state["loaders"], launch.rank, launch.world_size)  # STEP
    first_step = position.step

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(position.epoch, args.epochs):
        train_sampler.set_epoch(epoch, 0 if restored else position.samples_done)  # STEP: restored: the loader skips
        seed_epoch(train_loader, args.seed, launch.rank, epoch)
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision,
                           position, checkpoints, stop)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")
    checkpoints.save(position, training_state(model, optimizer, scaler, train_loader))  # STEP
    print0(f"final weights in {checkpoints.save_final(model.module.state_dict())}")

    correct, seen = evaluate(model.module, test_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
