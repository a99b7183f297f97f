"""Collectives for metrics: sum counts, gather tensors of different lengths, drop sampler padding.

Every rank must call these functions, in the same order: they are collectives.
"""
import torch
import torch.distributed as dist


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def sum_across_ranks(*values, device: torch.device | str) -> list:
    """Add Python numbers (counts, loss sums) over all ranks in one all-reduce; ints come back as ints.

    float64 holds integers exactly up to 2**53, so summed counts are exact. device has no default: it must
    be the one the process group moves (a CPU tensor on an NCCL group fails), the script's own.
    """
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    if _group_ready():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return [type(value)(total) for value, total in zip(values, totals.tolist())]


def gather_uneven(tensor: torch.Tensor, dst: int | None = None) -> torch.Tensor | None:
    """Concatenate each rank's tensor along dim 0, in rank order, when the lengths differ per rank.

    Collectives need equal shapes, so every rank pads to the longest length, the padded tensors are
    gathered, and the padding is cut off again. dst=None gives the result to every rank (all_gather);
    dst=k gives it to rank k and returns None elsewhere.
    """
    if not _group_ready():
        return tensor
    world_size = dist.get_world_size()
    length = torch.tensor([tensor.shape[0]], device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length)
    lengths = [int(n) for n in lengths]
    padded = tensor.new_zeros((max(lengths), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    if dst is None:
        pieces = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(pieces, padded)
    else:
        pieces = [torch.empty_like(padded) for _ in range(world_size)] if dist.get_rank() == dst else None
        dist.gather(padded, pieces, dst=dst)
        if pieces is None:
            return None
    return torch.cat([piece[:n] for piece, n in zip(pieces, lengths)])


def drop_sampler_padding(gathered: torch.Tensor, world_size: int, dataset_size: int) -> torch.Tensor:
    """Undo DistributedSampler's padding on results gathered in rank order.

    DistributedSampler pads its index list to a multiple of world_size and gives rank r positions
    r, r+N, r+2N, ...; the repeats sit at positions >= dataset_size. Interleaving the ranks' equal-length
    results restores position order, and the first dataset_size of them are each sample once
    (what Accelerate's gather_for_metrics does for its own sampler).
    """
    if gathered.shape[0] % world_size:
        raise ValueError(f"{gathered.shape[0]} results do not split into {world_size} equal per-rank parts: "
                         "were they produced by DistributedSampler?")
    per_rank = gathered.reshape(world_size, -1, *gathered.shape[1:])
    in_position_order = per_rank.transpose(0, 1).reshape(-1, *gathered.shape[1:])
    return in_position_order[:dataset_size]
