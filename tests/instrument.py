"""Run a chapter script unchanged and record, in each process, what the tests need to check its lesson.

    torchrun --nproc_per_node=2 tests/instrument.py OUT_DIR src/ch4/mnist_3_ddp.py --data-dir ...

Each process writes OUT_DIR/rank{RANK}.pt at exit, with
  - the parameters before the first optimizer step and the gradients that step used (after DDP's
    all-reduce; None where the step computes them itself from a closure, as Lightning's does), and the
    parameters after the last step, read from the optimizer, so nothing in the script changes (after
    the last step, not at exit: Lightning's trainer.test() copies rank 0's weights to every rank);
  - the indices every DistributedSampler handed this rank, one list per epoch;
  - every training loss this rank computed with F.nll_loss or F.cross_entropy, in order.
Under FSDP2 parameters and gradients are DTensors: each rank records its own piece (to_local()), and
the test puts the pieces back together.
Training forward passes run without dropout, so that a step can be recomputed exactly in one
process; evaluation (no autograd) keeps the module's own dropout setting, so a missing model.eval()
still shows.
"""
import atexit
import os
import runpy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data.distributed import DistributedSampler

from common.mnist import Dropout

record = {"initial": None, "grads": None, "final": None, "indices": [], "losses": []}


def parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor, or of this rank's piece of a DTensor (FSDP2's sharded parameters)."""
    tensor = tensor.detach().clone()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def before_step(optimizer, args, kwargs) -> None:
    if record["initial"] is None:
        record["initial"] = [local(p) for p in parameters(optimizer)]
        record["grads"] = [None if p.grad is None else local(p.grad) for p in parameters(optimizer)]


def after_step(optimizer, args, kwargs) -> None:
    record["final"] = [local(p) for p in parameters(optimizer)]


def recording_iter(sampler):
    indices = list(original_iter(sampler))
    record["indices"].append(indices)
    return iter(indices)


def recording_losses(loss_function):
    def loss(*args, **kwargs):
        value = loss_function(*args, **kwargs)
        if torch.is_grad_enabled():  # training, not evaluation
            record["losses"].append(value.item())
        return value
    return loss


def dropout_only_in_evaluation(self, x):
    return x if torch.is_grad_enabled() else F.dropout(x, self.p, self.training, self.inplace)


def save() -> None:
    torch.save(record, os.path.join(OUT_DIR, f"rank{os.environ.get('RANK', '0')}.pt"))


if __name__ == "__main__":
    OUT_DIR = sys.argv[1]
    original_iter = DistributedSampler.__iter__
    DistributedSampler.__iter__ = recording_iter
    nn.Dropout.forward = Dropout.forward = dropout_only_in_evaluation  # common.mnist.Dropout: BasicNet's
    F.nll_loss, F.cross_entropy = recording_losses(F.nll_loss), recording_losses(F.cross_entropy)
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    atexit.register(save)
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
