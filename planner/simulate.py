"""Check a 1,024-GPU job on a laptop: one training step of the repo's own wrapping at a simulated world size.

    python -m planner.simulate --layers 8 --hidden 8192 --gpus 1024 --strategy fsdp
    python -m planner.simulate --model path/with/config.json --gpus 64 --strategy fsdp zero3 --seq 2048 --json

How. torch's `fake` process-group backend (torch.testing._internal.distributed.fake_pg) plays rank 0 of
a group of N: every collective returns at once, its output the right size. Under FakeTensorMode every
tensor has a shape, a dtype and a storage size, but no memory, so a 70 B model costs nothing to hold.
On that, the repo's own code runs one training step (forward, backward, AdamW step): FSDP2 and HSDP
through common.fsdp.fully_shard_blocks, the sharded chapter's policy; ZeRO-1/2/3 through common/lessons/zero.py;
DDP emulated (below). Two probes watch the step: torch's memory tracker (torch.distributed._tools:
FSDPMemTracker for FSDP2, MemTracker for the rest) gives the bytes by category at the peak, and
CollectiveLog, a dispatch mode, records each collective's kind and output size.

Why trust it: the same function runs under a real gloo group, with real tensors, and tests/test_simulate.py
checks that rank 0 holds the same parameters, gradients and optimizer state and issues the same
collectives with the same sizes, at 2 and 3 processes (4 for HSDP on a 2 x 2 mesh); for DDP every number
agrees. These are counted as the distinct storages each rank holds (common.memory): the parameters and
optimizer state after the step, the gradients right after backward. The peak and what it is made of
(activations, gathered parameters, communication buffers) are the tracker's, and are an estimate: a
real backend allocates staging copies of its own that fake collectives do not (gloo's copy of an
all-gather's input, a few kB at this size), and under fake tensors FSDP2's all-gather buffers are not
told apart from the rest.

DDP's C++ reducer cannot run on fake tensors (it allocates and synchronizes in C++, out of the trackers'
sight), so DDP is emulated: torch's own bucket assignment (dist._compute_bucket_assignment_by_size at the
caps the reducer uses from the second step on, 1 MiB first and 25 MiB after), a flat buffer per bucket
allocated beside the gradients (the reducer's, with gradient_as_bucket_view=False, the default), and one
all-reduce per bucket after backward.

--precision mixed: for FSDP2 and HSDP, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32
sharded parameters; ZeRO and DDP have no bf16 copy of the weights here (common/lessons/zero.py trains in fp32), so
their closest equivalent is bf16 autocast over fp32 parameters, as torch's AMP does: the same persistent
state as fp32, smaller activations.
"""
import argparse
import gc
import json
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from common.fsdp import fully_shard_blocks, transformer_blocks
from common.lessons.zero import ZeRO
from common.memory import optimizer_tensors, storage_bytes
from planner import plan as planner

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
MiB = 2**20


class SimulationError(ValueError):
    """Input the simulation cannot run; the message is one sentence for the user."""


# ---- what a step does: its collectives, and its memory ----

def _tensors(value) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _bytes(value) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(value))


class CollectiveLog(TorchDispatchMode):
    """Every collective the step issues, as (kind, bytes of its output on this rank): an all-gather or an
    all-reduce of S bytes writes S, a reduce-scatter S/N. dist.* calls reach torch's c10d operators through
    the dispatcher, so a dispatch mode sees them, under the fake backend and under gloo alike."""

    def __init__(self):
        super().__init__()
        c10d = torch.ops.c10d
        self.kinds = {c10d.allreduce_.default: "all_reduce", c10d.broadcast_.default: "broadcast",
                      c10d._allgather_base_.default: "all_gather", c10d.allgather_.default: "all_gather",
                      c10d._reduce_scatter_base_.default: "reduce_scatter"}  # each writes into its first argument
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.kinds:
            self.calls.append((self.kinds[func], _bytes(args[0])))
        return func(*args, **(kwargs or {}))

    def summary(self) -> list[dict]:
        """One entry per kind, in KINDS' order: how many calls, and their output bytes summed."""
        return [{"kind": kind, "count": sum(1 for k, _ in self.calls if k == kind),
                 "bytes_per_rank": sum(size for k, size in self.calls if k == kind)}
                for kind in KINDS if any(k == kind for k, _ in self.calls)]


# ---- the model ----

@dataclass(frozen=True)
class Case:
    """What to simulate: a transformers config (or a stack of layers x Linear(hidden, hidden)), the step's
    batch per rank and sequence length, and how it is wrapped."""
    strategy: str
    gpus: int
    gpus_per_node: int = 8
    layers: int | None = None
    hidden: int | None = None
    config: object = None
    batch: int = 1
    seq: int = 128
    precision: str = "fp32"
    recompute: bool = False
    wrap: str = "blocks"
    head: str = "auto"  # the config's head (planner.plan.head_class)


class LinearStack(nn.Module):
    """layers x Linear(hidden, hidden) with a ReLU between them: the smallest model with blocks to shard."""

    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build(case: Case) -> tuple[nn.Module, dict, callable]:
    """The model, a batch for one rank, and the loss of the model on it: fake tensors under FakeTensorMode."""
    if case.config is None:
        model = LinearStack(case.layers, case.hidden)
        inputs = {"x": torch.randn(case.batch, case.hidden)}
        return model, inputs, lambda out: out.float().pow(2).mean()
    from transformers import AutoModelForCausalLM
    model_class = planner.head_class(case.config, case.head)
    causal = model_class is AutoModelForCausalLM
    try:
        model = model_class.from_config(case.config)
    except (ValueError, NotImplementedError, RuntimeError) as error:
        raise SimulationError(f"{type(case.config).__name__} cannot be built without memory (on fake tensors) as "
                              f"{model_class.__name__} ({str(error).splitlines()[0]})") from None
    ids = torch.randint(0, case.config.vocab_size, (case.batch, case.seq))
    labels = ids if causal else torch.zeros(case.batch, dtype=torch.long)
    return model, {"input_ids": ids, "labels": labels}, lambda out: out.loss


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing per block: each block keeps its input and runs its forward again in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    blocks = set(transformer_blocks(model))
    apply_activation_checkpointing(model, check_fn=lambda module: module in blocks)


# ---- DDP, emulated ----

class EmulatedDDP(nn.Module):
    """DDP's step in Python (the module docstring says why): torch's buckets, a buffer each, an all-reduce each."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        backward_order = list(reversed(params))  # the reducer's order: the last layer's gradients arrive first
        buckets, _ = dist._compute_bucket_assignment_by_size(backward_order, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB])
        self.buckets = [[backward_order[i] for i in bucket] for bucket in buckets]
        self.bucket_buffers = [torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype) for bucket in self.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync(self) -> None:
        for bucket, buffer in zip(self.buckets, self.bucket_buffers):
            torch.cat([p.grad.reshape(-1) for p in bucket], out=buffer)
            dist.all_reduce(buffer)
            buffer.div_(dist.get_world_size())
            offset = 0
            for p in bucket:
                p.grad.copy_(buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


# ---- one step, measured ----

@dataclass
class Measured:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    unsharded_param_bytes: int | None  # None for ZeRO-3: the tracker does not tell its gathers from the rest
    comm_buffer_bytes: int
    peak_bytes: int
    collectives: list = field(default_factory=list)


def mesh_for(case: Case):
    """FSDP2's device mesh: 1-D for FSDP, (replicate, shard) for HSDP. Made outside FakeTensorMode (its rank
    table is a tensor that must be real)."""
    from torch.distributed.device_mesh import init_device_mesh
    if case.strategy == "hsdp":
        return init_device_mesh("cpu", (case.gpus // case.gpus_per_node, case.gpus_per_node),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (case.gpus,)) if case.strategy == "fsdp" else None


def measure_step(case: Case, fake: bool) -> Measured:
    """Two training steps of `case` in the process group that exists (fake or real), the second measured:
    the first creates AdamW's state, as a real job's first step does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mesh = mesh_for(case)
    gc.collect()
    gc.disable()  # a collection in the middle of the step would free tensors at a moment the other run does not
    try:
        with FakeTensorMode() if fake else nullcontext():
            return _measured(case, mesh)
    finally:
        gc.enable()


def _measured(case: Case, mesh) -> Measured:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    sharded = case.strategy in ("fsdp", "hsdp")
    model, inputs, loss_of = build(case)
    if case.recompute:
        checkpoint_blocks(model)
    mixed = case.precision == "mixed"
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=False)  # noqa: E731  foreach: less memory
    if sharded:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        try:
            fully_shard_blocks(model, case.wrap, mesh=mesh, **({"mp_policy": policy} if policy else {}))
        except ValueError as error:  # no blocks it knows, or a tied head with --wrap blocks+embeddings
            raise SimulationError(str(error)) from None
        optimizer, step, extra = adamw(model.parameters()), None, []
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(inputs)
    else:
        if case.wrap != "blocks":
            raise SimulationError(f"--wrap {case.wrap} is FSDP2's: {case.strategy} has no groups of blocks to wrap")
        if case.strategy == "ddp":
            model = EmulatedDDP(model)
            optimizer, extra = adamw(model.parameters()), model.bucket_buffers
            step = lambda: (model.sync(), optimizer.step())  # noqa: E731
        else:
            try:
                model = ZeRO(model, int(case.strategy[-1]), adamw)
            except ValueError as error:  # shared (tied) parameters
                raise SimulationError(f"common/lessons/zero.py refuses this model: {error}") from None
            optimizer, step, extra = model.optimizer, model.step, [unit.shard for unit in model.units]
        tracker = MemTracker()
        tracker.track_external(model, optimizer, *extra)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed and not sharded else nullcontext()
    log = CollectiveLog()
    with tracker:
        for iteration in range(2):
            with log if iteration == 1 else nullcontext():
                with autocast:
                    loss = loss_of(model(**inputs))
                loss.backward()
                if iteration == 1:
                    grads = [p.grad for p in model.parameters()] + [getattr(t, "grad", None) for t in extra]
                    grad_bytes = storage_bytes(grads)
                (step or optimizer.step)()
            if iteration == 0:
                optimizer.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
    peak = {getattr(key, "value", key): value for key, value in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    params = list(model.parameters()) + [t for t in extra if isinstance(t, nn.Parameter)]
    return Measured(
        param_bytes=storage_bytes(params), grad_bytes=grad_bytes, optimizer_bytes=storage_bytes(optimizer_tensors(optimizer)),
        activation_bytes=peak.get("Activation", 0),
        unsharded_param_bytes=peak.get("Unsharded Param", 0) if sharded else None if case.strategy == "zero3" else 0,
        comm_buffer_bytes=peak.get("All Gather", 0) + peak.get("Reduce Scatter", 0) if sharded
        else storage_bytes(extra) if case.strategy == "ddp" else 0,
        peak_bytes=peak["Total"], collectives=log.summary())


# ---- beside the plan ----

def plan_model(case: Case) -> planner.Model:
    if case.config is not None:
        return planner.model_of_config(case.config, head=case.head)
    block = case.hidden * case.hidden + case.hidden
    return planner.Model(case.layers * block, 0, case.layers, case.hidden, None, block_params=block, root_params=0,
                         end_params=(0, 0), built=LinearStack.__name__)


def planned(case: Case, model: planner.Model) -> dict:
    """planner.plan's numbers for the same case, in the same names; None where the plan has none.

    The state is the plan's fp32 accounting in both precisions: what --precision mixed runs here (FSDP2's
    policy, or autocast) keeps fp32 parameters, gradients and AdamW state. The plan's own mixed is the ZeRO
    paper's recipe (16-bit weights and gradients, an fp32 master copy), which none of these holds
    (docs/plan.md, "Which precision to plan with"). Activations and FSDP2's gathers are 16-bit in mixed.
    unsharded_param_bytes is the most FSDP holds gathered at once (planner.plan.gathered_bytes): the plan does
    not split it, as the tracker does, between "Unsharded Param" and the all-gather buffers the parameters
    are views of (comm_buffer_bytes), so it compares with the two measured together (gathered_and_buffers),
    and only where the peak falls at that moment. The plan has no number for DDP's bucket buffers."""
    shards = case.gpus_per_node if case.strategy == "hsdp" else case.gpus
    params, grads, optimizer = planner.memory_bytes(case.strategy, model.params, shards, "fp32")
    activations = planner.activation_bytes(model, case.batch, case.seq, case.precision, case.recompute)
    bf16_gathers = case.precision == "mixed" and case.strategy in ("fsdp", "hsdp")  # FSDP2's policy; autocast keeps fp32
    gathers = "mixed" if bf16_gathers else "fp32"  # the plan's name for 16-bit parameters, for those bytes alone
    gathered = planner.BYTES_PER_PARAM[gathers][0]  # bytes per parameter
    unsharded = planner.gathered_bytes(case.strategy, model, gathers, case.wrap)
    pieces = planner.collectives_per_step(case.strategy, model, 4 * model.params)
    full_params, full_grads = gathered * model.params, 4 * model.params
    if case.strategy == "ddp":
        collectives = [("all_reduce", pieces, full_grads)]
    elif case.strategy in ("zero1", "zero2"):
        collectives = [("all_gather", pieces, full_params), ("reduce_scatter", pieces, full_grads / case.gpus)]
    else:
        collectives = [("all_gather", 2 * pieces, 2 * full_params), ("reduce_scatter", pieces, full_grads / shards)]
        if case.strategy == "hsdp" and case.gpus > case.gpus_per_node:
            collectives.append(("all_reduce", pieces, full_grads / shards))
    collectives.sort(key=lambda entry: KINDS.index(entry[0]))
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optimizer, "activation_bytes": activations,
            "unsharded_param_bytes": unsharded, "comm_buffer_bytes": None,
            "peak_bytes": params + grads + optimizer + (activations or 0) + (unsharded or 0),
            "collectives": [{"kind": kind, "count": count, "bytes_per_rank": size} for kind, count, size in collectives]}


# ---- the command ----

def fake_group(world_size: int) -> None:
    """Rank 0 of a process group of world_size, every collective returning at once."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise SimulationError(f"torch {torch.__version__} has no fake process-group backend "
                              "(torch.testing._internal.distributed.fake_pg): install torch 2.4 or newer") from None
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def simulate(case: Case) -> dict:
    """One strategy at one simulated size: measured beside planned, as --json prints it."""
    if case.strategy == "hsdp" and case.gpus % case.gpus_per_node:
        raise SimulationError(f"HSDP's mesh is nodes x GPUs per node: --gpus {case.gpus} is not a whole number of "
                              f"nodes of --gpus-per-node {case.gpus_per_node}")
    fake_group(case.gpus)
    try:
        measured = measure_step(case, fake=True)
    finally:
        dist.destroy_process_group()
    model = plan_model(case)
    return {"strategy": case.strategy, "gpus": case.gpus, "params": model.params, "model_class": model.built,
            "measured": asdict(measured), "planned": planned(case, model)}


def megabytes(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.1f}"


def gathered_and_buffers(numbers: dict) -> int | None:
    """Parameters gathered whole at the peak with the buffers around them (FSDP2's all-gather buffers, which
    the tracker tells apart from "Unsharded Param" where the plan does not; DDP's bucket buffers)."""
    if numbers["unsharded_param_bytes"] is None:
        return None
    return numbers["unsharded_param_bytes"] + (numbers["comm_buffer_bytes"] or 0)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m planner.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--model", help="a folder with a config.json, or a hub name from the local cache")
    size.add_argument("--layers", type=planner.positive(int), help="with --hidden: a stack of LAYERS x Linear(HIDDEN, HIDDEN)")
    planner.add_head_flag(parser)
    parser.add_argument("--hidden", type=planner.positive(int), help="with --layers: the width")
    parser.add_argument("--gpus", type=planner.positive(int), default=8, help="the simulated world size (default: 8)")
    parser.add_argument("--gpus-per-node", type=planner.positive(int), help="HSDP's shard group (default: 8, or --gpus if fewer)")
    parser.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=["fsdp"], help="one or more (default: fsdp)")
    parser.add_argument("--batch", type=planner.positive(int), default=1, help="sequences (or rows) per rank (default: 1)")
    parser.add_argument("--seq", type=planner.positive(int), default=128, help="tokens per sequence (default: 128)")
    parser.add_argument("--precision", choices=("fp32", "mixed"), default="fp32",
                        help="fp32 (default), or mixed: FSDP2's bf16 parameters over fp32 shards (bf16 autocast for the others)")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--wrap", choices=("blocks", "blocks+embeddings"), default="blocks",
                        help="FSDP2's groups: each block and the root (default), or the embedding and head on their own too")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    args = parser.parse_args(argv)
    if (args.layers is None) != (args.hidden is None):
        parser.error("--layers and --hidden go together")
    if args.head != "auto" and not args.model:
        parser.error(f"--head {args.head} chooses the head of --model's config: the stack of --layers has none")
    args.gpus_per_node = args.gpus_per_node or min(8, args.gpus)
    return args, parser


def main(argv=None) -> None:
    args, parser = parse_args(argv)
    try:
        config = planner.load_config(args.model) if args.model else None
        results = [simulate(Case(strategy, args.gpus, args.gpus_per_node, args.layers, args.hidden, config, args.batch,
                                 args.seq, args.precision, args.recompute, args.wrap, args.head)) for strategy in args.strategy]
    except (SimulationError, planner.PlanError) as error:
        parser.exit(2, f"error: {error}\n")
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{results[0]['params']:,} parameters in {results[0]['model_class']} at {args.gpus} simulated ranks, "
          f"{args.precision}; per rank, measured (planned), MB = 10^6 bytes")
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "gathered_bytes", "peak_bytes")
    print("| strategy | params MB | grads MB | optimizer MB | activations MB | gathered + buffers MB | peak MB "
          "| peak / planned | collectives per step |")
    print("|---|" + "---:|" * (len(keys) + 1) + "---|")
    for result in results:
        measured, plan = ({**result[side], "gathered_bytes": gathered_and_buffers(result[side])} for side in ("measured", "planned"))
        cells = [megabytes(measured[key]) + ("" if plan[key] is None else f" ({megabytes(plan[key])})") for key in keys]
        calls = ", ".join(f"{c['count']} {c['kind'].replace('_', '-')}" for c in measured["collectives"])
        ratio = f"{measured['peak_bytes'] / plan['peak_bytes']:.2f}"
        print(f"| {planner.STRATEGIES[result['strategy']]} | " + " | ".join(cells) + f" | {ratio} | {calls} |")


if __name__ == "__main__":
    sys.exit(main())
