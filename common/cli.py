"""The command-line flags the chapter scripts share, and the global-to-per-process batch split."""
import argparse
import sys

from common.precision import AUTO_HELP

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")  # common/lessons/comm_hooks.py registers each


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text}")
    return value


def momentum(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {text}")
    return value


def training_parser(doc: str, batch_size: int, eval_batch_size: int, lr: float,
                    precision: bool = True) -> argparse.ArgumentParser:
    """The flags every chapter script shares; its help text is the script's docstring, so --help shows
    how to launch it. Defaults that differ between chapters (batch sizes, learning rate) are arguments;
    precision=False leaves out --precision, for scripts that train in fp32 only."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help=f"GLOBAL training batch, split evenly over the processes (default: {batch_size})")
    parser.add_argument("--eval-batch-size", type=positive_int, default=eval_batch_size,
                        help=f"PER-PROCESS evaluation batch; it does not change the result (default: {eval_batch_size})")
    parser.add_argument("--lr", type=float, default=lr, help=f"learning rate (default: {lr:g})")
    parser.add_argument("--seed", type=int, default=0)
    if precision:
        parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help=AUTO_HELP)
    parser.add_argument("--dist-timeout", type=float, default=300,
                        help="seconds a process waits for its peers before giving up (default: 300)")
    return parser


def mnist_parser(doc: str) -> argparse.ArgumentParser:
    """The MNIST chapter's flags, with the reference hyper-parameters (AdamW 1e-3, global batch 64)."""
    parser = training_parser(doc, batch_size=64, eval_batch_size=1000, lr=1e-3)
    parser.add_argument("--data-dir", default="data",
                        help="folder holding MNIST/raw/*-ubyte; downloaded there if missing (default: ./data)")
    parser.add_argument("--loader", choices=["tensor", "classic"], default="tensor",
                        help="tensor: whole batches indexed from memory (fast); "
                             "classic: PIL + transforms per sample (the textbook path)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (classic loader)")
    return parser


def add_checkpoint_flags(parser: argparse.ArgumentParser, folder: str, every: int) -> argparse.ArgumentParser:
    """The resume chapter's flags: where checkpoints go and how often (in optimizer steps)."""
    parser.add_argument("--checkpoint-dir", default=folder,
                        help="folder for checkpoints, on a filesystem every node sees; a run resumes from the "
                             "newest good one there, and writes the trained weights to DIR/final.pt "
                             f"(default: {folder})")
    parser.add_argument("--checkpoint-every", type=positive_int, default=every,
                        help=f"optimizer steps between checkpoints (default: {every})")
    return parser


def add_comm_hook_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The compression rung's flags: which DDP communication hook, and PowerSGD's rank."""
    parser.add_argument("--comm-hook", choices=COMM_HOOKS, default="none",
                        help="none: fp32 gradients as DDP sends them; fp16, bf16: cast to 16 bits; powersgd: "
                             "low-rank factors of each weight's gradient (default: none)")
    parser.add_argument("--powersgd-rank", type=positive_int, default=1,
                        help="PowerSGD's rank r: r(n+m) numbers per n×m gradient instead of n·m (default: 1)")
    return parser


def add_local_sgd_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The DiLoCo rung's flags: how often the replicas meet, and the outer optimizer."""
    parser.add_argument("--sync-every", type=positive_int, default=8,
                        help="inner steps between synchronisations, H (default: 8)")
    parser.add_argument("--outer-lr", type=positive_float, default=0.7,
                        help="outer SGD's learning rate; 1 with --outer-momentum 0 is local SGD (default: 0.7)")
    parser.add_argument("--outer-momentum", type=momentum, default=0.9,
                        help="outer SGD's Nesterov momentum, in [0, 1); 0: plain SGD (default: 0.9)")
    return parser


def per_process_batch(global_batch: int, world_size: int, flag: str = "--batch-size") -> int:
    """The batch each process loads, so that world_size of them add up to the global batch exactly."""
    if global_batch % world_size:
        sys.exit(f"error: {flag} {global_batch} is the global batch and must divide evenly over "
                 f"{world_size} processes; pick a multiple of {world_size}, or (to resume a checkpoint, which "
                 f"keeps its global batch) a number of processes that divides {global_batch}.")
    return global_batch // world_size


def mesh_shape(replicas: int | None, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicas, shards) of a 2-D device mesh over world_size processes; by default one replica per node
    (torchrun starts local_world_size processes on each), so that each node shards the model over its own GPUs."""
    replicas = replicas or max(world_size // local_world_size, 1)
    if world_size % replicas:
        sys.exit(f"error: --replicas {replicas} must divide the {world_size} processes into equal shard groups; "
                 f"pick a divisor of {world_size} (by default one replica per node).")
    return replicas, world_size // replicas
