"""Fewer bytes per step: torch's DDP communication hooks, and a count of what each rank sends.

DDP hands each gradient bucket to a communication hook, which must return a future holding the
averaged bucket. Without one, DDP all-reduces the bucket as it is (fp32: 4 bytes per gradient). Hooks
from torch.distributed.algorithms.ddp_comm_hooks send less:
  fp16, bf16  cast the bucket to 16 bits, all-reduce that, cast back: half the bytes, rounding error
              (fp16 keeps 10 bits of mantissa and overflows above 65504; bf16 keeps fp32's range, 7 bits);
  powersgd    (Vogels et al. 2019) view each parameter's gradient as an n×m matrix M (n = its first
              dimension) and all-reduce two thin factors, P = M·Q (n×r) and Q = Mᵀ·P (m×r): r(n+m)
              numbers instead of n·m. What the factors miss is kept (error feedback) and added to the
              next step's gradient. Vectors (biases) and matrices that rank r would not shrink at
              least min_compression_rate times are sent whole.

"Bytes sent" here is the payload: the bytes of every tensor a rank hands to all_reduce, which
AllReduceCounter adds up as the tensors pass. What a ring all-reduce then puts on the wire from each
rank is 2(N-1)/N of that payload (common/lessons/allreduce.py); other algorithms send other multiples.
"""
import threading

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from common.cli import COMM_HOOKS
from common.lessons.allreduce import bytes_sent_per_rank

START_POWERSGD = 2  # plain all-reduce for the first steps: the fewest PowerSGD allows with error feedback
MIN_COMPRESSION_RATE = 2  # torch's default: a matrix is compressed only if that sends less than half


def register_comm_hook(model, name: str, powersgd_rank: int = 1, min_compression_rate: float = MIN_COMPRESSION_RATE):
    """Register torch's hook `name` on a DDP model, over the default process group.

    "none" registers allreduce_hook: what DDP does without a hook, written in Python, where
    AllReduceCounter sees it (DDP's own reduction runs in C++)."""
    if name not in COMM_HOOKS:
        raise ValueError(f"unknown communication hook {name!r}; known: {', '.join(COMM_HOOKS)}")
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=START_POWERSGD, min_compression_rate=min_compression_rate,
                                            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[name]
        model.register_comm_hook(None, hook)


def bucket_cap_mb(name: str, model) -> float | None:
    """DDP's bucket size for hook `name`: None (DDP's default), except PowerSGD on gloo: one bucket.

    PowerSGD issues its second and third all-reduce from a callback, when the one before it finishes.
    gloo finishes collectives on its own threads, so with two buckets in flight the ranks can issue
    those all-reduces in different orders: a collective mismatch (gloo::EnforceNotMet, "Received data
    size doesn't match expected size", seen here at the first compressed step). NCCL completes a future as it enqueues the collective
    on the GPU stream, so the callbacks run at once, in the same order on every rank."""
    if name == "powersgd" and dist.get_backend() == "gloo":
        return gradient_bytes(model) / 2**20 + 1
    return None


def powersgd_numel(shape, rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE) -> int:
    """Numbers PowerSGD all-reduces per step for one parameter of this shape: r'(n+m) for the n×m
    matrix it views the gradient as (r' = min(n, m, rank)) if that is min_compression_rate times
    smaller than n·m, else all n·m of them (as powerSGD_hook's _should_compress decides)."""
    n = shape[0] if len(shape) else 1
    m = torch.Size(shape).numel() // n
    compressed = min(n, m, rank) * (n + m)
    return compressed if compressed * min_compression_rate < n * m else n * m


def gradient_bytes(model) -> int:
    """What plain DDP hands to all-reduce each step: every parameter's gradient, in its own dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class AllReduceCounter:
    """Within `with counter:`, add up the bytes and the calls of every torch.distributed.all_reduce
    this process makes; totals grow over several `with` blocks.

    It wraps torch.distributed.all_reduce, the function torch's hooks and common/lessons/local_sgd.py call.
    PowerSGD issues its second and third all-reduce from a callback, which gloo runs on its own threads: hence the lock.
    """

    def __init__(self):
        self.bytes = self.calls = 0
        self._lock = threading.Lock()
        self._original = None

    def __enter__(self):
        self._original = dist.all_reduce

        def counted_all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.bytes += tensor.numel() * tensor.element_size()
                self.calls += 1
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted_all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def bytes_report(sent_bytes: int, steps: int, model, world_size: int) -> str:
    """One line: the payload each rank handed to all-reduce per step, against plain DDP's."""
    per_step, plain = sent_bytes / steps, gradient_bytes(model)
    ring = bytes_sent_per_rank("ring", per_step, world_size)
    return (f"sent per rank per step (all-reduce payload, mean of {steps} steps): {per_step:,.0f} B, "
            f"{plain / per_step:.1f}x less than plain DDP's {plain:,} B; a ring of {world_size} puts {ring:,.0f} B on the wire")
