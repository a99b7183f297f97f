"""MNIST, step 4 of 5: the DDP training of step 3, with HuggingFace Accelerate doing the plumbing.

accelerator.prepare() does what step 3 wrote by hand: it picks the device, wraps the model in DDP,
shards the data loaders across processes and moves batches to the device. accelerator.backward()
replaces loss.backward() (and applies loss scaling for fp16), mixed precision comes from the launch
config where it names fp16 or bf16 (else from --precision, auto as in steps 1-3), and
gather_for_metrics() collects predictions from every rank and drops the samples that were repeated to give
all ranks equal batches, so the accuracy is over exactly the test set.
The same file runs unchanged on one CPU, one GPU, several GPUs or several CPU processes.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    python src/ch4/mnist_4_accelerate.py                                          # one process
    NGPU=$(python -c 'import torch; print(torch.cuda.device_count())')           # every GPU, fp16
    accelerate launch --config_file src/ch4/accelerate_configs/multi_gpu_fp16.yaml --num_processes $NGPU \\
        src/ch4/mnist_4_accelerate.py
    accelerate launch --config_file src/ch4/accelerate_configs/cpu_2_processes.yaml \\
        src/ch4/mnist_4_accelerate.py
    accelerate launch --multi_gpu --num_processes 2 src/ch4/mnist_4_accelerate.py  # no config file
Trap: `accelerate launch --cpu --num_processes 2` starts ONE process (--cpu picks the single-process
launcher). For N CPU processes launch with --multi_gpu on a machine without GPUs (the CPU config
above does that), or use torchrun. Flags such as --mixed_precision fp16 go before the script path.

Lines marked `# STEP` are what this step changes in mnist_3_ddp.py.
"""
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import RandomSampler, SequentialSampler

from common.cli import add_compile_flag, mnist_parser, per_process_batch
from common.compile import compiled
from common.distributed import detect_launch, device_for, print0, processes
from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import accelerate_mixed_precision


def train_epoch(model, loader, optimizer, accelerator, device):  # STEP
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        loss = F.nll_loss(model(images), labels)  # STEP: prepare() put autocast inside the model's forward
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)  # STEP: scales the loss for fp16, then runs backward
        optimizer.step()  # STEP
        loss_sum += loss.detach()
    return loss_sum.item() / len(loader)


@torch.no_grad()
def evaluate(model, loader, accelerator, device):  # STEP
    """Count correct predictions and images seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        predictions = model(images).argmax(dim=1)  # STEP
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))  # STEP: all ranks, repeats dropped
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main():
    args = add_compile_flag(mnist_parser(__doc__)).parse_args()

    # STEP: cpu=True without GPUs (else N processes would each train alone); device_for stops if GPUs are too few
    accelerator = Accelerator(cpu=device_for(detect_launch()).type == "cpu",  # STEP
                              mixed_precision=accelerate_mixed_precision(args.precision))  # STEP
    device = accelerator.device  # STEP
    torch.manual_seed(args.seed + accelerator.process_index)  # STEP: own dropout masks; prepare() syncs the weights

    train_set, test_set = load_mnist(args.data_dir, args.loader, accelerator.local_process_index)  # STEP
    batch_size = per_process_batch(args.batch_size, accelerator.num_processes)  # STEP
    train_sampler = RandomSampler(train_set)  # STEP: prepare() deals the batches out to the ranks
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size, SequentialSampler(test_set), args.num_workers)  # STEP

    model = BasicNet().to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader,  # STEP
                                                                      test_loader)  # STEP
    model = compiled(model, args.compile)  # STEP: after prepare(), which wrapped the model in DDP

    print0(f"{processes(accelerator.num_processes)} on {device.type}, {accelerator.mixed_precision}, "  # STEP
           f"global batch {args.batch_size} = {accelerator.num_processes} x {batch_size}")  # STEP
    train_seconds = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, accelerator, device)  # STEP
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / accelerator.num_processes  # STEP
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model, test_loader, accelerator, device)  # STEP
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    accelerator.end_training()  # STEP


if __name__ == "__main__":
    main()
