"""Batch normalization under data parallelism: statistics of the global batch, not of each rank's part.

In training, BatchNorm normalizes each channel by the mean and variance of the batch it is given.
Under DDP that batch is the rank's 1/N of the global batch, so every rank normalizes by different
numbers, the forward is not one process's forward on the global batch, and each rank's running
statistics follow its own data (DDP then broadcasts rank 0's buffers before each forward: the other
ranks' statistics are thrown away). nn.SyncBatchNorm.convert_sync_batchnorm(model) replaces each
BatchNorm by one that all-gathers every rank's per-channel mean, inverse standard deviation and count,
so that every rank normalizes by the global batch's statistics; it runs only on accelerators (torch
refuses CPU tensors with a ValueError).

AllRanksBatchNorm2d computes the same statistics with plain all-reduces, which run on gloo too: the
CPU stand-in the tests and docs/reductions.md use to show what SyncBatchNorm does.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from common.mnist import BasicNet


class _SumOverRanks(torch.autograd.Function):
    """An all-reduce (sum) that autograd goes through: the gradient of a sum over ranks is the sum
    over ranks of the gradients, so backward all-reduces too."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllRanksBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the batch over all ranks (what SyncBatchNorm
    computes on GPUs): each rank contributes its per-channel count, sum and sum of squared deviations."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        # Count, sum and all-reduce in fp32 at least, as nn.BatchNorm2d does on bf16 activations under autocast:
        # bf16 counts exactly only up to 256, and its sums keep 8 significant bits.
        dtype = torch.promote_types(x.dtype, torch.float32)
        count = torch.full((1,), x.numel() / x.shape[1], dtype=dtype, device=x.device)
        dist.all_reduce(count)  # a constant: no gradient flows through it
        wide = x.to(dtype)
        mean = _SumOverRanks.apply(wide.sum((0, 2, 3))) / count
        centered = wide - mean.view(1, -1, 1, 1)
        var = _SumOverRanks.apply(centered.pow(2).sum((0, 2, 3))) / count  # two passes: no cancellation
        with torch.no_grad():  # the running statistics, as nn.BatchNorm2d keeps them (unbiased variance)
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
            self.running_var.lerp_((var * count / (count - 1)).to(self.running_var.dtype), self.momentum)
        normalized = centered / (var + self.eps).sqrt().view(1, -1, 1, 1) * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        return normalized.to(x.dtype)  # as nn.BatchNorm2d returns it, under autocast too


class BatchNormNet(BasicNet):
    """BasicNet with a BatchNorm after each convolution (conv1 and conv2 become convolution + norm)."""

    def __init__(self, norm: type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Sequential(self.conv1, norm(32))
        self.conv2 = nn.Sequential(self.conv2, norm(64))
