"""The process group that a small CPU flag, agreed on by every rank each step, travels on.

A stop signal (common/stop_signal.py) and the end of a stream's epoch (common/stream.py) are one number per
rank, all-reduced at every step and read with .item(). On a CPU tensor over gloo that read waits for the
peers alone; a flag on the GPU would first wait for the GPU's queued work. So the flag takes the default
group where it is gloo, and beside NCCL one gloo group more, made once for the default group (a collective:
every rank makes it at the same call). That group is let go at exit, before the interpreter's teardown: a
group still held then would leave gloo's threads running into it (docs/traps.md).
"""
import atexit

import torch.distributed as dist

_made = {}  # the default group the gloo group was made for, and the gloo group


def flag_group():
    """The default group where it is gloo, else a gloo group beside it."""
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    if _made.get("for") is not world:  # the first call, or a new default group after destroy_process_group
        if not _made:
            atexit.register(_made.clear)
        _made.update({"for": world, "group": dist.new_group(backend="gloo")})
    return _made["group"]
