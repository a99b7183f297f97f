"""A resumed DDP reduces in the gradient buckets the interrupted run was using, so it resumes bitwise.

DDP's first backward reduces every gradient in one bucket and records the order in which the
gradients arrive; the next forward rebuilds the buckets in that order (a first small one, then up to
`bucket_cap_mb` each) and they stay so for the rest of the run. A resumed run builds a new DDP: left
alone, its first step reduces in one bucket where the run it continues reduced in the rebuilt ones.
With 3 or more ranks that changes the sums. A ring all-reduce cuts the bucket into one chunk per rank
and adds each chunk up in its own order of ranks, so where the cuts fall decides the order in which
an element's values are added, and floating-point addition is not associative. (With 2 ranks every
sum is a + b == b + a, and nothing shows.) tests/test_resume.py measures it: without this, a run
resumed at 3 or 4 processes ends with other weights than the uninterrupted run.
"""
import torch
from torch.nn.parallel import DistributedDataParallel


def rebuild_buckets(model: DistributedDataParallel, autocast, *inputs, **kwargs) -> None:
    """One forward and backward of the model on any one sample, times zero, before the first training step.

    DDP records the order of the gradients, as in the first step of the interrupted run, and rebuilds
    its buckets at the next forward. Every rank calls it (it all-reduces zeros). It runs in eval mode,
    so that no dropout mask is drawn and no BatchNorm statistic moves; the zero gradients are dropped.
    """
    training = model.training
    model.eval()
    with autocast:  # the training step's autocast: its casts are nodes of the graph whose order DDP records
        output = model(*inputs, **kwargs)
    output = output if isinstance(output, torch.Tensor) else output[0]  # a model output's logits
    (output.sum() * 0).backward()
    model.zero_grad(set_to_none=True)
    model.train(training)
