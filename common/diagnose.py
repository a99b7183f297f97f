"""Two small tools for a distributed run that hangs or goes silently wrong (docs/debugging.md).

`check_replicas(module)`: every rank should hold the same weights after each step; a parameter or
buffer changed on one rank (BatchNorm statistics, a rank-dependent initialisation, an edit after the
DDP wrap) makes the replicas drift apart while the loss still falls. The check names the first tensor
that differs and the ranks whose copy differs from rank 0's.

`dump_stacks_on_hang(seconds)`: a rank stuck in a collective, or outside one while the others wait,
prints nothing. Around a step, this prints each rank's Python stacks once the step has taken too long.
"""
import contextlib
import faulthandler
import hashlib
import sys
import tempfile
import threading

import torch
import torch.distributed as dist

from common.distributed import detect_launch


class ReplicaMismatch(RuntimeError):
    """The ranks' copies of a model differ."""


def fingerprint(tensor: torch.Tensor) -> str:
    """A hash of the tensor's bytes: equal only if every element is bitwise equal (NaNs included)."""
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


def check_replicas(module: torch.nn.Module, group=None) -> None:
    """Raise ReplicaMismatch on every rank if any parameter or buffer differs from rank 0's copy.

    A collective: every rank of the group must call it at the same point. It costs one copy of the
    model to host memory, a hash of its bytes and one all_gather of a short list per rank (about
    as long as a forward pass for a small model): call it once after wrapping, every few hundred
    steps and before saving a checkpoint, not every step.
    """
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    mine = [(name, tuple(t.shape), str(t.dtype), fingerprint(t))
            for name, t in [*inner.named_parameters(), *inner.named_buffers()]]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    differing = [index for index, entry in enumerate(reference)
                 if any(index >= len(theirs) or theirs[index] != entry for theirs in everyone)]
    if differing:
        first = differing[0]
        ranks = [rank for rank, theirs in enumerate(everyone) if first >= len(theirs) or theirs[first] != reference[first]]
        raise ReplicaMismatch(
            f"replicas differ: {reference[first][0]} on rank {', '.join(map(str, ranks))} differs from rank 0's "
            f"copy ({len(differing)} of {len(reference)} parameters and buffers differ); a parameter or buffer "
            "was changed on some ranks only (see docs/debugging.md)")
    if any(len(theirs) != len(reference) for theirs in everyone):
        counts = ", ".join(f"rank {rank}: {len(theirs)}" for rank, theirs in enumerate(everyone))
        raise ReplicaMismatch(f"replicas differ in their number of parameters and buffers ({counts})")


@contextlib.contextmanager
def dump_stacks_on_hang(seconds: float, file=None):
    """If the block has not finished after `seconds`, print this rank's Python stacks (every thread).

    A watchdog thread writes a header naming the rank, then faulthandler's dump of every thread; the
    block goes on (it may yet finish). Disarmed when the block ends, silently. A call into C that holds
    the GIL also stops the watchdog: py-spy dump reads the stacks from outside (docs/debugging.md).
    """
    out = file or sys.stderr
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else detect_launch().rank

    def dump():
        # faulthandler writes line by line: into a file of its own first, then one write, so that the
        # ranks dumping at the same moment into torchrun's shared stderr do not interleave their lines
        with tempfile.TemporaryFile("w+") as stacks:
            faulthandler.dump_traceback(file=stacks, all_threads=True)
            stacks.seek(0)
            out.write(f"[rank {rank}] still inside the block after {seconds:g} s; Python stacks of every "
                      f"thread, most recent call first:\n{stacks.read()}")
        out.flush()

    watchdog = threading.Timer(seconds, dump)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
