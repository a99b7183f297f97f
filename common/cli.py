"""Every flag a chapter script takes, and the global-to-per-process batch split.

The shared flags are in training_parser, mnist_parser and nli_parser; each chapter's own in an add_<chapter>_flags
group (the debugging gallery's in gallery_parser). What a flag needs to be declared lives here too (the hub's
default model, the compile backends), so that --help imports neither transformers, datasets, torchft nor lightning.
"""
import argparse
import os
import sys
from pathlib import Path

import torch

from common.distributed import detect_launch
from common.precision import AUTO_HELP

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")  # common/lessons/comm_hooks.py registers each
DEFAULT_MODEL = "bert-base-cased"
DEFAULT_DATASET = "nyu-mll/multi_nli"
BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile's, as common/compile.py runs them
STAGES = (0, 1, 2, 3)  # DeepSpeed's ZeRO stages (common/deepspeed_config.py)
DEFAULT_STAGE = 3
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # HSDP's --param-dtype: FSDP2's MixedPrecisionPolicy


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
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader worker processes per process; 0: the process loads its own batches (default: 0)")
    return parser


def nli_parser(doc: str, precision: bool = True, lr: float = 5e-5, max_steps: int | None = None):
    """The shared flags with this chapter's defaults (global batch 32, AdamW 5e-5, every step of --epochs),
    and the NLI ones; the minimal scripts pass their own lr and max_steps, so that --help prints them."""
    parser = training_parser(doc, batch_size=32, eval_batch_size=64, lr=lr, precision=precision)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"hub name or local folder with config, weights and tokenizer (default: {DEFAULT_MODEL})")
    parser.add_argument("--dataset", default=DEFAULT_DATASET,
                        help="hub name; a .jsonl/.json/.csv/.tsv/.parquet file; a folder of such files named after "
                             "their split (train.jsonl, validation_matched.jsonl; MultiNLI's multinli_1.0_*.jsonl "
                             "and GLUE's train.tsv, dev_matched.tsv too); or a folder from Dataset.save_to_disk "
                             f"(default: {DEFAULT_DATASET})")
    parser.add_argument("--eval-split", choices=["split", "validation_matched"], default="split",
                        help="split: hold out 10%% of train (train_test_split, seed 42); "
                             "validation_matched: the official matched validation set")
    parser.add_argument("--max-train-samples", type=positive_int, help="use only the first N training pairs")
    parser.add_argument("--max-eval-samples", type=positive_int, help="evaluate on the first N pairs only")
    parser.add_argument("--max-steps", type=positive_int, default=max_steps,
                        help="stop training after this many optimizer steps "
                             f"(default: {max_steps or 'every step of --epochs'})")
    parser.add_argument("--max-length", type=positive_int, default=128, help="truncate each pair to this many tokens")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0,
                        help="scale the gradient down to this total 2-norm when it is larger, the norm over the whole "
                             "model after averaging over the processes; fine-tuning customarily clips at 1.0, "
                             "inf turns clipping off (default: 1.0)")
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


def add_augment_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The resume chapter's random augmentation, drawn in the DataLoader's workers (common/augment.py)."""
    parser.add_argument("--augment", type=int, choices=range(8), default=0, metavar="PIXELS",
                        help="shift each training image by up to PIXELS rows and columns at random, the same shift "
                             "after a resume; 0 to 7, 0: no augmentation (default: 0)")
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


def add_compile_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--compile [BACKEND] (docs/compile.md); common/compile.py runs it."""
    parser.add_argument("--compile", nargs="?", const="inductor", choices=BACKENDS, metavar="BACKEND",
                        help="torch.compile the model with BACKEND: inductor (the default: generated, fused C++ or "
                             "Triton kernels; needs a C++ compiler), aot_eager (the same captured forward and backward "
                             "graphs, run by eager kernels: the lesson without the code generation), eager (the "
                             "captured forward only); without the flag the model runs eagerly")
    return parser


def add_hsdp_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HSDP rung's flags: the mesh's replicas, and the dtype FSDP2 computes in."""
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="R, the mesh's first dimension: R replicas of S = N/R shards each "
                             "(default: the number of nodes, WORLD_SIZE / LOCAL_WORLD_SIZE)")
    parser.add_argument("--param-dtype", choices=list(PARAM_DTYPES), default="fp32",
                        help="dtype FSDP2 all-gathers the parameters in and computes with; gradients are "
                             "reduced in fp32 into fp32 pieces (MixedPrecisionPolicy; default: fp32)")
    return parser


def add_deepspeed_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The DeepSpeed rungs' flags: the ZeRO stage, and a config file laid over the one the flags make."""
    parser.add_argument("--zero-stage", type=int, choices=STAGES, default=None,
                        help=f"ZeRO stage: 0 plain data parallelism, 1 optimizer state sharded, 2 + gradients, "
                             f"3 + parameters (default: the config file's, else {DEFAULT_STAGE})")
    parser.add_argument("--deepspeed-config", type=Path, default=None, metavar="JSON",
                        help="a DeepSpeed config whose keys are laid over the one the flags make")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher appends it; LOCAL_RANK says the same
    return parser


def add_nli_trainer_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """transformers.Trainer's rung (src/ch4/nli_trainer.py): a DeepSpeed config, and the Trainer's output folder."""
    parser.add_argument("--deepspeed", metavar="JSON", help="a DeepSpeed ZeRO config for the Trainer to train with")
    parser.add_argument("--output-dir", default="checkpoints/nli-trainer", help="the Trainer's output folder")
    return parser


def add_fault_tolerance_flags(parser: argparse.ArgumentParser, environ=os.environ) -> argparse.ArgumentParser:
    """Which replica group this is, where the lighthouse is, how long to wait for it, and what to write."""
    parser.add_argument("--max-steps", type=positive_int,
                        help="optimizer steps the job takes, counted by the quorum (default: --epochs epochs)")
    parser.add_argument("--group", type=int, default=int(environ.get("REPLICA_GROUP_ID", 0)),
                        help="this replica group's number, 0 .. --groups - 1 (default: $REPLICA_GROUP_ID, else 0)")
    parser.add_argument("--groups", type=positive_int, default=int(environ.get("NUM_REPLICA_GROUPS", 1)),
                        help="replica groups the training set is split over (default: $NUM_REPLICA_GROUPS, else 1)")
    parser.add_argument("--lighthouse", default=environ.get("TORCHFT_LIGHTHOUSE"),
                        help="the lighthouse's address, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE)")
    parser.add_argument("--quorum-timeout", type=positive_float, default=60,
                        help="seconds to reach the lighthouse, and to wait for a quorum of its --min_replicas groups "
                             "(default: 60)")
    parser.add_argument("--save", type=Path, help="write the trained weights (a state dict) to this file")
    parser.add_argument("--summary", type=Path, help="write the run's summary (JSON) to this file")
    parser.add_argument("--step-log", type=Path,
                        help="append one JSON line per step: time, group, step, participants, committed (the step moved on), "
                             "healed (not --log: torchrun takes that)")
    return parser


def devices_flag(text: str):
    """--devices: a positive whole number, or auto as Lightning reads it."""
    return text if text == "auto" else positive_int(text)


def add_lightning_flags(parser: argparse.ArgumentParser, environ=os.environ) -> argparse.ArgumentParser:
    """The Lightning rung's --devices and --num-nodes, with defaults read from torchrun's or srun's variables
    (common/lightning_launch.py checks them against the launch)."""
    launch = detect_launch(environ)
    launched = launch.launcher != "python"
    parser.add_argument("--devices", type=devices_flag, default=launch.local_world_size if launched else "auto",
                        help="processes per node: under torchrun or srun, what they started (the default); with "
                             "plain python, how many Lightning starts (auto: every GPU, or one CPU process)")
    parser.add_argument("--num-nodes", type=positive_int,
                        default=launch.world_size // launch.local_world_size if launched else 1,
                        help="nodes; under torchrun or srun, what they started (the default)")
    return parser


def gallery_parser(doc: str) -> argparse.ArgumentParser:
    """The debugging gallery's flags (src/ch4/debugging/): the fixed twin, and a short timeout, so that a program
    that hangs ends within seconds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixed", action="store_true", help="run the fixed twin instead of the planted bug")
    parser.add_argument("--timeout", type=float, default=10,
                        help="seconds a collective waits for its peers before the run ends (default: 10)")
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
