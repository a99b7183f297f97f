"""HSDP (src/ch4/scale_out/mnist_hsdp.py): fully_shard over a 2-D mesh trains exactly as DDP does, with
the collectives the formula says, and evaluates over every test image.

One gloo group of 4 processes tries every mesh shape in turn, 2 x 2, 1 x 4 (plain FSDP) and 4 x 1 (no
sharding), each wrapped by the script's own shard() and trained beside DDP on the same batches (each
rank its own, dropout off so that both do the same arithmetic), then evaluated by the script's own
evaluate(). The same group runs the mixed-precision policy and the negative control: each node sharding
on its own, with no replicate dimension, so that nothing all-reduces across the nodes.

Counting collectives: a TorchDispatchMode sees every c10d operator a process group runs while it is
active (c10d._allgather_base_, c10d.allreduce_ and the like), called from Python or from C++, in
forward, in the backward hooks and in the optimizer step, with its process group and its tensors. It
counts what ran, not what an API was asked for, and needs no change to torch. Collectives on a group of
one process move nothing and are left out of the count (torch 2.15 still issues HSDP's all-reduce on a
replicate group of one, as a no-op; it skips the all-gather and reduce-scatter of a shard group of one).

The formula, per training step, for L wrapped layers on an R x S mesh (S > 1 and R > 1 as 1 or 0):
    all-gathers     2L · [S > 1]  (each layer's parameters, before its forward and again before its backward)
    reduce-scatters  L · [S > 1]  (each layer's gradients, within the shard group)
    all-reduces      L · [R > 1]  (each rank's 1/S of each layer's gradients, across the replicate group)
"""
import copy
import importlib.util
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import PYTHON, ROOT, TEST_IMAGES, assert_clear_error, offline_env
from test_fsdp import assembled
from test_lessons import INSTRUMENT, one_process_correct, printed_correct
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data.distributed import DistributedSampler

from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.samplers import DistributedEvalSampler
from common.spawn import run_in_process_group
from planner.plan import Link, communication, ring_seconds

SCRIPT = ROOT / "src" / "ch4" / "scale_out" / "mnist_hsdp.py"
WORLD_SIZE = 4
SHAPES = [(2, 2), (1, 4), (4, 1)]  # (replicas R, shards S)
LAYERS = 4  # conv1, conv2, fc1, fc2, each wrapped on its own
STEPS, BATCH, EVAL_BATCH = 3, 8, 16  # per rank; 101 test images over 4 ranks: 26 each, 2 batches
KINDS = {"c10d._allgather_base_": "all-gather", "c10d._reduce_scatter_base_": "reduce-scatter",
         "c10d.allreduce_": "all-reduce"}


class Collectives(TorchDispatchMode):
    """Each collective run while active: (kind, group size, dtype and numel of its largest tensor: the
    gathered output, the scattered input, the reduced tensor)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d."):
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            group = next(dist.ProcessGroup.unbox(a) for a in flat if isinstance(a, torch.ScriptObject))
            largest = max((a for a in flat if isinstance(a, torch.Tensor)), key=torch.Tensor.numel)
            self.calls.append((KINDS.get(name, name), group.size(), str(largest.dtype), largest.numel()))
        return func(*args, **(kwargs or {}))


def between_processes(calls):
    return [call for call in calls if call[1] > 1]


def load_script():
    spec = importlib.util.spec_from_file_location("mnist_hsdp", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def norm(tensors) -> float:
    return torch.sqrt(sum(t.float().square().sum() for t in tensors)).item()


def against_ddp(rank, world_size, script, data, mesh, policy=None):
    """STEPS AdamW steps of the script's HSDP beside DDP on the same batches, then the script's evaluation.

    Each step compares the gradients (in full, as this rank's shard group holds them) with DDP's, as
    ||ours - DDP's|| / ||DDP's|| over the whole model; at the end, the weights, and their distance from
    DDP's relative to how far DDP's moved. Collectives are counted in forward, backward and the step."""
    train_set, test_set = data
    torch.manual_seed(0)
    module = BasicNet().eval()  # the same start on every rank (the script's broadcast); dropout off
    start = [p.detach().clone() for p in module.parameters()]
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = script.shard(module, mesh, policy or MixedPrecisionPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps, gradient_errors, loss_gaps = [], [], []
    for step in range(STEPS):
        first = (step * world_size + rank) * BATCH
        images, labels = train_set.images[first:first + BATCH], train_set.labels[first:first + BATCH]
        with Collectives() as forward_backward:
            loss = F.nll_loss(model(images), labels)
            loss.backward()
        reference_loss = F.nll_loss(reference(images), labels)
        reference_loss.backward()
        ours, theirs = [p.grad.full_tensor() for p in model.parameters()], [p.grad for p in reference.parameters()]
        gradient_errors.append(norm([a - b for a, b in zip(ours, theirs, strict=True)]) / norm(theirs))
        loss_gaps.append((loss.float() - reference_loss).abs().item())
        with Collectives() as optimizer_step:
            optimizer.step()
            optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        steps.append(forward_backward.calls + optimizer_step.calls)
    full = [p.full_tensor() for p in model.parameters()]  # this rank's shard group's model
    ddp = [p.detach().clone() for p in reference.parameters()]
    gaps = torch.tensor([max(gradient_errors), max((a - b).abs().max().item() for a, b in zip(full, ddp, strict=True))])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # over every shard group: replicas that drifted apart show
    loader = mnist_loader(test_set, EVAL_BATCH, DistributedSampler(test_set, shuffle=False))
    with Collectives() as evaluation:
        correct, seen = script.evaluate(model, loader, torch.device("cpu"), "fp32", len(DistributedEvalSampler(test_set)))
    return {"gradient_error": gaps[0].item(), "gap": gaps[1].item(), "gradient_errors": gradient_errors, "loss_gaps": loss_gaps,
            "weight_error": norm([a - b for a, b in zip(full, ddp)]) / norm([b - a for a, b in zip(start, ddp)]),
            "steps": steps, "evaluation": evaluation.calls, "printed": sum_across_ranks(correct, seen, device="cpu"), "full": full, "ddp": ddp}


def every_mesh(rank, world_size, data_dir):
    """Every mesh shape in one process group (starting processes is the slow part), then bf16 and the control."""
    script = load_script()
    data = load_mnist(data_dir)
    meshes = {shape: init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) for shape in SHAPES}
    results = {shape: against_ddp(rank, world_size, script, data, meshes[shape]) for shape in SHAPES}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results["bf16"] = against_ddp(rank, world_size, script, data, meshes[2, 2], bf16)
    results["no replicate"] = against_ddp(rank, world_size, script, data, meshes[2, 2]["shard"])  # each node alone
    return {**results, "layouts": {shape: mesh.mesh.tolist() for shape, mesh in meshes.items()}}


@pytest.fixture(scope="module")
def meshes(tiny_mnist):
    return run_in_process_group(every_mesh, WORLD_SIZE, str(tiny_mnist), timeout=240)


def expected_per_step(replicas, shards, psi):
    """The formula: (kind, group size) -> count, and the numbers each kind moves in one step."""
    counts = {("all-gather", shards): 2 * LAYERS, ("reduce-scatter", shards): LAYERS} if shards > 1 else {}
    if replicas > 1:
        counts[("all-reduce", replicas)] = LAYERS
    numel = {"all-gather": 2 * psi, "reduce-scatter": psi, "all-reduce": psi // shards}
    return counts, {kind: numel[kind] for kind, _ in counts}


def padded_psi(shards):
    """Ψ with each parameter's rows padded to a multiple of S, as fully_shard pads its pieces."""
    return sum(-(-p.shape[0] // shards) * shards * p[0].numel() for p in BasicNet().parameters())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_every_mesh_trains_as_ddp(meshes, shape):
    """Every step's gradients equal DDP's to fp32 rounding (sums in another order), on every rank; the weights after
    3 AdamW steps within 1e-4 of DDP's, and 1e-5 of the distance they moved. AdamW divides each gradient element
    by its own running root mean square, so for an element whose gradient is near zero the rounding becomes a
    visible part of a step: about 7e-6 here, where a missing average moves the weights by 5e-2 (the negative
    control below)."""
    result = meshes[shape]
    assert result["gradient_error"] < 1e-6  # about 1e-7 here; fp32's epsilon is 1.2e-7
    assert result["gap"] < 1e-4 and result["weight_error"] < 1e-5
    torch.manual_seed(0)
    assert not all(torch.equal(a, b) for a, b in zip(result["ddp"], BasicNet().parameters()))  # it trained


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_collectives_per_step_match_the_formula(meshes, shape):
    replicas, shards = shape
    counts, numel = expected_per_step(replicas, shards, padded_psi(shards))
    for calls in meshes[shape]["steps"]:  # every step, rank 0's
        calls = between_processes(calls)
        assert Counter((kind, size) for kind, size, _, _ in calls) == counts
        moved = Counter()
        for kind, _, _, count in calls:
            moved[kind] += count
        assert moved == numel


def test_hsdp_moves_what_the_plan_assumes(meshes):
    """planner/plan.py's HSDP terms (FSDP within a node of S, each GPU's 1/S of the gradients all-reduced across
    the R nodes), priced on a unit link, equal the same price of the collectives that ran on the 2 x 2 mesh."""
    unit = Link("unit", 1.0, 0.0, per_node=8)
    psi = sum(p.numel() for p in BasicNet().parameters())  # divides by 2 in every row: no padding
    across = within = 0.0
    for kind, size, _, count in between_processes(meshes[2, 2]["steps"][0]):
        seconds = ring_seconds(kind.replace("-", "_"), 4 * count, size, unit)
        across, within = (across + seconds, within) if kind == "all-reduce" else (across, within + seconds)
    planned_across, planned_within, _ = communication("hsdp", psi, WORLD_SIZE, 2, "fp32", unit, unit)
    assert across > 0 and (planned_across, planned_within) == (pytest.approx(across), pytest.approx(within))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_evaluation_is_exact_over_every_test_image(meshes, tiny_mnist, shape):
    result = meshes[shape]
    correct, seen = result["printed"]
    assert seen == TEST_IMAGES and correct == one_process_correct(result["full"], tiny_mnist)
    batches = -(-(-(-TEST_IMAGES // WORLD_SIZE)) // EVAL_BATCH)  # DistributedSampler's 26 per rank, in batches of 16
    gathers = [call for call in between_processes(result["evaluation"]) if call[0] == "all-gather"]
    assert len(gathers) == (LAYERS * batches if shape[1] > 1 else 0)  # each layer, each batch: forward only


def test_the_figure_draws_the_mesh_torch_builds(meshes):
    """figures/hsdp_mesh.py places rank r at (r // S, r % S): what init_device_mesh builds, for every shape."""
    sys.path.insert(0, str(ROOT / "figures"))
    import hsdp_mesh
    assert all(hsdp_mesh.layout(*shape) == meshes["layouts"][shape] for shape in SHAPES)


def test_without_the_replicate_all_reduce_the_comparison_fails(meshes):
    """The negative control: each node shards on its own (a 1-D mesh of its 2 ranks), so the two halves of
    the global batch never meet; the weights leave DDP's, and the count lacks the formula's all-reduces."""
    result = meshes["no replicate"]
    assert result["gradient_error"] > 0.1 and result["gap"] > 1e-3 and result["weight_error"] > 0.1
    counts, _ = expected_per_step(2, 2, padded_psi(2))
    assert Counter((kind, size) for kind, size, _, _ in between_processes(result["steps"][0])) != counts
    assert all(kind != "all-reduce" for kind, *_ in between_processes(result["steps"][0]))


def test_bf16_parameters_with_fp32_reduction(meshes):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the parameters travel in bf16, the
    gradients in fp32, and the model stays near fp32 DDP's (docs/hsdp.md states the bounds)."""
    result = meshes["bf16"]
    dtypes = {(kind, dtype) for kind, _, dtype, _ in between_processes(result["steps"][0])}
    assert dtypes == {("all-gather", "torch.bfloat16"), ("reduce-scatter", "torch.float32"), ("all-reduce", "torch.float32")}
    assert all(full.dtype == torch.float32 for full in result["full"])  # AdamW steps fp32 pieces
    assert 1e-3 < result["gradient_errors"][0] < 0.2 and max(result["loss_gaps"]) < 0.1  # bf16 for real, and near


def test_a_mesh_that_does_not_divide_the_processes_is_one_sentence(tmp_path):
    """Checked before any process group: the variables torchrun sets are all the check reads."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    result = subprocess.run([PYTHON, SCRIPT, "--data-dir", tmp_path, "--replicas", "3"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=offline_env(env))
    assert_clear_error(result, "--replicas 3 must divide the 4 processes into equal shard groups; pick a divisor of 4")
    assert len(result.stderr.strip().splitlines()) == 1


def test_two_nodes_as_the_header_says(tiny_mnist, tmp_path):
    """Two torchrun agents (two "nodes" of 2 processes) meet by c10d rendezvous; the default mesh is then
    2 x 2, one shard group per node; the replicas end equal, and the printed accuracy is one process's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the rendezvous, on a port the kernel picks
    command = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{store.port}", "--rdzv_conf=is_host=false",  # both agents join the test's store
               "--rdzv_id=hsdp-test", INSTRUMENT, tmp_path, SCRIPT,
               "--data-dir", tiny_mnist, "--precision", "fp32", "--batch-size", "32", "--dist-timeout", "60"]
    nodes = [subprocess.Popen([str(a) for a in command], cwd=ROOT, env=offline_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    stdout = "".join(out for out, _ in outputs)
    assert "mesh (replicate, shard) = 2 x 2: shard groups (rows) [[0, 1], [2, 3]]" in stdout
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    for piece, replica in zip(ranks[0]["final"] + ranks[1]["final"], ranks[2]["final"] + ranks[3]["final"]):
        assert torch.equal(piece, replica)  # the same GPU of each node holds the same piece
    full = assembled(ranks[:2], "final")
    assert f"over {TEST_IMAGES} images" in stdout
    assert printed_correct(stdout, TEST_IMAGES, "images") == one_process_correct(full, tiny_mnist)
