"""The set-up every program of the debugging gallery (src/ch4/debugging/) shares.

Each program plants one bug; `--fixed` runs its fixed twin. The process group's timeout is short
(10 s), so a program that hangs ends within seconds with a message instead of waiting 30 minutes.
"""
import argparse

import torch

from common.distributed import Launch, device_for, init_process_group, require_launcher


def start(doc: str, script: str) -> tuple[argparse.Namespace, Launch, torch.device]:
    """Parse --fixed and --timeout, join the process group; return the flags, the launch and the device."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixed", action="store_true", help="run the fixed twin instead of the planted bug")
    parser.add_argument("--timeout", type=float, default=10,
                        help="seconds a collective waits for its peers before the run ends (default: 10)")
    args = parser.parse_args()
    launch = require_launcher(script)
    device = device_for(launch)
    init_process_group(launch, device, args.timeout)
    return args, launch, device


def batches(device: torch.device, count: int = 4, size: int = 8, seed: int = 0):
    """A few batches of random inputs and labels for a 16-in, 4-class model; the seed picks the data."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=generator).to(device),
             torch.randint(0, 4, (size,), generator=generator).to(device)) for _ in range(count)]
