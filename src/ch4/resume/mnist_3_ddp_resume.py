"""MNIST, step 3 made restartable: DDP that is killed, comes back, and ends exactly as if it never stopped.

Jobs die: a node is preempted, a worker is OOM-killed, a SLURM job hits its time limit. This is
mnist_3_ddp.py with checkpoints a restarted job resumes from, bit for bit. What changes:
  - every --checkpoint-every optimizer steps all ranks save together: the weights, the optimizer's
    moments, the loss scaler, the position (epoch, samples done in it, step), and each rank's own
    random-number state (common/checkpoint.py gathers them to rank 0, which writes the file
    atomically and keeps the last two);
  - at start-up the newest checkpoint that loads is restored, or training starts from the beginning;
  - a resumed DDP rebuilds its gradient buckets before its first step, as the interrupted run had
    them (common/resume_buckets.py): at 3 or more processes, other buckets would round the sums otherwise;
  - the sampler's position is a global sample cursor (the samples of the epoch that all ranks
    together trained on): a resumed epoch continues with the next unseen global batch of the same
    shuffle, at the world size that stopped or at another that divides the global batch (each rank's
    random state is then reseeded: docs/resume.md), and the skipped samples are never loaded;
  - the loader gets its own random generator: iter(DataLoader) draws a seed from the global one, and
    that draw would shift every later dropout mask after a resume;
  - with --augment, the DataLoader's workers shift each image at random, by an amount drawn from
    (seed, epoch, index) rather than from the worker's own generator, so that a resumed run, whose
    workers start afresh mid-epoch, shifts every image as the uninterrupted run did (common/augment.py);
  - SIGTERM or SIGUSR1 (what torchrun and SLURM send before killing a job) stops all ranks at the same
    step, after a checkpoint;
  - the trained weights go to DIR/final.pt.

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        src/ch4/resume/mnist_3_ddp_resume.py --checkpoint-dir checkpoints/mnist
With --max-restarts torchrun restarts all workers when one dies, and they resume from the checkpoint;
the variable gives each restart a fresh rendezvous store (docs/resume.md). Rerun with another
--nproc_per_node and the run continues at that world size, with the same global batch.
Under SLURM, a job that requeues itself before its time limit: sbatch -N2 slurm/requeue.sbatch
src/ch4/resume/mnist_3_ddp_resume.py --checkpoint-dir checkpoints/mnist (see slurm/README.md).

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.augment import RandomShift
from common.checkpoint import Checkpoints, Position
from common.cli import add_augment_flag, add_checkpoint_flags, mnist_parser, per_process_batch
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.resume_buckets import rebuild_buckets
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler
from common.stop_signal import StopSignal, leave_signals_to_the_rank


def train_epoch(model, loader, optimizer, scaler, device, precision, position, checkpoints, stop):  # STEP
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        position.advance(loader.sampler.global_batch, len(loader.dataset))  # STEP: the samples all ranks trained on
        if stop.agreed() or checkpoints.due(position):  # STEP: one small all-reduce, on the CPU: all ranks stop at one step
            checkpoints.save(position, training_state(model, optimizer, scaler))  # STEP: every rank calls it
        if stop.signum:  # STEP
            stop.exit(position.step)  # STEP
    return loss_sum.item() / len(loader)


def training_state(model, optimizer, scaler) -> dict:  # STEP
    """What a checkpoint holds besides the position and each rank's random state."""  # STEP
    return {"model": model.module.state_dict(),  # STEP
            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}  # STEP


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
    args = add_augment_flag(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/mnist",  # STEP
                                                 every=200)).parse_args()  # STEP

    launch = require_launcher("src/ch4/resume/mnist_3_ddp_resume.py")  # STEP
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
    train_set = RandomShift(train_set, args.augment, seed=args.seed)  # STEP: in the workers; each sample's shift from (seed, epoch, index)
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)  # STEP: can start mid-epoch
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers, torch.Generator(),  # STEP: not the global RNG
                                worker_init_fn=leave_signals_to_the_rank)  # STEP: its workers get the stop signal too
    test_loader = mnist_loader(test_set, args.eval_batch_size, DistributedEvalSampler(test_set),
                               args.num_workers)

    model = BasicNet().to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)
    checkpoints = Checkpoints(args.checkpoint_dir, args.checkpoint_every, device=device,  # STEP: what must match to resume:
                              fingerprint={"global batch": args.batch_size,  # STEP
                                           "training images": len(train_set), "seed": args.seed,  # STEP
                                           "precision": precision, "augment": args.augment})  # STEP: only fp16 has a scaler state
    state = checkpoints.load_newest()  # STEP: None on a fresh start; this rank's random state back, or reseeded at another world size
    position = Position(**state["position"]) if state else Position()  # STEP
    checkpoints.exit_if_finished(position, position.epoch >= args.epochs, longer="a larger --epochs")  # STEP: a rerun of a finished run
    if state:  # STEP
        model.module.load_state_dict(state["model"])  # STEP
        optimizer.load_state_dict(state["optimizer"])  # STEP
        scaler.load_state_dict(state["scaler"])  # STEP
        rebuild_buckets(model, autocast(device, precision), torch.zeros(1, 1, 28, 28, device=device))  # STEP: reduce in the buckets the first run had by now
    stop = StopSignal()  # STEP: SIGTERM and SIGUSR1 only set a flag
    first_step = position.step  # STEP

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(position.epoch, args.epochs):  # STEP
        train_sampler.set_epoch(epoch, position.samples_done)  # STEP: the same shuffle, from the global cursor on
        train_set.set_epoch(epoch)  # STEP: the same shifts
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision,  # STEP
                           position, checkpoints, stop)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")
    checkpoints.save(position, training_state(model, optimizer, scaler))  # STEP: a later --epochs N continues from here
    print0(f"final weights in {checkpoints.save_final(model.module.state_dict())}")  # STEP

    correct, seen = evaluate(model.module, test_loader, device, precision)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "  # STEP: this run's
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")  # STEP
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
