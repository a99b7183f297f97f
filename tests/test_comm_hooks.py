"""Fewer bytes on the wire (common/lessons/comm_hooks.py, common/lessons/local_sgd.py): what each method sends, counted
as the tensors are handed to all_reduce, and what it computes.

One real gloo group of 3 processes runs every case (one start-up instead of one per case); the tests
below read its results. Each rank feeds its own batches. The byte counts are those of BasicNet, the
chapter's model, in fp32 as the scripts train it; exactness is claimed in float64, on a small
convolutional model (a 4×9 and a 10×144 matrix, two vectors) that keeps those cases fast.
"""
import copy
import runpy
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import ROOT, TEST_IMAGES, TORCHRUN, assert_ran, run_as_user
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.comm_hooks import AllReduceCounter, bucket_cap_mb, gradient_bytes, powersgd_numel, register_comm_hook
from common.lessons.local_sgd import OuterOptimizer
from common.mnist import BasicNet
from common.spawn import run_in_process_group

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark imports its neighbour plotting
import comm_hooks as benchmark  # noqa: E402

WORLD_SIZE = 3
STEPS = 4  # PowerSGD compresses from step 2 on (START_POWERSGD): steps 2 and 3 are compressed
FULL_RANK = 10_000  # above every matrix's min(n, m): PowerSGD's factors span the whole gradient


def small_model():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10), nn.LogSoftmax(dim=1))


MODELS = {"BasicNet": (BasicNet, 28), "small": (small_model, 8)}  # the model, and its images' side


def batch(rank, step, dtype, side):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data, new each step
    return torch.randn(2, 1, side, side, generator=generator, dtype=dtype), torch.randint(0, 10, (2,), generator=generator)


def model_for(rank, name, dtype):
    torch.manual_seed(rank)  # different weights per rank: DDP and OuterOptimizer must copy rank 0's
    return MODELS[name][0]().to(dtype).eval()  # no dropout: the reference and the method see the same arithmetic


def hook_run(rank, name, dtype, hook, powersgd_rank=1, min_compression_rate=2):
    """STEPS backward passes of DDP with `hook` beside plain DDP, on the same weights and data: each step's
    bytes and all-reduce calls, and the largest gap between the two models' gradients, relative to their size."""
    module = model_for(rank, name, dtype)
    plain = DDP(copy.deepcopy(module))
    model = DDP(module, bucket_cap_mb=bucket_cap_mb(hook, module))
    register_comm_hook(model, hook, powersgd_rank, min_compression_rate=min_compression_rate)
    sent, per_step, gaps = AllReduceCounter(), [], []
    for step in range(STEPS):
        images, labels = batch(rank, step, dtype, MODELS[name][1])
        before = (sent.bytes, sent.calls)
        with sent:
            F.nll_loss(model(images), labels).backward()
        per_step.append((sent.bytes - before[0], sent.calls - before[1]))
        F.nll_loss(plain(images), labels).backward()
        gaps.append(max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                        for a, b in zip(model.parameters(), plain.parameters())))
        for param in [*model.parameters(), *plain.parameters()]:
            param.grad = None
    return {"per_step": per_step, "gaps": gaps}


def replicas_equal(model) -> bool:
    """Whether every rank holds the same weights (each rank's weights gathered and compared)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every_rank = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, flat)
    return all(torch.equal(every_rank[0], other) for other in every_rank[1:])


def outer_run(rank, sync_every, steps, lr=1.0, momentum=0.0):
    """Inner SGD on each replica, synchronised by OuterOptimizer, beside DDP with the same SGD, in float64:
    the largest weight gap to DDP at the end, whether the replicas agreed after each step, the
    collectives and bytes, and the weights (and their mean over ranks) just before the first sync."""
    module = model_for(rank, "small", torch.float64)
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    outer = OuterOptimizer(module, sync_every, lr, momentum)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    sent, agreed, first_round, after_first_round = AllReduceCounter(), [], None, None
    for step in range(steps):
        images, labels = batch(rank, step, torch.float64, MODELS["small"][1])
        for model, opt in ((module, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            F.nll_loss(model(images), labels).backward()
            opt.step()
        if first_round is None and outer.pending + 1 == sync_every:
            local = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            mean = local.clone()
            dist.all_reduce(mean)
            first_round = {"start": outer.start.clone(), "mean": mean / dist.get_world_size()}
        with sent:
            outer.inner_step_done()
        if after_first_round is None and step + 1 == sync_every:
            after_first_round = outer.start.clone()
        agreed.append(replicas_equal(module))
    with sent:
        outer.sync()
    agreed.append(replicas_equal(module))
    gap = max((a - b).abs().max().item() for a, b in zip(module.parameters(), reference.parameters()))
    return {"gap_to_ddp": gap, "agreed": agreed, "calls": sent.calls, "bytes": sent.bytes,
            "first_round": first_round, "after_first_round": after_first_round,
            "model_bytes": gradient_bytes(module)}


def every_case(rank, world_size):
    fp32 = {hook: hook_run(rank, "BasicNet", torch.float32, hook) for hook in ("none", "fp16", "bf16")}
    fp32.update({f"powersgd{r}": hook_run(rank, "BasicNet", torch.float32, "powersgd", r) for r in (1, 4)})
    float64 = {"full_rank": hook_run(rank, "small", torch.float64, "powersgd", FULL_RANK, min_compression_rate=1e-3),
               "rank1": hook_run(rank, "small", torch.float64, "powersgd", 1)}
    outer = {"diloco_h1_is_ddp": outer_run(rank, 1, 3), "h2_is_not_ddp": outer_run(rank, 2, 3),
             "local_sgd_h3": outer_run(rank, 3, 7), "nesterov_round": outer_run(rank, 3, 3, lr=0.7, momentum=0.9)}
    return {"fp32": fp32, "float64": float64, "outer": outer,
            "shapes": [tuple(p.shape) for p in BasicNet().parameters()],
            "fp32_bytes": gradient_bytes(BasicNet())}


@pytest.fixture(scope="module")
def results():
    return run_in_process_group(every_case, WORLD_SIZE, timeout=300)


def test_none_sends_what_plain_ddp_sends(results):
    """allreduce_hook is DDP's own reduction written in Python: every gradient, in fp32, and the same average
    up to fp32 rounding (it divides each gradient by N before the sum)."""
    run = results["fp32"]["none"]
    assert [sent for sent, _ in run["per_step"]] == [results["fp32_bytes"]] * STEPS == [4 * 1_199_882] * STEPS
    assert max(run["gaps"]) < 1e-6


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_16_bit_hooks_send_half_and_round(results, hook):
    run = results["fp32"][hook]
    assert [sent for sent, _ in run["per_step"]] == [results["fp32_bytes"] // 2] * STEPS
    assert all(0 < gap < 2e-2 for gap in run["gaps"])  # rounded (not exact), to 16 bits


@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_sends_r_times_n_plus_m_per_matrix(results, rank):
    """Steps 0 and 1 plain; from step 2 on, r(n+m) per n×m matrix and vectors whole, in three all-reduces
    (the uncompressed tensors, then the Ps, then the Qs) of the one bucket. At rank 4 conv1's 32×9
    gradient would shrink only 1.8 times, so it is sent whole: the formula follows torch's rule."""
    expected = 4 * sum(powersgd_numel(shape, rank) for shape in results["shapes"])
    assert results["fp32"][f"powersgd{rank}"]["per_step"] == [(results["fp32_bytes"], 1)] * 2 + [(expected, 3)] * 2
    assert expected == 4 * {1: 41 + 32 + 352 + 64 + 9344 + 128 + 138 + 10,
                            4: 288 + 32 + 4 * 352 + 64 + 4 * 9344 + 128 + 4 * 138 + 10}[rank]


def test_powersgd_at_full_rank_is_the_exact_average(results):
    """Every gradient compressed (min_compression_rate 1e-3) at a rank no matrix reaches: P spans the
    averaged gradient's columns, and P·Pᵀ·M = M. Negative control: at rank 1 the gradient is not the average."""
    full, rank1 = results["float64"]["full_rank"], results["float64"]["rank1"]
    compressed = 8 * (4 * (4 + 9) + 1 * (4 + 1) + 10 * (10 + 144) + 1 * (10 + 1))  # min(n, m)·(n + m) each
    assert [sent for sent, _ in full["per_step"][2:]] == [compressed] * 2  # it did compress every tensor
    assert max(full["gaps"]) < 1e-10
    assert min(rank1["gaps"][2:]) > 1e-2 and max(rank1["gaps"][:2]) < 1e-12  # compressed steps only


def test_diloco_with_h_1_inner_sgd_and_outer_sgd_at_lr_1_is_ddp(results):
    """Negative control: synchronising every 2 steps is not DDP."""
    outer = results["outer"]
    assert outer["diloco_h1_is_ddp"]["gap_to_ddp"] < 1e-12
    assert outer["h2_is_not_ddp"]["gap_to_ddp"] > 1e-6


def test_local_sgd_communicates_once_every_h_steps(results):
    """7 steps at H = 3: synchronised after steps 3 and 6 and at the end, one all-reduce of the model each;
    between them the replicas differ (they do not communicate), after each they agree."""
    run = results["outer"]["local_sgd_h3"]
    assert run["calls"] == 3 and run["bytes"] == 3 * run["model_bytes"]
    assert run["agreed"] == [False, False, True, False, False, True, False, True]


def test_local_sgd_is_the_mean_and_diloco_a_nesterov_step_on_the_pseudo_gradient(results):
    """Outer SGD at lr 1 without momentum lands on the mean of the replicas; Nesterov momentum 0.9 at
    lr 0.7, from an empty momentum buffer, moves start by 0.7·(1 + 0.9)·Δ, Δ = start − that mean."""
    local = results["outer"]["local_sgd_h3"]
    torch.testing.assert_close(local["after_first_round"], local["first_round"]["mean"], rtol=0, atol=1e-12)
    nesterov = results["outer"]["nesterov_round"]
    start, mean = nesterov["first_round"]["start"], nesterov["first_round"]["mean"]
    torch.testing.assert_close(nesterov["after_first_round"], start - 0.7 * 1.9 * (start - mean), rtol=0, atol=1e-12)
    assert not torch.allclose(nesterov["after_first_round"], mean)  # not the plain average


# ---- the scripts, as a user runs them ----

SCALE_OUT = ROOT / "src" / "ch4" / "scale_out"


@pytest.fixture(scope="module")
def script_runs(tiny_mnist):
    """Each script once under torchrun, 2 processes, 192 images at a global batch of 6: 32 steps."""
    common = ["--data-dir", tiny_mnist, "--batch-size", "6", "--dist-timeout", 60]
    return {"powersgd4": run_as_user(*TORCHRUN, "--nproc_per_node=2", SCALE_OUT / "mnist_comm_hooks.py", *common,
                                     "--comm-hook", "powersgd", "--powersgd-rank", "4"),
            "diloco": run_as_user(*TORCHRUN, "--nproc_per_node=2", SCALE_OUT / "mnist_diloco.py", *common,
                                  "--sync-every", "5")}


def test_comm_hooks_script_under_torchrun(script_runs):
    """The first 2 steps plain (4,799,528 B), then PowerSGD at rank 4 (159,432 B): a mean of 449,438 B per step."""
    assert_ran(script_runs["powersgd4"], "comm hook powersgd, rank 4", "mean of 32 steps): 449,438 B",
               "plain DDP's 4,799,528 B", f"over {TEST_IMAGES} images")


def test_diloco_script_under_torchrun(script_runs):
    """At H = 5: synchronised 6 times, and once more at the end of the epoch."""
    assert_ran(script_runs["diloco"], f"mean of 32 steps): {7 * 4_799_528 / 32:,.0f} B", f"over {TEST_IMAGES} images")


def test_the_benchmark_reads_the_runs_and_draws_them(script_runs, tmp_path):
    """benchmarks/comm_hooks.py's table and plot, from these two runs' own output."""
    results = {name: benchmark.parse(run.stdout) for name, run in script_runs.items()}
    assert results["powersgd4"]["bytes"] == 449_438 and results["diloco"]["bytes"] == round(7 * 4_799_528 / 32)
    rows = benchmark.table(results).splitlines()
    assert rows[2].startswith("| powersgd4 | 449.4 kB | 1.0x less |") and rows[3].startswith("| diloco | 1,049.9 kB | 0.4x less |")
    benchmark.plot(results, "test", str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("script, flags, sentence", [
    ("mnist_comm_hooks.py", ["--comm-hook", "int8"], "argument --comm-hook: invalid choice: 'int8'"),
    ("mnist_comm_hooks.py", ["--powersgd-rank", "0"], "argument --powersgd-rank: must be a positive whole number, not 0"),
    ("mnist_diloco.py", ["--sync-every", "0"], "argument --sync-every: must be a positive whole number, not 0"),
])
def test_bad_input_is_one_sentence(capsys, monkeypatch, script, flags, sentence):
    """The script's own main(), in this process (its first act is to read the flags; a fresh interpreter
    would spend seconds importing torch to say the same): usage, then the one sentence, exit 2."""
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(SCALE_OUT / script), run_name="__main__")
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines()[-1].startswith(f"{script}: error: {sentence}")
    assert "Traceback" not in stderr
