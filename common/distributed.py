"""Process-group set-up that works however a script was started.

torchrun (and `accelerate launch`, which runs torchrun) exports RANK, LOCAL_RANK and WORLD_SIZE.
SLURM's `srun` exports SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS instead. Plain `python`
exports neither: one process, and no process group is needed.
"""
import builtins
import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Launch:
    rank: int  # global: 0 .. world_size-1 across all nodes
    local_rank: int  # on this node: picks the GPU
    world_size: int
    launcher: str  # "torchrun", "slurm" or "python"


def detect_launch(environ=os.environ) -> Launch:
    """Read rank and world size from torchrun's variables, else SLURM's, else assume one process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return Launch(int(environ["RANK"]), int(environ.get("LOCAL_RANK", 0)), int(environ["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return Launch(int(environ["SLURM_PROCID"]), int(environ.get("SLURM_LOCALID", 0)), int(environ["SLURM_NTASKS"]), "slurm")
    return Launch(0, 0, 1, "python")


def require_launcher(script: str, environ=os.environ) -> Launch:
    """A multi-process script started with plain `python` gets one sentence saying how to start it."""
    launch = detect_launch(environ)
    if launch.launcher == "python":
        sys.exit(f"error: {script} runs one process per device and needs a launcher: "
                 f"torchrun --nproc_per_node=2 {script} (or srun under SLURM; see slurm/).")
    if launch.launcher == "slurm" and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        sys.exit(f"error: under srun without torchrun, export MASTER_ADDR (the first node) and MASTER_PORT "
                 f"(a free port) before starting {script}; slurm/ has job scripts that do.")
    return launch


def device_for(local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when there are GPUs, else the CPU.

    The local rank, never the global one: on the second of two 4-GPU nodes, global rank 5 is cuda:1.
    A process that sees a single GPU (srun --gpus-per-task=1 hides the others) uses that one.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        sys.exit(f"error: local rank {local_rank} but only {count} GPUs are visible on this node: "
                 f"start at most {count} processes per node (--nproc_per_node={count}).")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors; gloo moves CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(launch: Launch, device: torch.device, timeout_s: float) -> None:
    """dist.init_process_group with a timeout, so a peer that never arrives ends the run with a message."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:  # DistStoreError and DistNetworkError are RuntimeErrors
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        sys.exit(f"error: rank {launch.rank} could not join a process group of {launch.world_size} "
                 f"within {timeout_s:g} s ({first_line}); check that every process started and that "
                 f"MASTER_ADDR/MASTER_PORT point at rank 0.")


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print0(*args, force: bool = False, **kwargs) -> None:
    """print() on rank 0 only, so N processes do not print N copies; force=True prints on every rank."""
    if force:
        builtins.print(f"[rank {rank()}]", *args, **kwargs)
    elif rank() == 0:
        builtins.print(*args, **kwargs)


@contextlib.contextmanager
def main_process_first(local_rank: int):
    """Let local rank 0 download or prepare files while the others wait, then let them read the result."""
    waiting = dist.is_available() and dist.is_initialized()
    if waiting and local_rank != 0:
        dist.barrier()
    yield
    if waiting and local_rank == 0:
        dist.barrier()


def free_port() -> int:
    """A TCP port that nothing on this machine listens on now, for a single-machine rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
