"""Run a function in N real processes joined into a gloo process group, with a hard time limit."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.distributed import free_port


def _entry(rank, worker, world_size, port, args):
    torch.set_num_threads(1)  # N processes share 2 cores
    # the variables torchrun would set, so that code reading them (Accelerate, common.distributed) sees a launch
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world_size: int, *args, timeout: float = 120) -> None:
    """Call worker(rank, world_size, *args) in world_size spawned processes; fail the test on hang or error.

    An exception in any rank is re-raised here with that rank's traceback.
    """
    context = mp.start_processes(_entry, args=(worker, world_size, free_port(), args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{worker.__name__} on {world_size} processes did not finish within {timeout:g} s")
