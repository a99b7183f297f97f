"""A minimal DDP: gradient buckets all-reduced while backward is still running.

Backward produces gradients from the last layer to the first. Waiting for all of them and then
all-reducing (one bucket at the end) leaves the network idle during backward and the processor idle
during the all-reduce. Instead, parameters are grouped in reverse order into buckets of about
bucket_cap_mb; a hook on each parameter counts its gradient in, and when a bucket is complete its
all-reduce starts asynchronously while backward goes on with the earlier layers. Before the
optimizer step, wait_for_gradients() waits for the outstanding all-reduces and writes the averaged
gradients back. torch's DistributedDataParallel does the same, in C++, with the same argument name
(bucket_cap_mb, default 25, in MiB) and a first bucket of 1 MiB so that communication starts early.

Gradient accumulation works as with DDP: run the forward and backward of every micro-batch but the
last inside no_sync(), where gradients only add up in .grad; the last backward all-reduces the sum.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn


class BucketedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25):
        """bucket_cap_mb=None puts every gradient in one bucket: one all-reduce after backward, no overlap."""
        super().__init__()
        self.module = module
        for tensor in module.state_dict().values():  # start from rank 0's weights, as DDP does
            dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = [[]]
        filled = 0
        for param in reversed(params):  # the order backward produces them in
            if self.buckets[-1] and filled + param.numel() * param.element_size() > cap:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(param)
            filled += param.numel() * param.element_size()
        self._bucket_of = {param: index for index, bucket in enumerate(self.buckets) for param in bucket}
        self._ready = [0] * len(self.buckets)
        self._in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.require_backward_grad_sync = True  # DDP's name for what no_sync() turns off
        self._sync_backward = True  # whether the backward of the last forward all-reduces
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_accumulated)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # as in DDP, the forward decides whether its backward all-reduces
            self._sync_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward of a forward run inside only adds into .grad, for gradient accumulation: the next
        backward outside all-reduces the accumulated gradient, as with DDP's no_sync()."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _gradient_accumulated(self, param: nn.Parameter) -> None:
        """The hook: backward has just added param's gradient into param.grad."""
        index = self._bucket_of[param]
        if self._ready[index] == len(self.buckets[index]):  # wait_for_gradients() would overwrite this gradient
            raise RuntimeError("backward() ran again before wait_for_gradients(): to accumulate gradients, "
                               "run every micro-batch but the last inside no_sync()")
        if self._sync_backward:
            self._gradient_ready(param)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        index = self._bucket_of[param]
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index]):  # the bucket's last gradient just arrived
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
            self._in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))

    def wait_for_gradients(self) -> None:
        """Call between backward() and optimizer.step(): finish every all-reduce and average."""
        if len(self._in_flight) != len(self.buckets):
            raise RuntimeError(f"only {len(self._in_flight)} of {len(self.buckets)} gradient buckets were "
                               "all-reduced: call backward() once outside no_sync() before wait_for_gradients()")
        world_size = dist.get_world_size()
        for index, flat, work in self._in_flight:
            work.wait()
            flat.div_(world_size)
            offset = 0
            for param in self.buckets[index]:
                param.grad.copy_(flat[offset:offset + param.numel()].view_as(param.grad))
                offset += param.numel()
        self._in_flight.clear()
        self._ready = [0] * len(self.buckets)


def linear_stack(layers: int, width: int) -> nn.Sequential:
    """Equal Linear(width, width) + ReLU layers: backward produces one equal gradient after another, so
    overlap has something to hide (for the bucketing benchmark and the overlap figures)."""
    return nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())])
