"""MNIST, step 2 of 5: nn.DataParallel, one process driving every visible GPU.

Each forward pass copies the model to every GPU, scatters the batch across them, runs the replicas
in threads and gathers the outputs back on the first GPU, where the loss and backward start. One
line changes. It is also why DataParallel is slow: one Python process, a model copy every step, and
all outputs and gradients funnelled through GPU 0. DDP (step 3) fixes all three.

On a machine without GPUs DataParallel simply calls the module: this script then trains exactly as
step 1 does, which is what you see on a CPU.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    python src/ch4/mnist_2_data_parallel.py                          # all visible GPUs
    CUDA_VISIBLE_DEVICES=0,1 python src/ch4/mnist_2_data_parallel.py # choose GPUs without editing code

Lines marked `# STEP` are what this step changes in mnist_1_single.py.
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import RandomSampler, SequentialSampler

from common.cli import add_compile_flag, mnist_parser
from common.compile import compiled
from common.distributed import device_for, print0
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import Autocast, autocast, grad_scaler, resolve_precision


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
    args = add_compile_flag(mnist_parser(__doc__)).parse_args()

    device = device_for()
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed)

    train_set, test_set = load_mnist(args.data_dir, args.loader)
    batch_size = args.batch_size
    train_sampler = RandomSampler(train_set)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size, SequentialSampler(test_set), args.num_workers)

    model = BasicNet().to(device, memory_format=torch.channels_last)
    # STEP: replicate over all visible GPUs (on the CPU it just calls the module). Each replica runs in its own
    # STEP: thread, and autocast is per thread: Autocast enters it inside every replica's forward
    model = nn.DataParallel(Autocast(model, device, precision))  # STEP
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"one process, DataParallel over {torch.cuda.device_count()} GPU(s), {precision}, "  # STEP
           f"global batch {args.batch_size}")  # STEP
    train_seconds = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision)
        train_seconds += time.perf_counter() - start
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model, test_loader, device, precision)
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")


if __name__ == "__main__":
    main()
