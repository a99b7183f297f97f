"""The fastest an MNIST training epoch can be on this CPU: FLOPs per epoch / the best fp32 FLOP rate.

FLOPs are counted by PyTorch (`torch.utils.flop_counter`) for one forward and backward pass of
`BasicNet`; the best rate is a large matmul on all of this process's threads, which is as close to
the CPU's peak as PyTorch gets. Compare the floor with the train time `mnist_speed.py` measures.

    python benchmarks/mnist_floor.py
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.mnist import BasicNet

TRAIN_IMAGES = 60_000


def train_flops_per_image(batch_size: int = 64) -> float:
    model = BasicNet()
    images, labels = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() / batch_size


def matmul_flop_rate(size: int = 2048, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-seconds", type=float, help="a measured epoch time, to show the rate it sustains")
    args = parser.parse_args()
    per_image = train_flops_per_image()
    epoch = per_image * TRAIN_IMAGES
    rate = matmul_flop_rate()
    print("| quantity | value |\n|---|---:|")
    print(f"| training FLOPs per image | {per_image / 1e6:.1f} M |")
    print(f"| training FLOPs per epoch ({TRAIN_IMAGES} images) | {epoch / 1e12:.2f} T |")
    print(f"| fp32 matmul rate, {torch.get_num_threads()} threads | {rate / 1e9:.0f} GFLOP/s |")
    print(f"| fastest possible fp32 epoch | {epoch / rate:.0f} s |")
    if args.train_seconds:
        print(f"| rate sustained by a {args.train_seconds:.1f} s epoch | {epoch / args.train_seconds / 1e9:.0f} GFLOP/s "
              f"({epoch / args.train_seconds / rate:.0%} of the matmul rate) |")


if __name__ == "__main__":
    main()
