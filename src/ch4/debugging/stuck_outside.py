"""A hang: one rank stuck outside any collective while the others wait inside one.

Rank 0 wraps the model in DDP (a collective: it broadcasts the weights) and then writes a file that
the other ranks wait for before they wrap: each waits for the other, and nothing is printed until the
timeout ends rank 0 with gloo's "Timed out waiting ..." for a send or a receive, naming no rank. Stacks
say who waits for what: `dump_stacks_on_hang` (common/diagnose.py) prints each rank's stacks after a
few seconds; rank 0 is in DDP's constructor, rank 1 in `wait_for`. (`py-spy dump --pid` shows the
same from outside.) The fix (`--fixed`): `main_process_first` lets local rank 0 write the file first,
then the others read it, before anyone reaches a collective.

    torchrun --nproc_per_node=2 src/ch4/debugging/stuck_outside.py
    torchrun --nproc_per_node=2 src/ch4/debugging/stuck_outside.py --fixed
"""
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.diagnose import dump_stacks_on_hang
from common.distributed import main_process_first
from common.gallery import start


def wait_for(path: Path) -> str:
    """Poll for a file another rank writes (slow storage, a cache being built, a download)."""
    while not path.exists():
        time.sleep(0.1)
    return path.read_text()


def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/stuck_outside.py")
    vocabulary = Path(tempfile.gettempdir()) / f"vocabulary-{os.environ['MASTER_PORT']}.txt"  # one per run
    torch.manual_seed(0)
    with dump_stacks_on_hang(args.timeout / 2):
        if args.fixed:
            with main_process_first(launch.local_rank):
                if launch.local_rank == 0:
                    vocabulary.write_text("a b c")
                words = vocabulary.read_text()
            model = DDP(torch.nn.Linear(16, 4).to(device))
        elif launch.rank == 0:
            model = DDP(torch.nn.Linear(16, 4).to(device))
            vocabulary.write_text("a b c")  # the bug: written after a collective the others have not reached
            words = vocabulary.read_text()
        else:
            words = wait_for(vocabulary)
            model = DDP(torch.nn.Linear(16, 4).to(device))
    dist.barrier()
    if launch.local_rank == 0:
        vocabulary.unlink()
        print(f"every rank read {len(words.split())} words and wrapped a model of "
              f"{sum(p.numel() for p in model.parameters())} parameters")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
