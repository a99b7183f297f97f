"""A rank that died: rank 1 raises on a corrupt batch; the loud error is rank 0's.

Rank 1 stops; rank 0 waits in the gradient all-reduce for a partner that is gone, and its error
("Connection reset by peer", or the timeout) is what a reader sees first, though it is a consequence.
torchrun's summary names the "Root Cause (first observed failure)": the earliest failure in whole
seconds (a tie can name the consequence, so read every block), and with `@record` on main each
rank's exception and message, not only "exitcode: 1". The fix (`--fixed`): every rank checks
its batch, and the ranks agree (one all-reduce of a count) to skip a step where any batch is bad, so
all of them stay in step.

    torchrun --nproc_per_node=2 src/ch4/debugging/dead_rank.py
    torchrun --nproc_per_node=2 src/ch4/debugging/dead_rank.py --fixed
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from common.gallery import batches, start
from common.gather import sum_across_ranks


@record  # torchrun's summary shows this process's exception, not only its exit code
def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/dead_rank.py")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(device, seed=launch.rank)
    if launch.rank == 1:
        data[2][0][0, 0] = float("nan")  # a corrupt sample on rank 1
    steps = 0
    for step, (inputs, labels) in enumerate(data):
        if args.fixed:
            bad, = sum_across_ranks(int(not inputs.isfinite().all()), device=device)
            if bad:
                print(f"[rank {launch.rank}] step {step}: skipped, {bad} rank(s) had a corrupt batch")
                continue
        elif not inputs.isfinite().all():
            raise ValueError(f"rank {launch.rank}: batch {step} holds a non-finite input")
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        steps += 1
    if launch.rank == 0:
        print(f"trained {steps} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
