"""DeepSpeed's ZeRO stages train what DDP and common/zero.py train, and its rungs run, resume and refuse as the page says.

The equality runs in real gloo groups of 2 and 3 processes: each rank starts from its own weights
(the engine must copy rank 0's, as DDP does), feeds its own batches, and after STEPS AdamW steps
every stage's full parameters are compared with DDP's and with common/zero.py's of the same stage.
The tolerance is 1e-6 absolute (plus 1e-5 relative), as tests/test_zero.py's: the stages sum the
same gradients in another order (flat buckets, a reduce-scatter instead of an all-reduce), which
moves a weight of order 1 by a few float32 ulps (measured: at most 3e-8 after 5 steps). The
negative control is DeepSpeed's own default: without "gradient_clipping": 0 the engine clips at 1.0,
the inputs are scaled so that two steps' gradient norms exceed 1, and the weights end 8e-4 apart.
"""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.spawn import free_port, run_in_process_group
from common.zero import ZeRO
from conftest import PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_clear_error, assert_ran, run_as_user
from test_lessons import one_process_correct

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra: pip install -e '.[deepspeed]'")

STEPS = 5
STAGES = (0, 1, 2, 3)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
SHARDED = ROOT / "src" / "ch4" / "sharded"
CRASH = ROOT / "tests" / "crash.py"


def small_model():
    return nn.Sequential(nn.Linear(7, 4), nn.ReLU(), nn.LayerNorm(4), nn.Linear(4, 3))  # 32, 8 and 15 numbers


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def batch_for(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data, new each step
    return 5 * torch.randn(5, 7, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def train_beside_ddp(rank, world_size, stage, config_extra):
    """STEPS steps of a DeepSpeed engine at `stage`, of DDP and of common/zero.py, on the same data; full weights."""
    torch.manual_seed(rank)  # different weights per rank
    module = small_model().eval()  # no dropout: the same arithmetic in all three
    reference = DDP(copy.deepcopy(module))
    reference_optimizer = adamw(reference.parameters())
    ours = ZeRO(copy.deepcopy(module), stage, adamw) if stage else None
    config = {"train_batch_size": 5 * world_size, "train_micro_batch_size_per_gpu": 5, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, **config_extra}
    engine, *_ = deepspeed.initialize(model=module, optimizer=adamw(module.parameters()), config=config)
    for step in range(STEPS):
        inputs, labels = batch_for(rank, step)
        engine.backward(F.cross_entropy(engine(inputs), labels))
        engine.step()
        F.cross_entropy(reference(inputs), labels).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        if ours:
            F.cross_entropy(ours(inputs), labels).backward()
            ours.step()
            ours.zero_grad()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: all-gathered; else a no-op
        full = [p.detach().clone() for p in engine.module.parameters()]
    return {"deepspeed": full, "ddp": [p.detach().clone() for p in reference.parameters()],
            "zero": ours.full_parameters() if ours else None}


def every_stage(rank, world_size):
    """All four stages, then the negative control, in one process group (starting processes is the slow part)."""
    results = {stage: train_beside_ddp(rank, world_size, stage, {"gradient_clipping": 0.0}) for stage in STAGES}
    return {**results, "default clipping": train_beside_ddp(rank, world_size, 2, {})}


@pytest.fixture(scope="module", params=[2, 3])
def every_stage_run(request):
    return run_in_process_group(every_stage, request.param, timeout=180)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_trains_ddps_weights_and_zero_pys(every_stage_run, stage):
    result = every_stage_run[stage]
    for ours, ddp in zip(result["deepspeed"], result["ddp"], strict=True):
        torch.testing.assert_close(ours, ddp, **TOLERANCE)
    if stage:
        for ours, by_hand in zip(result["deepspeed"], result["zero"], strict=True):
            torch.testing.assert_close(ours, by_hand, **TOLERANCE)


def test_deepspeeds_default_clipping_breaks_the_equality(every_stage_run):
    result = every_stage_run["default clipping"]
    gap = max((a - b).abs().max().item() for a, b in zip(result["deepspeed"], result["ddp"]))
    assert gap > 100 * TOLERANCE["atol"], gap


def run_rung(*flags, processes=3, launcher=TORCHRUN, crash=None, timeout=240, env_extra=None):
    script = [CRASH, crash, SHARDED / "mnist_deepspeed.py"] if crash else [SHARDED / "mnist_deepspeed.py"]
    return run_as_user(*launcher, f"--nproc_per_node={processes}", *script, *flags, "--dist-timeout", "60",
                       env_extra=env_extra, timeout=timeout)


def final_weights(folder):
    return list(torch.load(folder / "final.pt", weights_only=True).values())


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_of_the_rung_counts_every_test_image_once(tiny_mnist, tmp_path, stage):
    result = run_rung("--data-dir", tiny_mnist, "--batch-size", "48", "--precision", "fp32", "--zero-stage", str(stage),
                      "--checkpoint-dir", tmp_path)
    assert_ran(result, f"ZeRO stage {stage}, global batch 48 = 3 x 16", f"final weights in {tmp_path / 'final.pt'}")
    printed = round(float(re.search(rf"accuracy ([\d.]+)% over {TEST_IMAGES} images", result.stdout).group(1)) * TEST_IMAGES / 100)
    assert printed == one_process_correct(final_weights(tmp_path), tiny_mnist)


def resumable(folder, data, crash="none", restarts=1):
    """2 epochs of 6 steps (192 images, global batch 33 = 3 x 11), a checkpoint every 4 steps, ZeRO-3."""
    return run_rung("--data-dir", data, "--batch-size", "33", "--epochs", "2", "--precision", "fp32", "--zero-stage", "3",
                    "--checkpoint-dir", folder, "--checkpoint-every", "4", crash=crash,
                    launcher=[*TORCHRUN, f"--max-restarts={restarts}"], env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def checkpoint_tensors(folder) -> list[torch.Tensor]:
    """final.pt, the fp32 masters of the newest checkpoint as DeepSpeed's zero_to_fp32 puts them back together,
    and every other tensor of it (every rank's file: AdamW's moments, the loss scaler). The masters' flat
    partitions themselves are left out: ZeRO-3 pads each parameter's piece to a multiple of the world size
    and never writes the padding, so it holds whatever the memory held (seen: 1e-43 in one run, -2e27 in
    the other, at the same places, every real number equal)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from test_resume import tensors_in
    newest = folder / (folder / "latest").read_text().strip()
    tensors = final_weights(folder) + list(get_fp32_state_dict_from_zero_checkpoint(str(folder)).values())
    for path in sorted(newest.glob("*.pt")):
        state = torch.load(path, weights_only=False)
        state.pop("rng", None)  # client_state: each rank's random state, not tensors of the model
        state.get("optimizer_state_dict", {}).pop("fp32_flat_groups", None)
        tensors += tensors_in(state)
    return tensors


@pytest.fixture(scope="module")
def uninterrupted(tiny_mnist, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed-uninterrupted")
    assert_ran(resumable(folder, tiny_mnist), "over 101 images")
    return checkpoint_tensors(folder)


@pytest.mark.parametrize("crash, bitwise", [("kill-rank1-after-step10", True),
                                            ("kill-rank1-after-step10,forget-rng", False)])  # the control: dropout masks differ
def test_a_killed_run_resumes_bitwise_from_the_engines_checkpoint(uninterrupted, tiny_mnist, tmp_path, crash, bitwise):
    result = resumable(tmp_path, tiny_mnist, crash)
    assert_ran(result, "resumed at step 8: epoch 1, 66 samples into it", "over 101 images")
    assert sorted(path.name for path in tmp_path.glob("step-*")) == ["step-12", "step-8"]  # resumed from step 8
    resumed = checkpoint_tensors(tmp_path)
    same = len(resumed) == len(uninterrupted) and all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))
    assert same == bitwise


def test_deepspeeds_own_launcher_runs_the_rung(tiny_mnist, tmp_path):
    launcher = [str(Path(PYTHON).with_name("deepspeed")), "--num_gpus", "3"]  # on a CPU it counts NUMA nodes unless told
    result = run_as_user(*launcher, SHARDED / "mnist_deepspeed.py", "--data-dir", tiny_mnist, "--batch-size", "48",
                         "--precision", "fp32", "--zero-stage", "1", "--checkpoint-dir", tmp_path, "--dist-timeout", "60",
                         env_extra={"DS_ACCELERATOR": "cpu"}, timeout=240)  # it appends --local_rank=R, which the rung accepts
    assert_ran(result, "3 processes on cpu, fp32, ZeRO stage 1, global batch 48 = 3 x 16", f"over {TEST_IMAGES} images")


def one_process(*flags, env_extra=None, script="mnist_deepspeed.py", data=()):
    """The rung as rank 0 of 1 under plain python, so that the error is the script's alone (torchrun adds its own traceback)."""
    environment = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    return run_as_user(PYTHON, SHARDED / script, *data, *flags, env_extra=environment, timeout=120)


def write_json(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case, phrase", [
    ("fp16", "--precision fp16 needs a GPU"),
    ("stage 4", "argument --zero-stage: invalid choice: 4"),
    ("stage 4 in the file", "sets ZeRO stage 4; DeepSpeed has stages 0, 1, 2 and 3"),
    ("two stages", "sets ZeRO stage 2 and --zero-stage says 3: keep one of the two"),
    ("batch sizes", "train_batch_size 64, train_micro_batch_size_per_gpu 32, gradient_accumulation_steps 2, and "
                    "--batch-size 48 on 1 processes is 48 per process"),
    ("not JSON", "is not a readable JSON file"),
    ("no deepspeed", "this script needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]'"),
])
def test_bad_input_is_one_sentence_and_loses_nothing(tiny_mnist, tiny_bert, nli_pairs, tmp_path, case, phrase):
    script = "nli_deepspeed.py" if case in ("batch sizes", "no deepspeed") else "mnist_deepspeed.py"  # one config code: both wire it
    data = ["--data-dir", tiny_mnist, "--checkpoint-dir", tmp_path / "checkpoints"] if script.startswith("mnist") \
        else ["--model", tiny_bert, "--dataset", nli_pairs]
    flags = {"fp16": ["--precision", "fp16"],
             "stage 4": ["--zero-stage", "4"],
             "stage 4 in the file": ["--deepspeed-config", write_json(tmp_path / "stage4.json", '{"zero_optimization": {"stage": 4}}')],
             "two stages": ["--zero-stage", "3", "--deepspeed-config", write_json(tmp_path / "stage2.json", '{"zero_optimization": {"stage": 2}}')],
             "batch sizes": ["--deepspeed-config", write_json(tmp_path / "batch.json", '{"train_batch_size": 64, '
                             '"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2}')],
             "not JSON": ["--deepspeed-config", write_json(tmp_path / "broken.json", "{stage: 3")],
             "no deepspeed": []}[case]
    blocked = tmp_path / "blocked" / "deepspeed"
    if case == "no deepspeed":  # a package named deepspeed, first on the path, that cannot be imported
        blocked.mkdir(parents=True)
        (blocked / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
    result = one_process("--batch-size", "48", *flags, script=script, data=data,
                         env_extra={"PYTHONPATH": f"{blocked.parent}:{ROOT}"} if case == "no deepspeed" else None)
    assert_clear_error(result, phrase)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())  # nothing written


@pytest.fixture(scope="module")
def memory_rows(tiny_bert, tmp_path_factory):
    rows = tmp_path_factory.mktemp("deepspeed-memory") / "rows.json"
    result = run_as_user(PYTHON, ROOT / "benchmarks" / "deepspeed_memory.py", "--model", tiny_bert, "--world-size", "3",
                         "--steps", "1", "--json", rows, timeout=240)
    assert_ran(result, "DeepSpeed ZeRO, 3 processes, bf16")
    return json.loads(rows.read_text())


def test_each_stage_holds_the_optimizer_state_and_parameters_the_plan_says(memory_rows):
    psi, rows = memory_rows["params"], {row["stage"]: row for row in memory_rows["rows"]}
    for stage, row in rows.items():
        (params, _, optimizer), (plan_params, _, plan_optimizer) = row["held"], row["plan"]
        assert plan_optimizer <= optimizer < plan_optimizer + 12 * 64 * 3  # 12 bytes a number; padding to N per piece
        if stage < 3:
            assert plan_params == 2 * psi <= params < plan_params + 64  # bf16, whole on every rank (a flat buffer, aligned)
        else:  # its own pieces, and whole every parameter under 100,000 numbers (all of the tiny BERT's)
            assert plan_params <= params <= 2 * psi + plan_params + 2 * 64 * 3
        assert (row["estimate"] is None) == (stage < 2)  # DeepSpeed has no estimator for stages 0 and 1
    control = rows[0]["held"][2], rows[1]["plan"][2]  # the check can fail: stage 0's AdamW state is not ZeRO-1's
    assert not control[1] <= control[0] < control[1] + 12 * 64 * 3


def test_the_accelerate_zero_3_config_on_a_cpu_is_one_sentence(tiny_bert, nli_pairs):
    accelerate = str(Path(PYTHON).with_name("accelerate"))
    result = run_as_user(accelerate, "launch", "--config_file", ROOT / "src" / "ch4" / "accelerate_configs" / "deepspeed_zero3_gpus.yaml",
                         "--num_processes", "2", ROOT / "src" / "ch4" / "nli_accelerate.py", "--model", tiny_bert,
                         "--dataset", nli_pairs, "--batch-size", "12", env_extra={"CUDA_VISIBLE_DEVICES": ""}, timeout=180)
    assert result.returncode != 0 and "error: this Accelerate config asks for DeepSpeed" in result.stderr, result.stderr[-3000:]
    assert "]: Traceback" not in result.stderr  # the launcher's own summary aside, no worker traceback
