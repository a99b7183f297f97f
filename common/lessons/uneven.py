"""Ranks with different numbers of batches: why DDP hangs, and how Join lets every rank finish.

DDP all-reduces the gradients in every backward, and an all-reduce needs every rank. If rank 0 has 5
batches and rank 1 has 4, rank 0's fifth backward waits for a partner that has left the loop: nothing
fails, nothing moves, until the process group's timeout ends it (30 minutes by default for gloo, 10
for NCCL). DistributedSampler avoids this by padding every rank to the same count; data that cannot
be padded (streams, sharded files, per-rank filtering) needs Join.

`with Join([model]):` around the loop lets a rank that runs out of batches stay in the collectives:
it "shadows" each all-reduce of the ranks still training with zeros, until all are done. DDP still
divides by the world size it started with, so a batch trained by fewer ranks counts proportionally
less. Accelerate offers the same as `accelerator.join_uneven_inputs([model], even_batches=False)`, with
two catches (accelerate 1.15, measured in benchmarks/uneven_inputs.py): it turns Join on only with
even_batches=False (by default Accelerate's loaders repeat samples so that batch counts match), and
only on GPUs and other accelerators: with CPU processes it warns and does nothing, so they hang.
"""
import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

HOW = ("plain DDP", "Join", "accelerate join_uneven_inputs")


def batches_for(rank: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0 gets one batch more than the others."""
    generator = torch.Generator().manual_seed(rank)
    count = batches + 1 if rank == 0 else batches
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
            for _ in range(count)]


def train_uneven(rank: int, world_size: int, how: str, batches: int, timeout_s: float) -> dict:
    """Train a linear model on this rank's batches, one of three ways; report how it ended."""
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))  # a short timeout, to show the hang end
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "accelerate join_uneven_inputs":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        joined = accelerator.join_uneven_inputs([model], even_batches=False)  # Join only if batches may be uneven
    else:
        model = DDP(model, process_group=group)
        joined = Join([model]) if how == "Join" else None
    data = batches_for(rank, batches)
    start = time.perf_counter()
    try:
        with joined or contextlib.nullcontext():
            for done, (inputs, labels) in enumerate(data):
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), labels).backward()
                optimizer.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(world_size)]
        dist.all_gather(everyone, weights, group=group)  # the end of the epoch: a collective, as in a script
    except RuntimeError as error:  # gloo: "Timed out waiting ...ms for recv operation to complete"
        return {"outcome": f"rank {rank} was stuck in the all-reduce of its batch {done + 1}, which the other ranks, "
                           f"out of batches after {batches}, never joined, until a timeout ended it ({timeout_s:g} s "
                           f"here; 30 minutes by default): DDP needs the same number of batches on every rank, or "
                           f"Join ({str(error).strip().splitlines()[0][-70:]})",
                "seconds": time.perf_counter() - start, "replicas equal": None}
    return {"outcome": "finished", "seconds": time.perf_counter() - start,
            "replicas equal": all(torch.equal(weights, other) for other in everyone)}
