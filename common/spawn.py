"""Start N processes on this machine, joined into a gloo process group, with a hard time limit.

For tests and benchmarks that need a real process group without a launcher. The rendezvous is a
TCPStore that this (the parent) process opens on a port the kernel picks, and the N processes connect
to: a port chosen first and bound later could be taken in between by another test's processes. Each
process gets the variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT: the store's, and OMP_NUM_THREADS=1), so code that reads them, such as
Accelerate, sees an ordinary launch.

The processes come from a fork server: one clean process (no threads, no process group) that imports
torch once and forks each of them from itself. Spawn would start a fresh interpreter each time, which
imports torch again (about 3 s of CPU a process). Like spawn, it is safe where the caller runs threads
(a Jupyter kernel). A forked process inherits the server's environment, from when it started, so each
is handed the caller's environment of the moment instead, as a spawned one would have read it. And a
process that multiprocessing started takes its starter's method as its own default: each is given the
platform's default back, so that a DataLoader in it starts its workers as under torchrun (by fork, on Linux
before Python 3.14), not through the fork server, which fails to take the dataset's tensors.
"""
import multiprocessing
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.distributed import exit_process

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "common.distributed"]  # what the fork server imports once


def _entry(rank, worker, world_size, port, result_path, environ, args):
    torch.set_num_threads(1)  # N processes share the machine's cores, as under torchrun
    multiprocessing.set_start_method(None, force=True)  # the platform's default, not the fork server
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))  # the parent's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = worker(rank, world_size, *args)
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()
    exit_process()  # a worker that used FSDP2 leaves the process group held: see exit_process


def run_in_process_group(worker, world_size: int, *args, timeout: float = 300):
    """Call worker(rank, world_size, *args) in world_size fresh processes; return rank 0's return value.

    An exception in any rank is raised here with that rank's traceback; a run that outlasts timeout
    seconds is killed and raises TimeoutError.
    """
    main = sys.modules["__main__"]
    if worker.__module__ == "__main__" and not hasattr(main, "__file__"):
        # a new process imports the worker by module and name; it can re-run a script's __main__ from
        # its file, but a notebook's or an interactive session's __main__ has none
        raise ValueError(f"{worker.__name__} is defined in a notebook (or an interactive session), and the "
                         f"processes run_in_process_group spawns cannot import it (in their stderr: Can't get "
                         f"attribute '{worker.__name__}' on <module '__main__'>): define it in a module and "
                         "import it from there, as common/lessons/notebook_workers.py does.")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound now, to a free port
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "rank0.pt"
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call in this process
        context = mp.start_processes(_entry, args=(worker, world_size, store.port, str(result_path), dict(os.environ), args),
                                     nprocs=world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{worker.__name__} on {world_size} processes did not finish within {timeout:g} s")
        return torch.load(result_path, weights_only=False)
