"""Gradient accumulation under DDP, four ways, and a counter of the all-reduces each one makes.

Accumulating k micro-batches per optimizer step needs the gradients averaged over ranks once, after
the k-th backward. DDP all-reduces in every backward unless told not to, and what tells it is
no_sync(): but DDP decides in forward whether the coming backward syncs, so no_sync() must cover the
forward pass as well. Wrapped around backward alone it changes nothing.

Each function runs one optimizer step over `micro_batches` (a list of (inputs, labels)) and scales
the loss by 1/k so that the accumulated gradient is the mean over all k micro-batches.
"""
import contextlib

import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def sync_every_micro_batch(model, optimizer, micro_batches):
    """Baseline: an all-reduce after every micro-batch, k times the communication needed."""
    for inputs, labels in micro_batches:
        loss = F.nll_loss(model(inputs), labels) / len(micro_batches)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_around_backward_only(model, optimizer, micro_batches):
    """The common mistake: forward already ran with sync on, so every backward still all-reduces."""
    for index, (inputs, labels) in enumerate(micro_batches):
        loss = F.nll_loss(model(inputs), labels) / len(micro_batches)
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_around_forward_and_backward(model, optimizer, micro_batches):
    """Right: k-1 micro-batches accumulate locally, the last one all-reduces the sum once."""
    for index, (inputs, labels) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = F.nll_loss(model(inputs), labels) / len(micro_batches)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def accelerate_accumulate(accelerator, model, optimizer, micro_batches):
    """Accelerate's way: accumulate() applies no_sync for you; backward() divides the loss by k and the
    prepared optimizer skips step() until the k-th micro-batch. Needs Accelerator(gradient_accumulation_steps=k)."""
    for inputs, labels in micro_batches:
        with accelerator.accumulate(model):
            loss = F.nll_loss(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def count_all_reduces(ddp_model) -> dict:
    """Register a DDP communication hook that counts bucket all-reduces, then does the default one.

    counter["after_forward"] lists, for each all-reduce, how many forward passes the model had run by
    then: which micro-batches synchronized (figures/accumulation_syncs.py draws it).
    """
    counter = {"all_reduces": 0, "forwards": 0, "after_forward": []}

    def counting_all_reduce(state, bucket):
        state["all_reduces"] += 1
        state["after_forward"].append(state["forwards"])
        return default_hooks.allreduce_hook(None, bucket)

    def counting_forward(module, args):
        counter["forwards"] += 1

    ddp_model.register_forward_pre_hook(counting_forward)
    ddp_model.register_comm_hook(counter, counting_all_reduce)
    return counter
