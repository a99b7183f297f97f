"""A hang: a collective that only rank 0 reaches (a logging helper under `if rank == 0`).

`average(loss)` all-reduces, so every rank must call it. Called inside `if launch.rank == 0:` it waits
for partners that went on: rank 1 is already in the next evaluation's all-reduce of the counts, so the
two ranks meet in different collectives. Gloo then aborts ("Received data size doesn't match expected
size"), waits until the timeout, or, where the sizes happen to match, adds a loss to a count and goes
on, silently wrong. TORCH_DISTRIBUTED_DEBUG=DETAIL checks a fingerprint of every collective first and
names both sides. The fix (`--fixed`): every rank calls the collective; only the print is on rank 0.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 src/ch4/debugging/rank0_collective.py
    torchrun --nproc_per_node=2 src/ch4/debugging/rank0_collective.py --fixed
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.gallery import batches, start
from common.gather import sum_across_ranks


def average(value: torch.Tensor) -> float:
    """The mean of a value over all ranks: a collective."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/rank0_collective.py")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(device)
    for epoch, (inputs, labels) in enumerate(batches(device, seed=launch.rank)):  # one evaluation per epoch
        with torch.no_grad():
            outputs = model(inputs)
        loss = F.cross_entropy(outputs, labels)
        correct, seen = sum_across_ranks(int((outputs.argmax(1) == labels).sum()), len(labels), device=device)
        if args.fixed:
            mean = average(loss)  # every rank
            if launch.rank == 0:
                print(f"epoch {epoch}: accuracy {correct}/{seen}, loss {mean:.4f}")
        elif launch.rank == 0:
            print(f"epoch {epoch}: accuracy {correct}/{seen}, loss {average(loss):.4f}")  # the bug: rank 0 alone
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
