"""DeepSpeed's ZeRO stages train what DDP and common/lessons/zero.py train, hold what the plan says, and refuse bad input.

The equality runs in real gloo groups of 2 and 3 processes: each rank starts from its own weights
(the engine must copy rank 0's, as DDP does), feeds its own batches, and after STEPS AdamW steps
every stage's full parameters are compared with DDP's and with common/lessons/zero.py's of the same stage.
The tolerance is 1e-6 absolute (plus 1e-5 relative), as tests/test_zero.py's: the stages sum the
same gradients in another order (flat buckets, a reduce-scatter instead of an all-reduce), which
moves a weight of order 1 by a few float32 ulps (measured: at most 3e-8 after 5 steps). The
negative control is DeepSpeed's own default: without "gradient_clipping": 0 the engine clips at 1.0,
the inputs are scaled so that two steps' gradient norms exceed 1, and the weights end 8e-4 apart.
"""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ACCELERATE, PYTHON, ROOT, assert_clear_error, assert_ran, run_as_user
from test_zero import adamw, small_model
from test_zero import batch_for as zero_batch_for
from torch.nn.parallel import DistributedDataParallel as DDP

from common.lessons.zero import ZeRO
from common.spawn import run_in_process_group

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra: pip install -e '.[deepspeed]'")

STEPS = 5
STAGES = (0, 1, 2, 3)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
SHARDED = ROOT / "src" / "ch4" / "sharded"


def batch_for(rank, step):
    """test_zero.py's batches, scaled so that some gradient norms exceed DeepSpeed's default clipping of 1.0."""
    inputs, labels = zero_batch_for(rank, step)
    return 5 * inputs, labels


def train_beside_ddp(rank, world_size, stage, config_extra):
    """STEPS steps of a DeepSpeed engine at `stage`, of DDP and of common/lessons/zero.py, on the same data; full weights."""
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


def one_process(*flags, env_extra=None, script="mnist_deepspeed.py", data=()):
    """The rung as rank 0 of 1 under plain python, so that the error is the script's alone (torchrun adds its own traceback);
    MASTER_PORT 0: the one process's store binds a port the kernel picks."""
    environment = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "0", "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
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
    result = run_as_user(*ACCELERATE, "--config_file", ROOT / "src" / "ch4" / "accelerate_configs" / "deepspeed_zero3_gpus.yaml",
                         "--num_processes", "2", ROOT / "src" / "ch4" / "nli_accelerate.py", "--model", tiny_bert,
                         "--dataset", nli_pairs, "--batch-size", "12", env_extra={"CUDA_VISIBLE_DEVICES": ""}, timeout=180)
    assert result.returncode != 0 and "error: this Accelerate config asks for DeepSpeed" in result.stderr, result.stderr[-3000:]
    assert "]: Traceback" not in result.stderr  # the launcher's own summary aside, no worker traceback
