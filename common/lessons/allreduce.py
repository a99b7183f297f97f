"""All-reduce three ways, from point-to-point sends and receives alone.

After an all-reduce every rank holds the element-wise sum (or mean) of all ranks' tensors. How the
bytes travel decides the cost. With N ranks and S bytes per tensor, bytes sent by the busiest rank:
  reduce + broadcast   (N-1)·S at the root: it receives every tensor, then sends the sum to everyone
  all-to-all           (N-1)·S at every rank: each sends its whole tensor to each of the others
  ring                 2(N-1)/N·S at every rank: nearly flat in N, which is why NCCL and gloo use it
Each function works in place, like dist.all_reduce, for any tensor size, layout and world size,
with op 'sum' or 'avg'. The ring's chunk schedule is a function of its own, ring_schedule, which the
figure figures/ring_allreduce.py draws; recording_sends() lists the messages a rank sends, which
figures/allreduce_algorithms.py draws and the tests check against the cost model.
"""
import contextlib
import functools

import torch
import torch.distributed as dist

OPS = ("sum", "avg")


def _in_place(summing):
    """Give a summing algorithm dist.all_reduce's contract: in place, any layout, sum or average."""
    @functools.wraps(summing)
    def all_reduce(tensor: torch.Tensor, op: str = "sum", **options) -> torch.Tensor:
        if op not in OPS:  # checked before any message is sent, so no peer is left waiting
            raise ValueError(f"op must be one of {OPS}, not {op!r}")
        contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()  # send/recv need contiguous memory
        summing(contiguous, **options)
        if contiguous is not tensor:
            tensor.copy_(contiguous)
        if op == "avg":
            tensor.div_(dist.get_world_size())
        return tensor
    return all_reduce


_sent: list[list[tuple[int, int]]] | None = None  # while recording: one list of (peer, bytes) per exchange


@contextlib.contextmanager
def recording_sends():
    """Within the block, list what this rank sends: one list of (destination, bytes) per exchange round."""
    global _sent
    _sent = []
    try:
        yield _sent
    finally:
        _sent = None


def _exchange(sends=(), receives=()) -> None:
    """Post sends [(tensor, peer)] and receives [(buffer, peer)] at once, then wait for all of them.

    batch_isend_irecv hands the whole set to the backend together: NCCL can deadlock on separate
    isend/irecv calls to the same peer, gloo simply issues each one.
    """
    if _sent is not None:
        _sent.append([(peer, tensor.numel() * tensor.element_size()) for tensor, peer in sends])
    ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, peer) for buffer, peer in receives]
    if not ops:  # one rank alone: batch_isend_irecv refuses an empty list
        return
    for request in dist.batch_isend_irecv(ops):
        request.wait()


@_in_place
def reduce_broadcast_all_reduce(tensor: torch.Tensor) -> None:
    """Every rank sends its tensor to rank 0, which adds them up in rank order and sends the sum back."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        received = [torch.empty_like(tensor) for _ in range(world_size - 1)]
        _exchange(receives=[(buffer, src) for src, buffer in enumerate(received, start=1)])
        for buffer in received:
            tensor.add_(buffer)
        _exchange(sends=[(tensor, dst) for dst in range(1, world_size)])
    else:
        _exchange(sends=[(tensor, 0)])
        _exchange(receives=[(tensor, 0)])


@_in_place
def all_to_all_all_reduce(tensor: torch.Tensor) -> None:
    """Every rank sends its whole tensor to every other rank and adds up what it receives.

    Each rank sums in rank order 0..N-1, so all ranks end with bit-identical results.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    pieces = [tensor if peer == rank else torch.empty_like(tensor) for peer in range(world_size)]
    others = [peer for peer in range(world_size) if peer != rank]
    _exchange(sends=[(tensor, peer) for peer in others], receives=[(pieces[peer], peer) for peer in others])
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total.add_(piece)
    tensor.copy_(total)


def ring_schedule(rank: int, world_size: int):
    """The ring's 2(N-1) steps for one rank: (phase, step, chunk it sends right, chunk it receives from the left).

    In step s of the reduce-scatter, rank r sends chunk (r - s) to its right neighbour and adds the
    chunk (r - s - 1) it receives from its left one; after N-1 steps rank r holds the full sum of
    chunk (r + 1). The all-gather then passes the finished chunks around the ring for N-1 more steps,
    each rank overwriting the chunk it receives.
    """
    for step in range(world_size - 1):
        yield "reduce-scatter", step, (rank - step) % world_size, (rank - step - 1) % world_size
    for step in range(world_size - 1):
        yield "all-gather", step, (rank + 1 - step) % world_size, (rank - step) % world_size


@_in_place
def ring_all_reduce(tensor: torch.Tensor, after_step=None) -> None:
    """Reduce-scatter then all-gather around a ring, one chunk per step, each step send and receive at once.

    The tensor is cut into N chunks (sizes differ by at most one element) and moved as ring_schedule
    says. after_step(phase, step, sent, received, chunks), if given, sees this rank's chunks after each step.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return
    chunks = list(tensor.view(-1).tensor_split(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the largest
    for phase, step, send, receive in ring_schedule(rank, world_size):
        if phase == "reduce-scatter":
            buffer = incoming[: chunks[receive].numel()]
            _exchange(sends=[(chunks[send], right)], receives=[(buffer, left)])
            chunks[receive].add_(buffer)
        else:
            _exchange(sends=[(chunks[send], right)], receives=[(chunks[receive], left)])
        if after_step is not None:
            after_step(phase, step, send, receive, chunks)


def bytes_sent_per_rank(algorithm: str, size_bytes: int, world_size: int) -> float:
    """The textbook cost model: bytes the busiest rank sends for one all-reduce of size_bytes."""
    n = world_size
    return {"reduce_broadcast": (n - 1) * size_bytes,
            "all_to_all": (n - 1) * size_bytes,
            "ring": 2 * (n - 1) / n * size_bytes}[algorithm]


ALGORITHMS = {"reduce_broadcast": reduce_broadcast_all_reduce, "all_to_all": all_to_all_all_reduce,
              "ring": ring_all_reduce}
