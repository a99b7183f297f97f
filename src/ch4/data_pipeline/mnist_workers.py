"""MNIST, the resumable DDP rung with its augmentation drawn in the DataLoader's workers, from each worker's own generator.

Real input pipelines augment in `num_workers` DataLoader processes per rank, and draw from the generator
they find there. resume/mnist_3_ddp_resume.py derives each image's shift from (seed, epoch, index) so that
nothing depends on the workers; this rung lets each worker draw, as most code does, and makes that exact:
  - the loader's generator is seeded from (seed, rank, epoch) before each epoch's iter(): the base seed it
    draws there differs per rank and per epoch, worker w seeds itself with base + w, and worker_init_fn
    (common/worker_seeds.py) makes the worker's generator from that seed. Every worker of every rank
    draws its own shifts, and a rerun draws them again. (A generator made in the dataset's __init__ is
    copied into every worker and every rank: tests/test_data_pipeline.py shows the repeats);
  - the workers are not persistent: each epoch's workers start from that epoch's seeds;
  - a resumed epoch starts its loader at the epoch's first batch and lets the workers load and augment
    the batches the checkpoint already trained on, which the loop throws away: each worker's generator
    is then where it was when the run was killed, and the run goes on bitwise as if it never stopped.
    The price is the replay (here MNIST from memory: milliseconds a batch; a real pipeline decodes
    each sample again), which mnist_stateful.py removes.

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        src/ch4/data_pipeline/mnist_workers.py --num-workers 2 --augment 2 --checkpoint-dir checkpoints/workers

Lines marked `# STEP` are what this step changes in resume/mnist_3_ddp_resume.py.
"""
import itertools
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

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
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.resume_buckets import rebuild_buckets
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler
from common.stop_signal import StopSignal
from common.worker_seeds import WorkerShift, seed_epoch, seed_worker, warn_if_oversubscribed


def train_epoch(model, loader, optimizer, scaler, device, precision, position, checkpoints, stop, replay):  # STEP
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in itertools.islice(loader, replay, None):  # STEP: the workers load the first `replay` batches again
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
            checkpoints.save(position, training_state(model, optimizer, scaler))
        if stop.signum:
            stop.exit(position.step)
    return loss_sum.item() / (len(loader) - replay)  # STEP: the batches trained on


def training_state(model, optimizer, scaler) -> dict:
    """What a checkpoint holds besides the position and each rank's random state."""
    return {"model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}


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
    args = add_augment_flag(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/workers",  # STEP
                                                 every=200)).parse_args()

    launch = require_launcher("src/ch4/data_pipeline/mnist_workers.py")  # STEP
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
    warn_if_oversubscribed(args.num_workers, launch.local_world_size)  # STEP: workers need cores too
    train_set = WorkerShift(train_set, args.augment)  # STEP: each shift drawn from the generator of the worker that loads it
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)
    train_loader = DataLoader(  # STEP: not persistent: each epoch's workers start from that epoch's seeds
        train_set, batch_size, sampler=train_sampler, collate_fn=train_set.collate,  # STEP
        num_workers=args.num_workers, worker_init_fn=seed_worker,  # STEP: each worker's own generator
        generator=torch.Generator(), pin_memory=pin_memory())  # STEP: seeded per epoch below
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
    first_step = position.step

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(position.epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # STEP: the same shuffle, from its first batch
        seed_epoch(train_loader, args.seed, launch.rank, epoch)  # STEP: this rank's workers' seeds for this epoch
        replay = position.samples_done // train_sampler.global_batch  # STEP: batches this epoch already trained on
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision,
                           position, checkpoints, stop, replay)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")
    checkpoints.save(position, training_state(model, optimizer, scaler))
    print0(f"final weights in {checkpoints.save_final(model.module.state_dict())}")

    correct, seen = evaluate(model.module, test_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
