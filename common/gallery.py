"""The set-up every program of the debugging gallery (src/ch4/debugging/) shares.

Each program plants one bug; `--fixed` runs its fixed twin. The process group's timeout is short
(10 s), so a program that hangs ends within seconds with a message instead of waiting 30 minutes.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from common.cli import gallery_parser
from common.distributed import Launch, backend_for, device_for, exit_if_peers_missing, require_launcher


def start(doc: str, script: str) -> tuple[argparse.Namespace, Launch, torch.device]:
    """Parse --fixed and --timeout, join the process group as the DDP rungs do; return the flags, the launch
    and the device."""
    args = gallery_parser(doc).parse_args()
    launch = require_launcher(script)
    device = device_for(launch)
    timeout = timedelta(seconds=args.timeout)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    with exit_if_peers_missing(launch, args.timeout):
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, device_id=device if device.type != "cpu" else None)
        dist.barrier(async_op=True).wait(timeout=timeout)
    return args, launch, device


def batches(device: torch.device, count: int = 4, size: int = 8, seed: int = 0):
    """A few batches of random inputs and labels for a 16-in, 4-class model; the seed picks the data."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=generator).to(device),
             torch.randint(0, 4, (size,), generator=generator).to(device)) for _ in range(count)]
