"""MNIST with FSDP2 (`fully_shard`): the DDP training of mnist_3_ddp.py with the training state sharded.

DDP keeps the whole model, its gradients and AdamW's two moments on every rank. fully_shard keeps
1/N of each on rank r (ZeRO stage 3; common/lessons/zero.py writes the idea out): each parameter is cut along
its first dimension into N pieces, and a layer all-gathers its full parameters just before its forward
and again before its backward, and frees them after; backward reduce-scatters the gradients, so each
rank receives the average of its own piece only, and AdamW updates that piece. What changes from DDP:
  - the model is wrapped layer by layer (conv1, conv2, fc1, fc2), then as a whole: one all-gather per
    layer, so only one layer's parameters are ever held in full. fully_shard needs contiguous
    parameters: the model stays in the default memory format (the images stay channels_last);
  - fully_shard keeps rank r's piece of rank r's OWN copy, so with a seed per rank the model would
    start as a patchwork of N initializations (and buffers, which are not sharded, would differ).
    Rank 0's weights are broadcast first, as DDP does, so that both start from the same model;
  - evaluation must run the same forward passes on every rank, because every layer's forward is an
    all-gather all ranks join: DistributedSampler (which repeats a few images so that every rank gets
    as many) replaces DistributedEvalSampler, and each rank scores only the images before its repeats
    (they come last), so that every test image still counts exactly once.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    torchrun --nproc_per_node=2 src/ch4/sharded/mnist_fsdp.py       # 2 processes: 2 GPUs,
                                                                    # or 2 CPU processes (gloo)
    torchrun --nproc_per_node=gpu src/ch4/sharded/mnist_fsdp.py     # one process per visible GPU
On a CPU torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_compile_flag, mnist_parser, per_process_batch
from common.compile import compile_in_place
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
from common.samplers import DistributedEvalSampler


def train_epoch(model, loader, optimizer, scaler, device, precision):
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
    return loss_sum.item() / len(loader)


@torch.no_grad()
def evaluate(model, loader, device, precision, unpadded):  # STEP
    """Count correct predictions and images seen among this rank's first `unpadded` images."""  # STEP
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        keep = min(labels.numel(), unpadded - seen)  # STEP: DistributedSampler's repeats come last: skip them
        correct += (predictions[:keep] == labels[:keep]).sum().item()  # STEP
        seen += keep  # STEP
    return correct, seen


def main():
    args = add_compile_flag(mnist_parser(__doc__)).parse_args()

    launch = require_launcher("src/ch4/sharded/mnist_fsdp.py")  # STEP
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
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size,  # STEP: as many batches on every rank
                               DistributedSampler(test_set, shuffle=False), args.num_workers)  # STEP
    unpadded = len(DistributedEvalSampler(test_set))  # STEP: this rank's share before DistributedSampler's repeats

    model = BasicNet().to(device)  # STEP: fully_shard cannot shard channels_last (non-contiguous) weights
    for tensor in model.state_dict().values():  # STEP: shard rank 0's weights, not a patchwork of N
        dist.broadcast(tensor, src=0)  # STEP
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):  # STEP: one all-gather per layer, then freed
        fully_shard(layer)  # STEP
        compile_in_place(layer, args.compile)  # STEP: each block compiled alone; FSDP2's hooks run eagerly between them
    fully_shard(model)  # STEP: the root, which owns no parameters here; model.parameters() are now this rank's pieces
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    train_seconds = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision)
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model, test_loader, device, precision, unpadded)  # STEP: through FSDP, on every rank, the same batches
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()
    exit_process()  # STEP: FSDP2 holds the process group past its destruction: exit before the teardown races gloo


if __name__ == "__main__":
    main()
