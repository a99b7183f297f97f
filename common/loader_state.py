"""Each rank's DataLoader state in the checkpoint, and whether a resumed run can take it back.

torchdata's StatefulDataLoader.state_dict() says where one rank's loader is: how many batches it has
yielded this epoch (it fast-forwards the sampler by as many on resume), the base seed its workers got,
and each worker's own state, the dataset's state_dict() as that worker last sent it (here the worker's
generator, common/worker_seeds.py). It is one rank's and holds one entry a worker: it resumes the same
rank with the same number of workers, and nothing else. So every rank's is gathered to rank 0 for the
checkpoint, and a run at another world size or with another --num-workers goes on from the checkpoint's
global sample cursor instead (common/samplers.py), its workers' generators started afresh there: every
sample of the epoch once, but other augmentations than an uninterrupted run would have drawn.
"""
import sys
import warnings

import torch.distributed as dist

from common.distributed import print0, rank

try:
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401  (the rungs import it from here)
except ImportError as error:
    sys.exit(f"error: this rung needs torchdata's StatefulDataLoader, which this Python cannot import ({error}): "
             "pip install torchdata==0.11.0, or pip install -e '.[data]'.")

# torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.14 deprecates: one warning a process
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def gather_loader_states(loader) -> dict | None:
    """Every rank's loader state, on rank 0 (None on the others), with the number of workers a rank had."""
    state = loader.state_dict()
    if not dist.is_initialized():
        return {"num_workers": loader.num_workers, "ranks": [state]}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return {"num_workers": loader.num_workers, "ranks": gathered} if gathered else None


def restore_loader(loader, saved: dict, rank: int, world_size: int, cursor: bool = True) -> bool:
    """Give this rank's loader its state back where the checkpoint's ranks and workers are this run's.
    Otherwise say, once, why the run goes on from the global cursor instead; a stream (cursor=False) has no
    cursor to go on from, and the run ends in one sentence before it trains."""
    ranks, workers = len(saved["ranks"]), saved["num_workers"]
    if ranks == world_size and workers == loader.num_workers:
        loader.load_state_dict(saved["ranks"][rank])
        return True
    there = f"{counted(ranks, 'rank')} with {counted(workers, 'worker')} each"
    here = f"{counted(world_size, 'rank')} with {loader.num_workers}"
    if not cursor:
        refuse(f"error: the checkpoint holds the places in their shards of {there}, which do not carry over to "
               f"{here}; resume with --nproc_per_node={ranks} --num-workers {workers} (per node), and change them "
               "at an epoch's end.")
    print0(f"the loader states of {there} do not carry over to {here}: the epoch goes on from the checkpoint's "
           "sample cursor, every sample once, its workers' generators started afresh there, so its augmentations "
           "differ from the run's that never stopped", flush=True)
    return False


def counted(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"


def refuse(message: str) -> None:
    """End every rank with exit status 1 and `message` on stderr, written once: rank 0 writes it before the
    ranks part (every rank reaches the same check at the same point), so no rank's exit cuts it short."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()
    sys.exit(1)
