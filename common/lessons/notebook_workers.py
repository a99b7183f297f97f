"""What the "Inside DDP" notebooks run in every process of a gloo group (common.spawn.run_in_process_group).

A process that run_in_process_group starts (forked from a fork server, which is safe with threads, as a
Jupyter kernel has, where a plain fork is not) receives the function it is to run as a module and a name,
and imports it. A function defined in a notebook lives in the kernel's __main__, which it cannot import:
"Can't get attribute 'worker' on <module '__main__'>". Functions defined in a module, like these, can.
Each returns rank 0's view of what happened, small enough to print as a table.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons import accumulation, allreduce
from common.lessons.bucketing import BucketedDataParallel, linear_stack
from common.mnist import BasicNet

ALGORITHMS = {"reduce + broadcast": allreduce.reduce_broadcast_all_reduce,
              "all-to-all": allreduce.all_to_all_all_reduce, "ring": allreduce.ring_all_reduce}
COST_MODEL_NAMES = {"reduce + broadcast": "reduce_broadcast", "all-to-all": "all_to_all", "ring": "ring"}


def pass_to_the_right(rank: int, world_size: int) -> list[int]:
    """Point-to-point, one step of a ring: each rank sends its own rank number to its right neighbour
    and receives its left neighbour's. Returns what each rank received, in rank order."""
    mine, received = torch.tensor([float(rank)]), torch.empty(1)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, received, left)]):
        request.wait()  # both posted at once: two blocking sends to each other would wait for ever
    everyone = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(everyone, received)
    return [int(value.item()) for value in everyone]


def all_reduce_three_ways(rank: int, world_size: int, numel: int) -> list[tuple]:
    """Each hand-written all-reduce beside dist.all_reduce on the same random tensors:
    (algorithm, equal to gloo's result, MB the busiest rank sends by the cost model)."""
    generator = torch.Generator().manual_seed(rank)
    mine = torch.randn(numel, generator=generator)
    reference = mine.clone()
    dist.all_reduce(reference)
    rows = []
    for name, algorithm in ALGORITHMS.items():
        result = algorithm(mine.clone())
        sent = allreduce.bytes_sent_per_rank(COST_MODEL_NAMES[name], mine.numel() * mine.element_size(), world_size)
        rows.append((name, torch.allclose(result, reference, rtol=1e-5, atol=1e-5), sent / 2**20))
    return rows


def bucket_sweep(rank: int, world_size: int, caps_mb: list[float], layers: int, width: int) -> list[dict]:
    """For each bucket_cap_mb: the buckets our BucketedDataParallel makes, the buckets torch DDP makes
    after its first backward (it rebuilds them in the order the gradients arrived), and DDP's own
    timing of one step (its _get_ddp_logging_data(), in milliseconds)."""
    rows = []
    for cap in caps_mb:
        torch.manual_seed(0)
        ours = BucketedDataParallel(linear_stack(layers, width), bucket_cap_mb=cap)
        ddp = DDP(linear_stack(layers, width), bucket_cap_mb=cap)
        for model in (ours, ddp):
            for _ in range(3):
                model(torch.randn(16, width)).square().mean().backward()
                if model is ours:
                    ours.wait_for_gradients()
        logged = ddp._get_ddp_logging_data()
        rows.append({"bucket_cap_mb": cap, "our buckets": len(ours.buckets),
                     "DDP buckets before / after rebuild": f"{len(str(logged['bucket_sizes']).split(','))} / "
                                                          f"{len(str(logged['rebuilt_bucket_sizes']).split(','))}",
                     **{key: logged[f"avg_{key}_time"] / 1e6 for key in
                        ("forward_compute", "backward_compute", "backward_comm", "backward_compute_comm_overlap")}})
    return rows


def all_reduces_per_step(rank: int, world_size: int, micro_batches: int) -> dict[str, int]:
    """For each way to accumulate gradients (common/lessons/accumulation.py), the bucket all-reduces DDP
    makes in one optimizer step over `micro_batches` micro-batches of BasicNet."""
    counts = {}
    for name in ("sync_every_micro_batch", "no_sync_around_backward_only", "no_sync_around_forward_and_backward"):
        torch.manual_seed(0)
        model = DDP(BasicNet())
        counter = accumulation.count_all_reduces(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = [(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))) for _ in range(micro_batches)]
        for step in range(2):  # the first step lets DDP rebuild its buckets (one before, two after)
            counter["all_reduces"] = 0
            getattr(accumulation, name)(model, optimizer, batches)
        counts[name] = counter["all_reduces"]
    return counts
