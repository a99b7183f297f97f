"""ZeRO stages 1, 2 and 3 from scratch: data parallelism with the training state sharded over the ranks.

DDP keeps everything on every rank: for Ψ parameters trained with AdamW in fp32, 4Ψ bytes of
parameters, 4Ψ of gradients and 8Ψ of optimizer state (two moments), 16Ψ whatever the world size N.
ZeRO (Rajbhandari et al., 2020) cuts each term into N shards, rank r keeping shard r:
  stage 1  optimizer state / N   after backward, reduce-scatter the gradients (rank r gets the average
                                 of shard r only: all it needs), step AdamW on shard r, all-gather params
  stage 2  + gradients / N       the same, but each layer's gradient is reduce-scattered as soon as
                                 backward produces it and the full gradient is freed at once
  stage 3  + parameters / N      parameters live as shards; each layer all-gathers its full
                                 parameters just before its forward and again before its backward,
                                 and frees them after each
A reduce-scatter plus an all-gather move the same bytes as one (ring) all-reduce, 2(N-1)/N·S per rank:
stages 1 and 2 cost DDP's communication; stage 3 adds one more all-gather of the parameters (the
backward one), 3(N-1)/N·S in all.

The unit of sharding here is one module's own parameters (a Linear's weight and bias, say): they are
flattened into one buffer, padded with zeros to a multiple of N so that every shard has the same size,
and shard r is elements [r·k, (r+1)·k). One collective per unit, like FSDP's per-layer groups.

Collectives: torch's reduce_scatter_tensor and all_gather_into_tensor. NCCL runs a real reduce-scatter;
gloo (CPU) has reduce_scatter_tensor since torch 2.3, but computes it as an all-reduce of the whole
buffer of which each rank keeps its shard (pytorch/pytorch#118911), so on the CPU stages 1 and 2 send
an all-reduce's bytes plus an all-gather's. The results are the same; only NCCL shows the saving.
gloo has no average, so the sum is divided by N.

A module's output may be a tensor or any nesting of tuples, lists and dicts of them (a transformers
ModelOutput too): stage 3 gathers the parameters again for backward when the first gradient of any of
its tensors arrives, once per backward.

A unit is trained when its parameters got gradients and left alone when none did (a module this forward did
not use: one process skips its parameters, and so does DDP with find_unused_parameters=True). A unit some of
whose parameters got a gradient and others none cannot be stepped as one process would step it (AdamW would
move the others' numbers in the flat shard), so step() refuses it in one sentence. Which modules a forward uses
must be the same on every rank: a rank without a unit's gradients would skip the collective its peers wait in.

Limits, to stay short: fp32 parameters (no bf16 copy with an fp32 master), one backward per step,
each module called once per forward, no parameter shared between modules.
"""
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

STAGES = (1, 2, 3)


class _Unit:
    """One module's own parameters as one flat buffer, padded to a multiple of N, and this rank's shard."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], stage: int):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.module, self.params = module, params
        numel = sum(p.numel() for p in params)
        self.shard_numel = -(-numel // world_size)  # ceil: the last shard's tail is padding
        self.flat = torch.zeros(self.shard_numel * world_size, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for param in params:  # the module's parameters become views into the flat buffer
            self.flat[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
            param.data = self.flat[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
        own = self.flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        # Stages 1-2: the shard is a view of the full buffer, so the optimizer's update lands in it.
        # Stage 3: the shard is the only copy kept; the full buffer is gathered when needed.
        self.shard = nn.Parameter(own if stage < 3 else own.clone())
        self.grads_ready = 0

    def gather(self) -> None:
        """All-gather the full parameters from every rank's shard (into the same memory, so that views,
        including those autograd saved in forward, see them)."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.flat.numel() * self.flat.element_size())
        dist.all_gather_into_tensor(self.flat, self.shard.detach())

    def free(self) -> None:
        """Give the full parameters' memory back; the views keep their shapes and wait for gather()."""
        self.flat.untyped_storage().resize_(0)

    def reduce_scatter_gradients(self) -> None:
        """Average the gradients over the ranks, keeping only this rank's shard; free the full ones."""
        flat_grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        flat_grad = nn.functional.pad(flat_grad, (0, self.flat.numel() - flat_grad.numel()))
        shard_grad = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard_grad, flat_grad)
        shard_grad.div_(dist.get_world_size())
        self.shard.grad = shard_grad if self.shard.grad is None else self.shard.grad + shard_grad
        for param in self.params:
            param.grad = None


class ZeRO(nn.Module):
    """Wrap a module for ZeRO data parallelism at `stage` 1, 2 or 3; `optimizer` builds the optimizer
    from a list of parameters (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)) and is given
    this rank's shards only. Train with loss.backward(), optionally clip_grad_norm_(max_norm), then
    step(), then zero_grad()."""

    def __init__(self, module: nn.Module, stage: int, optimizer: Callable[[list], torch.optim.Optimizer]):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
        self.module, self.stage = module, stage
        for tensor in module.state_dict().values():  # start from rank 0's weights, as DDP does
            dist.broadcast(tensor, src=0)
        owners = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if param in owners:
                raise ValueError(f"{name} is shared between modules: tied parameters are not supported")
            owners[param] = name
        self.units = [_Unit(m, params, stage) for m in module.modules()
                      if (params := [p for p in m.parameters(recurse=False) if p.requires_grad])]
        self.optimizer = optimizer([unit.shard for unit in self.units])
        self.averaged = False  # this step's gradients averaged already (by clip_grad_norm_)
        for unit in self.units:
            if stage >= 2:  # reduce-scatter each unit's gradient as soon as backward has produced all of it
                for param in unit.params:
                    param.register_post_accumulate_grad_hook(lambda _, unit=unit: self._gradient_ready(unit))
            if stage == 3:
                unit.free()
                unit.module.register_forward_pre_hook(lambda *_, unit=unit: unit.gather())
                unit.module.register_forward_hook(lambda _, __, output, unit=unit: self._after_forward(unit, output))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _after_forward(self, unit: _Unit, output) -> None:
        """Free the unit's parameters; if a backward will follow, gather them again just before it."""
        unit.free()
        tensors = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
        # mode "any": once per backward, at the first of their gradients (those needing none are skipped),
        # which backward computes before it enters this module
        register_multi_grad_hook(tensors, lambda grad: unit.gather(), mode="any")

    def _gradient_ready(self, unit: _Unit) -> None:
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):  # the unit's last gradient just arrived
            unit.reduce_scatter_gradients()
            if self.stage == 3:
                unit.free()

    def _average_gradients(self) -> None:
        """Leave each shard's gradient averaged over the ranks: stage 1 reduce-scatters here (once, if
        clip_grad_norm_ has not already), stages 2-3 did it in backward. Whether a unit trains is decided by
        every one of its parameters: their gradients (stage 1), the count of their backward hooks (stages 2-3)."""
        if self.averaged:
            return
        if self.stage == 1:
            counts = [sum(p.grad is not None for p in unit.params) for unit in self.units]
        else:
            counts = [unit.grads_ready for unit in self.units]
        if not any(counts):
            raise RuntimeError("no gradient arrived: call backward() once before step()")
        for unit, count in zip(self.units, counts):
            if 0 < count < len(unit.params):
                raise RuntimeError(f"{count} of {len(unit.params)} parameters of {type(unit.module).__name__} got a gradient: "
                                   "ZeRO shards a module's parameters together and cannot step some of them alone; give "
                                   "the others requires_grad=False, or use them in forward")
            if count and self.stage == 1:
                unit.reduce_scatter_gradients()
        self.averaged = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their total 2-norm over the whole model is at most max_norm, as
        torch.nn.utils.clip_grad_norm_ does on one process; return the total norm before clipping.

        Each rank holds a shard of the averaged gradient, so the norm of its shards alone is not the
        model's: the squared total norm is the sum over ranks of each rank's squared shard norms (the
        padding is zero), one all-reduce of one number. Every rank gets the same norm and the same
        factor, and the clipped shards are the shards of the gradient one process would clip."""
        self._average_gradients()
        trained = [unit for unit in self.units if unit.shard.grad is not None]  # the same units on every rank
        squares = sum(unit.shard.grad.pow(2).sum() for unit in trained)
        dist.all_reduce(squares)
        total_norm = squares.sqrt()
        factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # torch's formula, so that results match
        for unit in trained:
            unit.shard.grad.mul_(factor)
        return total_norm

    def step(self) -> None:
        """Average the gradients (unless clip_grad_norm_ did), update this rank's shards, and all-gather
        the updated parameters (stages 1-2; stage 3 gathers them on use)."""
        self._average_gradients()
        for unit in self.units:
            unit.grads_ready = 0
        self.averaged = False
        self.optimizer.step()
        if self.stage < 3:
            for unit in self.units:
                dist.all_gather_into_tensor(unit.flat, unit.shard.detach().clone())  # the input is part of the output

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.module.zero_grad(set_to_none=set_to_none)

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter in full, in module.parameters() order (stage 3 gathers them: a collective)."""
        sharded = self.units if self.stage == 3 else []
        for unit in sharded:
            unit.gather()
        full = [p.detach().clone() for p in self.module.parameters()]
        for unit in sharded:
            unit.free()
        return full
