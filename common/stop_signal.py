"""Stop cleanly when the scheduler asks: save at a step every rank agrees on, then exit.

SLURM sends SIGTERM before it kills a preempted or requeued job (and SIGUSR1 ahead of the time limit
when the job asked for it with --signal); torchrun passes SIGTERM on to its workers. A handler that
saved right away would save at whatever step each rank happened to be in, and the signal reaches the
ranks at different moments. So the handler only sets a flag; at each step boundary one small
all-reduce (MAX) tells every rank whether any rank got a signal, and all stop at that same step.
That flag is a CPU tensor on a gloo group (common/flag_group.py).
The signal reaches a rank's DataLoader workers too: torchrun signals each rank's whole process group
(os.killpg). A DataLoader worker dies of SIGTERM (its loop installs a handler that reports it and
re-raises), and its rank's SIGCHLD handler then raises "DataLoader worker ... is killed by signal"
wherever the rank is, before it could save. leave_signals_to_the_rank, each worker's worker_init_fn (or
called from it), moves the worker into a process group of its own. A scheduler that signals every process
of a job (SLURM, where its process tracking is by cgroup) still reaches the workers.
"""
import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

from common.distributed import exit_process, print0
from common.flag_group import flag_group

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # prctl's option, from <linux/prctl.h>


def leave_signals_to_the_rank(worker_id: int | None = None) -> None:
    """In a DataLoader worker (its worker_init_fn): a process group of its own, out of reach of a signal sent to
    the rank's group. The worker still ends with its rank: the DataLoader shuts it down, multiprocessing
    terminates it as the rank exits, and on Linux the kernel kills it the moment its rank dies. That last one
    matters once the worker is out of the group: torchrun's SIGKILL after its grace period goes to the group,
    and a worker outliving a killed rank would hold the rank's sockets open, so the other ranks would wait on
    them until the worker's own check that its parent lives (every 5 s) ended it."""
    os.setpgrp()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class StopSignal:
    def __init__(self, signals=SIGNALS):
        self._received = received = [0]  # the signal this process got, 0 while none arrived
        self.signum = 0  # the signal some rank got, once the ranks have agreed on it

        def handle(signum, frame) -> None:
            received[0] = signum

        # A function, not a bound method: the signal module keeps its handler until the interpreter ends, and a
        # bound method would keep this object, and anything it came to hold (a process group would keep gloo's
        # threads running into the teardown: docs/traps.md), as long.
        for signum in signals:
            signal.signal(signum, handle)

    @property
    def received(self) -> int:
        return self._received[0]

    @received.setter
    def received(self, signum: int) -> None:
        self._received[0] = signum

    def agreed(self) -> bool:
        """True on every rank if any rank has received a signal. A collective: every rank calls it at each step."""
        flag = torch.tensor([self.received])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=flag_group())
        self.signum = int(flag.item())
        return self.signum != 0

    def exit(self, step: int) -> None:
        """End the process as the signal would have, 128 + its number, after a clean teardown."""
        print0(f"stopped by {signal.Signals(self.signum).name} at step {step}, after saving a checkpoint; "
               "the same command resumes from it", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        exit_process(128 + self.signum)  # not sys.exit: see exit_process (an FSDP2 run stops here too)
