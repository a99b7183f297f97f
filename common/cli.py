"""The command-line flags every MNIST chapter script takes, with the reference hyper-parameters."""
import argparse
import sys


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text}")
    return value


def mnist_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose help text is the script's docstring, so --help shows how to launch it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data",
                        help="folder holding MNIST/raw/*-ubyte; downloaded there if missing (default: ./data)")
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="GLOBAL training batch, split evenly over the processes (default: 64)")
    parser.add_argument("--eval-batch-size", type=positive_int, default=1000,
                        help="PER-PROCESS evaluation batch; it does not change the result (default: 1000)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="autocast dtype; auto = bf16 where the hardware has it natively, else fp32")
    parser.add_argument("--loader", choices=["tensor", "classic"], default="tensor",
                        help="tensor: whole batches indexed from memory (fast); "
                             "classic: PIL + transforms per sample (the textbook path)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (classic loader)")
    parser.add_argument("--dist-timeout", type=float, default=300,
                        help="seconds a process waits for its peers before giving up (default: 300)")
    return parser


def per_process_batch(global_batch: int, world_size: int, flag: str = "--batch-size") -> int:
    """The batch each process loads, so that world_size of them add up to the global batch exactly."""
    if global_batch % world_size:
        sys.exit(f"error: {flag} {global_batch} is the global batch and must divide evenly over "
                 f"{world_size} processes; pick a multiple of {world_size}.")
    return global_batch // world_size
