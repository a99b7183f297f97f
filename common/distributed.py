"""Process-group set-up that works however a script was started.

torchrun (and `accelerate launch`, which runs torchrun) exports RANK, LOCAL_RANK and WORLD_SIZE.
SLURM's `srun` exports SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS instead. Plain `python`
exports neither: one process, and no process group is needed.
"""
import atexit
import builtins
import contextlib
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401  before any process group exists: see the note below
import torch.distributed as dist
from tqdm import tqdm

# Every torch.optim optimizer imports torch._dynamo when it is created. Imported after a process group
# exists, torch._dynamo holds references to it, so destroy_process_group() no longer stops gloo's
# worker threads; they run on while the interpreter shuts down, and one that frees the last reference
# to a tensor must take the GIL, is killed, and the process aborts ("terminate called without an
# active exception", about 1 run in 3 of benchmarks/bucketing_speed.py on torch 2.15). Importing it
# here, first, keeps destroy_process_group() a real teardown. tools/stress.py reruns the check.


@dataclass(frozen=True)
class Launch:
    rank: int  # global: 0 .. world_size-1 across all nodes
    local_rank: int  # on this node: picks the GPU
    world_size: int
    launcher: str  # "torchrun", "slurm" or "python"
    local_world_size: int = 1  # processes on this node


def detect_launch(environ=os.environ) -> Launch:
    """Read rank and world size from torchrun's variables, else SLURM's, else assume one process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        local_rank = int(environ.get("LOCAL_RANK", 0))
        return Launch(int(environ["RANK"]), local_rank, int(environ["WORLD_SIZE"]), "torchrun",
                      int(environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        local_rank = int(environ.get("SLURM_LOCALID", 0))
        return Launch(int(environ["SLURM_PROCID"]), local_rank, int(environ["SLURM_NTASKS"]), "slurm",
                      slurm_tasks_on_this_node(environ) or local_rank + 1)
    return Launch(0, 0, 1, "python")


def slurm_tasks_on_this_node(environ=os.environ) -> int | None:
    """This node's entry of SLURM's tasks-per-node list, which reads like "4(x2),2" (4, 4, then 2)."""
    listed = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not listed:
        return None
    counts = []
    for item in listed.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    node = int(environ.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else None


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


def accelerator_type() -> str | None:
    """"cuda", "xpu", "mps" (or another kind torch knows): the accelerator this process sees; None without one."""
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None


def accelerator_count(kind: str | None = None) -> int:
    """How many devices of this kind (the machine's accelerator by default) are visible: 0 without one."""
    kind = accelerator_type() if kind is None else kind
    return 0 if kind is None else torch.get_device_module(kind).device_count()


def pin_memory() -> bool:
    """Whether loaders should hand out page-locked batches: on CUDA and XPU a copy from pinned memory with
    non_blocking=True overlaps the compute; from pageable memory it is synchronous. MPS does not pin."""
    return accelerator_type() in ("cuda", "xpu")


def device_for(launch: Launch = Launch(0, 0, 1, "python"), gpu_count: int | None = None,
               environ=os.environ, kind: str | None = None) -> torch.device:
    """The accelerator at LOCAL_RANK (cuda:1, xpu:1) where there is one, else the CPU; one clear sentence
    when devices are too few. kind and gpu_count default to what this machine has.

    The local rank, never the global one: on the second of two 4-GPU nodes, global rank 5 is cuda:1.
    Two processes must not share a GPU (NCCL refuses: "Duplicate GPU detected"). The one exception:
    `srun --gpus-per-task=1` shows each task only its own GPU, as cuda:0. Apple's MPS device has no
    process-group backend, so only a process started without a launcher trains on it.
    """
    if kind is None:  # a gpu_count without a kind (the tests' imagined machines) means CUDA GPUs
        kind = accelerator_type() or ("cuda" if gpu_count else None)
    count = accelerator_count(kind) if gpu_count is None else gpu_count
    if kind is None or count == 0:
        return torch.device("cpu")
    if kind == "mps":
        if launch.launcher == "python":
            return torch.device("mps")
        if launch.rank == 0:
            print("note: no process-group backend moves MPS tensors, so these processes train on the CPU "
                  "with gloo; a single `python` process trains on the MPS device.", file=sys.stderr)
        return torch.device("cpu")
    if launch.launcher == "slurm" and count == 1 and environ.get("SLURM_GPUS_PER_TASK", "").split(":")[-1] == "1":
        return torch.device(kind, 0)
    if launch.local_world_size > count:
        sys.exit(f"error: {launch.local_world_size} processes on this node but {count} GPU(s) visible, and two "
                 f"processes cannot share a GPU: start {count} per node (torchrun --nproc_per_node={count}, "
                 f"accelerate launch --num_processes {count}, srun --gpus-per-task=1), or hide the GPUs with "
                 f"CUDA_VISIBLE_DEVICES= to train on the CPU.")
    return torch.device(kind, launch.local_rank)


def processes_for_this_machine(global_batch: int, gpu_count: int | None = None) -> int:
    """How many processes the demo, the benchmarks and the notebooks start: one per GPU (2 on a CPU), or
    fewer where that count does not divide the global batch (each process takes an equal share): the
    largest count that does, so 3 GPUs run 2 processes for a batch of 64, and 6 GPUs run 4."""
    available = (accelerator_count() if gpu_count is None else gpu_count) or 2
    return max(count for count in range(1, available + 1) if global_batch % count == 0)


def processes_note(processes: int, global_batch: int, gpu_count: int | None = None) -> str:
    """What processes_for_this_machine chose, in words, for the demo and benchmarks to print."""
    gpus = accelerator_count() if gpu_count is None else gpu_count
    where = f"of {gpus} GPU(s)" if gpus else "on the CPU"
    unused = f": the largest count that divides the global batch {global_batch}" if processes < (gpus or 2) else ""
    return f"{processes} processes {where}{unused}"


def backend_for(device: torch.device) -> str:
    """The process-group backend that moves this device's tensors: nccl for CUDA, xccl for XPU, gloo for
    the CPU, as torch's own table has it."""
    return dist.get_default_backend_for_device(device)


@contextlib.contextmanager
def exit_if_peers_missing(launch: Launch, timeout_s: float):
    """Around dist.init_process_group and the start-up barrier: a peer that never arrives ends the run in one
    sentence, not in a traceback on every rank.

    After the timeout torch raises a RuntimeError (DistStoreError from the rendezvous, DistBackendError from
    the barrier's Work.wait, which on NCCL too blocks and raises when given a timeout); this names the rank,
    the group's size and what to check. Rank 0 also warns where torchrun restarts workers into its shared
    store, where they can find dead peers' addresses (stale_store_hint).
    """
    try:
        yield
    except (RuntimeError, ValueError) as error:  # DistStoreError and DistNetworkError are RuntimeErrors
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        sys.exit(f"error: rank {launch.rank} could not join a process group of {launch.world_size} "
                 f"within {timeout_s:g} s ({first_line}); check that every process started and that "
                 f"MASTER_ADDR/MASTER_PORT point at rank 0.{stale_store_hint()}")
    if launch.rank == 0 and stale_store_hint():
        print(f"warning:{stale_store_hint()}", file=sys.stderr)


def stale_store_hint(environ=os.environ) -> str:
    """torchrun --max-restarts with its default shared store: restarted workers may connect to dead peers.

    Since torch 2.5 torchrun's c10d rendezvous lends its own TCPStore to the workers, and keeps it across
    restarts; the restarted workers find the addresses their killed predecessors wrote there and connect
    to ports nobody listens on any more (pytorch/pytorch#135712: a restart can fail this way).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set where torchrun starts, gives each restart a fresh store.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        return (" torchrun restarts workers into its shared store, where they can find their dead "
                "predecessors' addresses (pytorch#135712): start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.")
    return ""


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print0(*args, force: bool = False, **kwargs) -> None:
    """print() on rank 0 only, so N processes do not print N copies; force=True prints on every rank. An open
    tqdm progress bar is cleared first and drawn again below, so the line never shares the bar's line."""
    with tqdm.external_write_mode():
        if force:
            builtins.print(f"[rank {rank()}]", *args, **kwargs)
        elif rank() == 0:
            builtins.print(*args, **kwargs)


def processes(count: int) -> str:
    """"1 process", "2 processes": the banners' count of ranks, in English."""
    return f"{count} process" if count == 1 else f"{count} processes"


@contextlib.contextmanager
def main_process_first(local_rank: int):
    """Let local rank 0 download or prepare files while the others wait, then let them read the result.

    If local rank 0 stops instead (no dataset, say: it prints why), the others stop with a sentence
    pointing at its message rather than a traceback about a closed connection.
    """
    waiting = dist.is_available() and dist.is_initialized()
    if waiting and local_rank != 0:
        try:
            dist.barrier()
        except RuntimeError:
            sys.exit(f"error: rank {rank()} stopped because local rank 0 stopped while preparing the data; "
                     "its message above says why.")
    yield
    if waiting and local_rank == 0:
        dist.barrier()


def free_port() -> int:
    """A TCP port that nothing on this machine listens on now, for a rendezvous other machines must be told of
    before it opens (slurm/common.sh). Another process may take it before it is bound: on one machine, bind
    port 0 and keep the socket instead, as common/spawn.py's store does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_process(code: int = 0) -> None:
    """End this process now, its output flushed, without the interpreter's own teardown.

    For after destroy_process_group() where something still holds the process group: FSDP2's state
    does (torch 2.15: its parameter groups keep the device mesh, out of the garbage collector's reach),
    so gloo's worker threads outlive destroy_process_group(). The interpreter's teardown then races
    them: a worker that drops the last reference to a tensor must take the GIL, which a finalizing
    interpreter refuses by ending the thread, and the process aborts ("terminate called without an
    active exception", about one exit in ten; pytorch#179291 describes the mechanism). What a normal
    exit does before that teardown still happens: the atexit functions run, and the output is flushed.
    """
    atexit._run_exitfuncs()  # what sys.exit would run first; os._exit alone skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
