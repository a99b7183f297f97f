"""ZeRO stages 1-3 (common/lessons/zero.py) train exactly as DDP does, while each rank holds only its shards.

Real gloo groups of 2 and 3 processes. Each rank starts from different weights (both wrappers must
copy rank 0's), feeds its own batches, and after a few AdamW steps the full parameters of every
stage equal DDP's. The model's unit sizes (32, 8 and 15 numbers) do not divide by 2 or 3, so the
padded shards are exercised. Dropout is off (eval mode), so that both see the same arithmetic.
Stage 3 also trains a model one of whose units returns a tuple (or a dict) as DDP does. A unit no forward uses
stays as it was at every stage, as under DDP with find_unused_parameters=True; one used in part is refused.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.zero import STAGES, ZeRO, _Unit
from common.spawn import run_in_process_group

STEPS = 3


def small_model():
    return nn.Sequential(nn.Linear(7, 4), nn.ReLU(), nn.LayerNorm(4), nn.Linear(4, 3))  # 32, 8 and 15 numbers


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def batch_for(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data, new each step
    return torch.randn(5, 7, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def state_numel(optimizer) -> int:
    """Numbers held in AdamW's moments (exp_avg, exp_avg_sq), over all the parameters it steps."""
    return sum(state[key].numel() for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq"))


def train_against_ddp(rank, world_size, stage, local_gradients_only=False):
    """STEPS steps of ZeRO at `stage` beside DDP, on the same data; what each holds afterwards."""
    if local_gradients_only:  # a planted bug: each rank steps on its own gradient, never averaged
        def keep_local_shard(unit):
            flat_grad = torch.cat([p.grad.reshape(-1) for p in unit.params])
            flat_grad = F.pad(flat_grad, (0, unit.flat.numel() - flat_grad.numel()))
            unit.shard.grad = flat_grad.chunk(world_size)[rank].clone()
            for param in unit.params:
                param.grad = None
        _Unit.reduce_scatter_gradients = keep_local_shard
    torch.manual_seed(rank)  # different weights per rank
    module = small_model().eval()
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = adamw(reference.parameters())
    ours = ZeRO(module, stage, adamw)
    reference_params = dict(zip(module.parameters(), reference.parameters()))  # the same objects, in order
    gap = torch.zeros(())
    for step in range(STEPS):
        inputs, labels = batch_for(rank, step)
        F.cross_entropy(ours(inputs), labels).backward()
        F.cross_entropy(reference(inputs), labels).backward()
        ours.step()
        reference_optimizer.step()
        for unit in ours.units:  # each shard's gradient is DDP's average, there: AdamW alone hides a missing / N
            flat = torch.cat([reference_params[p].grad.reshape(-1) for p in unit.params])
            expected = F.pad(flat, (0, unit.flat.numel() - flat.numel())).chunk(world_size)[rank]
            gap = torch.maximum(gap, (unit.shard.grad - expected).abs().max())
        ours.zero_grad()
        reference_optimizer.zero_grad()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    counts = torch.tensor([state_numel(ours.optimizer), sum(unit.shard.numel() for unit in ours.units)])
    every_rank = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(every_rank, counts)
    return {"gradient_gap": gap.item(), "ours": ours.full_parameters(), "ddp": [p.detach().clone() for p in reference.parameters()],
            "ddp_state": state_numel(reference_optimizer), "counts": [c.tolist() for c in every_rank],
            "param_storage": [p.untyped_storage().nbytes() for p in module.parameters()]}


class TupleLinear(nn.Linear):
    """A unit (a module with its own parameters) whose output is a tuple, both of whose tensors reach the loss."""

    def forward(self, inputs):
        hidden = super().forward(inputs)
        return hidden, hidden.tanh()


class DictLinear(nn.Linear):
    """The same with a dict (as transformers' layers return ModelOutputs)."""

    def forward(self, inputs):
        hidden = super().forward(inputs)
        return {"hidden": hidden, "gate": hidden.sigmoid()}


class NestedOutputModel(nn.Module):
    """The nested unit second, so that its backward needs its weight (for the gradient of its input)."""

    def __init__(self, unit: type[nn.Linear]):
        super().__init__()
        self.first, self.nested, self.norm, self.head = nn.Linear(7, 5), unit(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, inputs):
        output = self.nested(self.first(inputs))
        hidden, gate = output if isinstance(output, tuple) else (output["hidden"], output["gate"])
        return self.head(self.norm(hidden * gate))


def nested_outputs_against_ddp(rank, world_size, unit):
    """STEPS steps of ZeRO-3 beside DDP on a model whose second unit returns a tuple or a dict: both end
    weights, and how many times each unit was gathered in each backward."""
    torch.manual_seed(rank)
    module = NestedOutputModel(unit).eval()
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = adamw(reference.parameters())
    ours = ZeRO(module, 3, adamw)
    gathers = [0] * len(ours.units)
    for index, zero_unit in enumerate(ours.units):
        def counted(gather=zero_unit.gather, index=index):
            gathers[index] += 1
            gather()
        zero_unit.gather = counted
    gathers_in_backward = []
    for step in range(STEPS):
        inputs, labels = batch_for(rank, step)
        loss = F.cross_entropy(ours(inputs), labels)
        before = list(gathers)
        loss.backward()
        gathers_in_backward.append([after - was for after, was in zip(gathers, before)])
        ours.step()
        ours.zero_grad()
        F.cross_entropy(reference(inputs), labels).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return {"ours": ours.full_parameters(), "ddp": [p.detach().clone() for p in reference.parameters()],
            "gathers_in_backward": gathers_in_backward}


class WithUnusedParts(nn.Module):
    """Its middle unit: unused by forward (no gradient on any rank), or used partly (its bias, not its weight: the
    unit's first parameter gets no gradient, its second does)."""

    def __init__(self, partly: bool):
        super().__init__()
        self.first, self.middle, self.head, self.partly = nn.Linear(7, 4), nn.Linear(4, 4), nn.Linear(4, 3), partly

    def forward(self, inputs):
        hidden = self.first(inputs).relu()
        return self.head(hidden + self.middle.bias if self.partly else hidden)


def unused_parts_against_ddp(rank, world_size, stage):
    """STEPS steps of ZeRO beside DDP (find_unused_parameters=True) on a model with a unit forward never uses: both
    end weights, and where they started (rank 0's). Then a unit used partly: what step() raises."""
    torch.manual_seed(rank)
    module = WithUnusedParts(partly=False).eval()
    reference = DDP(copy.deepcopy(module), find_unused_parameters=True)
    reference_optimizer = adamw(reference.parameters())
    ours = ZeRO(module, stage, adamw)
    start = [p.detach().clone() for p in reference.parameters()]  # rank 0's, which DDP broadcast
    for step in range(STEPS):
        inputs, labels = batch_for(rank, step)
        for model, optimizer in ((ours, ours), (reference, reference_optimizer)):
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    result = {"ours": ours.full_parameters(), "ddp": [p.detach().clone() for p in reference.parameters()], "start": start}
    if stage < 3:  # ZeRO-3 holds a parameter only inside its module's forward: middle.bias alone is unsupported there
        partly, (inputs, labels) = ZeRO(WithUnusedParts(partly=True), stage, adamw), batch_for(rank, 0)
        F.cross_entropy(partly(inputs), labels).backward()
        with pytest.raises(RuntimeError) as refused:
            partly.step()
        result["refused"] = str(refused.value)
    return result


def misuse_is_an_error():
    with pytest.raises(ValueError, match="stage must be one of"):
        ZeRO(small_model(), 4, adamw)
    with pytest.raises(RuntimeError, match="call backward"):
        ZeRO(small_model(), 2, adamw).step()
    return True


def every_stage(rank, world_size):
    """All three stages in one process group (starting processes is the slow part), misuse, and last
    (it patches common.lessons.zero in these processes) the planted bug."""
    results = {"misuse": misuse_is_an_error(), **{stage: train_against_ddp(rank, world_size, stage) for stage in STAGES},
               **{f"unused {stage}": unused_parts_against_ddp(rank, world_size, stage) for stage in STAGES},
               **{unit.__name__: nested_outputs_against_ddp(rank, world_size, unit) for unit in (TupleLinear, DictLinear)}}
    return {**results, "local_gradients_only": train_against_ddp(rank, world_size, 2, local_gradients_only=True)}


@pytest.fixture(scope="module", params=[2, 3])
def every_stage_run(request):
    return request.param, run_in_process_group(every_stage, request.param, timeout=120)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_equals_ddp_and_keeps_only_its_shard(every_stage_run, stage):
    world_size, results = every_stage_run
    result = results[stage]
    assert result["gradient_gap"] < 1e-6
    for ours, ddp in zip(result["ours"], result["ddp"], strict=True):
        torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6)
    psi = sum(p.numel() for p in result["ddp"])  # 55 parameters
    assert result["ddp_state"] == 2 * psi  # DDP: both moments of every parameter on every rank
    shard_numels = []
    for state, shard_numel in result["counts"]:
        assert state == 2 * shard_numel  # each rank's moments cover its shards and nothing else
        shard_numels.append(shard_numel)
    assert len(set(shard_numels)) == 1  # equal shards ...
    assert psi <= world_size * shard_numels[0] < psi + 3 * world_size  # ... covering Ψ, padded by < N per unit
    if stage == 3:  # between steps, only the shards hold parameters
        assert result["param_storage"] == [0] * len(result["ddp"])


def test_without_averaging_the_gradients_the_comparison_fails(every_stage_run):
    result = every_stage_run[1]["local_gradients_only"]
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(result["ours"], result["ddp"]))
    assert result["gradient_gap"] > 1e-3


@pytest.mark.parametrize("unit", ["TupleLinear", "DictLinear"])
def test_stage_3_gathers_once_for_the_backward_of_a_unit_returning_a_tuple_or_dict(every_stage_run, unit):
    """Without the gather before backward, the unit's backward would read parameters already freed."""
    result = every_stage_run[1][unit]
    for ours, ddp in zip(result["ours"], result["ddp"], strict=True):
        torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6)
    assert result["gathers_in_backward"] == [[1, 1, 1, 1]] * STEPS  # each unit once per backward


def tiny_bert_stage_3(rank, world_size, folder):
    """On a real BERT: the hooks must fire around every layer; one layer's parameters in full at a time."""
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(rank)
    module = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3).eval()
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = adamw(reference.parameters())
    ours = ZeRO(module, 3, adamw)
    gathered_at_once = []
    for unit in ours.units:  # after ZeRO's own pre-hook: count the units whose full parameters exist
        unit.module.register_forward_pre_hook(lambda *_: gathered_at_once.append(
            sum(u.flat.untyped_storage().nbytes() > 0 for u in ours.units)))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        batch = {"input_ids": torch.randint(5, 30, (4, 9), generator=generator),
                 "labels": torch.randint(0, 3, (4,), generator=generator)}
        ours(**batch).loss.backward()
        ours.step()
        ours.zero_grad()
        reference(**batch).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return ours.full_parameters(), [p.detach().clone() for p in reference.parameters()], max(gathered_at_once)


def test_stage_3_on_a_bert_equals_ddp(tiny_bert):
    ours, ddp, most_gathered = run_in_process_group(tiny_bert_stage_3, 2, str(tiny_bert), timeout=120)
    for a, b in zip(ours, ddp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert most_gathered == 1


@pytest.mark.parametrize("stage", STAGES)
def test_a_unit_no_rank_uses_stays_as_it_was_and_the_others_train_as_ddp(every_stage_run, stage):
    """One process, and DDP with find_unused_parameters=True, leave a parameter without a gradient alone; so must
    every stage."""
    result = every_stage_run[1][f"unused {stage}"]
    for ours, ddp in zip(result["ours"], result["ddp"], strict=True):
        torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(now, start) for now, start in zip(result["ours"][2:4], result["start"][2:4], strict=True))
    assert not torch.equal(result["ours"][0], result["start"][0])  # the others trained


@pytest.mark.parametrize("stage", [1, 2])
def test_a_unit_used_in_part_is_refused_in_one_sentence(every_stage_run, stage):
    """Its weight without a gradient, its bias with one: stepping the flat shard would move the weight (AdamW's
    decay), where one process leaves it; every rank refuses, so none waits on the others."""
    assert every_stage_run[1][f"unused {stage}"]["refused"] == (
        "1 of 2 parameters of Linear got a gradient: ZeRO shards a module's parameters together and cannot step "
        "some of them alone; give the others requires_grad=False, or use them in forward")


def test_misuse_is_an_error(every_stage_run):
    assert every_stage_run[1]["misuse"]  # pytest.raises inside every rank
