"""Run a chapter script unchanged and record, in each process, what the tests need to check its lesson.

    torchrun --nproc_per_node=2 tests/instrument.py OUT_DIR src/ch4/mnist_3_ddp.py --data-dir ...

Each process writes OUT_DIR/rank{RANK}.pt at exit, with
  - the parameters before the first optimizer step and the gradients that step used (after DDP's
    all-reduce), and the parameters at the end, read from the optimizer, so nothing in the script changes;
  - the indices every DistributedSampler handed this rank, one list per epoch.
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
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data.distributed import DistributedSampler

record = {"initial": None, "grads": None, "final": None, "indices": [], "optimizer": None}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor, or of this rank's piece of a DTensor (FSDP2's sharded parameters)."""
    tensor = tensor.detach().clone()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def before_step(optimizer, args, kwargs) -> None:
    record["optimizer"] = optimizer
    if record["initial"] is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        record["initial"] = [local(p) for p in params]
        record["grads"] = [local(p.grad) for p in params]


def recording_iter(sampler):
    indices = list(original_iter(sampler))
    record["indices"].append(indices)
    return iter(indices)


def dropout_only_in_evaluation(self, x):
    return x if torch.is_grad_enabled() else F.dropout(x, self.p, self.training, self.inplace)


def save() -> None:
    optimizer = record.pop("optimizer")
    if optimizer is not None:
        record["final"] = [local(p) for group in optimizer.param_groups for p in group["params"]]
    torch.save(record, os.path.join(OUT_DIR, f"rank{os.environ.get('RANK', '0')}.pt"))


if __name__ == "__main__":
    OUT_DIR = sys.argv[1]
    original_iter = DistributedSampler.__iter__
    DistributedSampler.__iter__ = recording_iter
    nn.Dropout.forward = dropout_only_in_evaluation
    register_optimizer_step_pre_hook(before_step)
    atexit.register(save)
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
