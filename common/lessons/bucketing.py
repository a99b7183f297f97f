"""A minimal DDP: gradient buckets all-reduced while backward is still running.

Backward produces gradients from the last layer to the first. Waiting for all of them and then
all-reducing (one bucket at the end) leaves the network idle during backward and the processor idle
during the all-reduce. Instead, parameters are grouped in reverse order into buckets of about
bucket_cap_mb; a hook on each parameter counts its gradient in, and when a bucket is complete its
all-reduce starts asynchronously while backward goes on with the earlier layers. Before the
optimizer step, wait_for_gradients() waits for the outstanding all-reduces and writes the averaged
gradients back. torch's DistributedDataParallel does the same, in C++, with the same argument name
(bucket_cap_mb, default 25) and a first bucket of 1 MB so that communication starts early.
"""
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
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
                               "all-reduced: call backward() once before wait_for_gradients()")
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
