"""MNIST with FSDP2 made restartable: sharded checkpoints, written by every rank with
torch.distributed.checkpoint.

mnist_3_ddp_resume.py is the resume lesson for DDP, where every rank holds the whole model and rank 0
writes one file with model.module.state_dict(). Under fully_shard no rank holds the whole model or
the whole optimizer state, so the checkpoint is sharded too. What changes from mnist_fsdp.py:
  - the state to save comes from get_state_dict(model, optimizer) (torch.distributed.checkpoint.state_dict):
    the model's and AdamW's state dicts under the parameters' names, each tensor a DTensor that is
    this rank's piece; dcp.save has every rank write its own pieces into DIR/step-N/ (through
    step-N.tmp/, renamed when complete), with rank 0 adding the position, world size, run fingerprint
    and every rank's random state (common/sharded_checkpoint.py, on top of common/checkpoint.py);
  - to resume, get_state_dict builds the same dicts for this run, dcp.load fills them in place (each
    rank reads its own pieces) and set_state_dict puts them into the sharded model and AdamW;
  - the rest is mnist_3_ddp_resume.py's: the position (epoch, samples done, step), the resumable
    sampler, the loader's own generator, --augment's shifts, SIGTERM/SIGUSR1 stopping all ranks at one step;
  - the trained weights go to DIR/final.pt as one full state dict, gathered to rank 0's CPU
    (get_model_state_dict with full_state_dict=True, cpu_offload=True), loadable into BasicNet.

Run from the repository root; a rerun of the same command resumes from the newest checkpoint:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
        src/ch4/resume/mnist_fsdp_resume.py --checkpoint-dir checkpoints/mnist-fsdp
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=gpu --max-restarts=3 \\
        src/ch4/resume/mnist_fsdp_resume.py --checkpoint-dir checkpoints/mnist-fsdp
With --max-restarts torchrun restarts all workers when one dies, and they resume from the checkpoint
(docs/resume.md, "Sharded checkpoints (FSDP2)"). Rerun with another --nproc_per_node and dcp.load
reshards the pieces to the new world size (docs/resume.md).
On a CPU torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_fsdp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

from common.augment import RandomShift
from common.checkpoint import Position
from common.cli import add_augment_flag, add_checkpoint_flags, mnist_parser, per_process_batch
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
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler
from common.sharded_checkpoint import ShardedCheckpoints
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
            checkpoints.save(position, training_state(model, optimizer, scaler))  # STEP: every rank writes its pieces
        if stop.signum:  # STEP
            stop.exit(position.step)  # STEP
    return loss_sum.item() / len(loader)


def training_state(model, optimizer, scaler) -> dict:  # STEP
    """What a checkpoint holds besides the position and each rank's random state: sharded, as the model is."""  # STEP
    model_state, optimizer_state = get_state_dict(model, optimizer)  # STEP: DTensors, this rank's pieces, under full names
    return {"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict()}  # STEP


@torch.no_grad()
def evaluate(model, loader, device, precision, unpadded):
    """Count correct predictions and images seen among this rank's first `unpadded` images."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        keep = min(labels.numel(), unpadded - seen)
        correct += (predictions[:keep] == labels[:keep]).sum().item()
        seen += keep
    return correct, seen


def main():
    args = add_augment_flag(add_checkpoint_flags(mnist_parser(__doc__), "checkpoints/mnist-fsdp",  # STEP
                                                 every=200)).parse_args()  # STEP

    launch = require_launcher("src/ch4/resume/mnist_fsdp_resume.py")  # STEP
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
    test_loader = mnist_loader(test_set, args.eval_batch_size,
                               DistributedSampler(test_set, shuffle=False), args.num_workers)
    unpadded = len(DistributedEvalSampler(test_set))

    model = BasicNet().to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)
    checkpoints = ShardedCheckpoints(args.checkpoint_dir, args.checkpoint_every, device=device,  # STEP: what must match to resume:
                                     fingerprint={"global batch": args.batch_size,  # STEP
                                                  "training images": len(train_set), "seed": args.seed,  # STEP
                                                  "precision": precision, "augment": args.augment})  # STEP: only fp16 has a scaler state
    state = checkpoints.load_newest(lambda: training_state(model, optimizer, scaler))  # STEP: dcp.load fills this run's dicts in place
    position = Position(**state["position"]) if state else Position()  # STEP
    checkpoints.exit_if_finished(position, position.epoch >= args.epochs, longer="a larger --epochs")  # STEP: a rerun of a finished run
    if state:  # STEP
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])  # STEP
        scaler.load_state_dict(state["scaler"])  # STEP
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
    full_weights = get_model_state_dict(model,  # STEP: on rank 0's CPU, {} elsewhere
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # STEP
    print0(f"final weights in {checkpoints.save_final(full_weights)}")  # STEP

    correct, seen = evaluate(model, test_loader, device, precision, unpadded)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, "  # STEP: this run's
           f"{(position.step - first_step) * args.batch_size / max(train_seconds, 1e-9):.0f} samples/s")  # STEP
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()
    exit_process()


if __name__ == "__main__":
    main()
