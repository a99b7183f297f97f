"""The GPU paths on real GPUs: runs only on a machine that has one, and says so where it skips.

The rest of the suite hides the GPUs (conftest.py); these tests give them back to what they start. Each
script runs as a user runs it, on the tiny MNIST (3 steps of 64 in an epoch) or the tiny BERT (--max-steps),
and is checked by what it prints. What one GPU cannot show (NCCL between processes, DataParallel's replica
threads) runs where a second GPU is visible, and skips with "needs two GPUs" elsewhere. The BERT scripts read
their pairs with the `datasets` package (common/nli.py): without it, their tests skip and say so.

tools/gpu_check.py runs the file with up to 8 tests at a time (pytest-xdist, --dist=load); the --compile runs
(inductor) are the slow part: `-k "not compile"` leaves them out.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import ACCELERATE, EVAL_PAIRS, GPU_DEVICES, PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_ran

from common.cli import COMM_HOOKS

CH4 = ROOT / "src" / "ch4"
RESUME = CH4 / "resume"
SCALE_OUT = CH4 / "scale_out"
SHARDED = CH4 / "sharded"
ONE_PROCESS = [*TORCHRUN, "--nproc_per_node=1"]
TWO_PROCESSES = [*TORCHRUN, "--nproc_per_node=2"]
MULTI_GPU_FP16 = CH4 / "accelerate_configs" / "multi_gpu_fp16.yaml"
PLAIN_BYTES = 4_799_528  # BasicNet's fp32 gradients: what plain DDP all-reduces per step
MNIST_STEPS = 3  # an epoch of the tiny MNIST's 192 images at the global batch of 64
BERT_STEPS = 3


def visible_gpus() -> str | None:
    """CUDA_VISIBLE_DEVICES as this session had it, spelled out; None where there is no GPU."""
    if GPU_DEVICES is not None:
        return GPU_DEVICES or None
    if not shutil.which("nvidia-smi"):
        return None
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return ",".join(str(i) for i in range(listed.count("GPU "))) or None


GPUS = visible_gpus()
GPU_COUNT = len(GPUS.split(",")) if GPUS else 0
pytestmark = pytest.mark.skipif(GPUS is None, reason="no GPU on this machine: the GPU paths run where there is one")
ON_GPU = {"CUDA_VISIBLE_DEVICES": GPUS or ""}
ON_ONE_GPU = {"CUDA_VISIBLE_DEVICES": GPUS.split(",")[0] if GPUS else ""}  # the first GPU alone, however many there are
ON_THE_CPU = {"CUDA_VISIBLE_DEVICES": ""}

two_gpus = pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
needs_datasets = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None,
    reason="needs the `datasets` package: the BERT scripts read their pairs with it (common/nli.py); pip install datasets")
needs_compiler = pytest.mark.skipif(
    not ((os.environ.get("CC") or any(shutil.which(name) for name in ("gcc", "clang")))
         and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()),
    reason="--compile inductor on a GPU builds Triton kernels, which need a C compiler (gcc or clang on the PATH, "
           "or $CC) and Python's headers (Python.h); common/compile.py stops without them")


def bert_flags(tiny_bert, nli_pairs, steps: int = BERT_STEPS) -> list:
    return ["--model", tiny_bert, "--dataset", nli_pairs, "--max-steps", str(steps)]


# ---- one process on one GPU ----

@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_single_gpu(run_command, tiny_mnist, precision):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--data-dir", tiny_mnist, "--precision", precision,
                         env_extra=ON_GPU)
    assert_ran(result, f"one process on cuda:0, {precision}", f"over {TEST_IMAGES} images")


def test_lightning_on_one_gpu(run_command, tiny_mnist):
    """trainer.test() leaves the module on the CPU: the counts must still be summed on the GPU (NCCL)."""
    result = run_command(PYTHON, CH4 / "mnist_5_lightning.py", "--data-dir", tiny_mnist, "--devices", "1",
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {TEST_IMAGES} images")


def test_torchrun_one_process_nccl(run_command, tiny_mnist):
    result = run_command(*ONE_PROCESS, CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {TEST_IMAGES} images")
    assert "using the device under current context" not in result.stderr  # device_id was given


def test_accelerate_fp16_config_on_one_gpu(run_command, tiny_mnist):
    result = run_command(*ACCELERATE, "--config_file", MULTI_GPU_FP16, "--num_processes", "1",
                         CH4 / "mnist_4_accelerate.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda, fp16", f"over {TEST_IMAGES} images")


def test_two_processes_on_one_gpu_say_so(run_command, tiny_mnist):
    """Two processes with one GPU visible (the first one alone, on any machine) stop with one sentence."""
    result = run_command(*TWO_PROCESSES, CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist, env_extra=ON_ONE_GPU)
    assert result.returncode != 0 and "processes cannot share a GPU" in result.stderr, result.stderr[-3000:]


@needs_datasets
def test_bert_ddp_on_gpu(run_command, tiny_bert, nli_pairs):
    result = run_command(*ONE_PROCESS, CH4 / "ddp.py", *bert_flags(tiny_bert, nli_pairs), env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs")


def test_mnist_fsdp_on_gpu_nccl(run_command, tiny_mnist):
    result = run_command(*ONE_PROCESS, SHARDED / "mnist_fsdp.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {TEST_IMAGES} images")


needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed: pip install -e '.[deepspeed]' (make gpu-wheels carries it)")


@needs_deepspeed
@pytest.mark.parametrize("precision", ["bf16", "fp16"])  # 16-bit weights in the engine; fp16 with DeepSpeed's loss scaler
@pytest.mark.parametrize("stage", [0, 3])
def test_mnist_deepspeed_on_gpu_nccl(run_command, tiny_mnist, tmp_path, stage, precision):
    result = run_command(*ONE_PROCESS, SHARDED / "mnist_deepspeed.py", "--data-dir", tiny_mnist, "--zero-stage", str(stage),
                         "--precision", precision, "--checkpoint-dir", tmp_path, env_extra=ON_GPU)
    assert_ran(result, f"1 process on cuda, {precision}, ZeRO stage {stage}", f"over {TEST_IMAGES} images")


@needs_deepspeed
@needs_datasets
def test_nli_deepspeed_on_gpu_nccl(run_command, tiny_bert, nli_pairs):
    result = run_command(*ONE_PROCESS, SHARDED / "nli_deepspeed.py", *bert_flags(tiny_bert, nli_pairs), "--zero-stage", "2",
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", "ZeRO stage 2", f"over {EVAL_PAIRS} pairs")


@needs_datasets
@pytest.mark.parametrize("deepspeed", [False, pytest.param(True, marks=needs_deepspeed)])
def test_nli_trainer_on_gpu(run_command, tiny_bert, nli_pairs, tmp_path, deepspeed):
    flags = ["--deepspeed", CH4 / "deepspeed_configs" / "zero3.json"] if deepspeed else []
    result = run_command(*ONE_PROCESS, CH4 / "nli_trainer.py", *bert_flags(tiny_bert, nli_pairs), "--output-dir", tmp_path,
                         *flags, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs", *(["ZeRO stage 3"] if deepspeed else []))


@needs_datasets
def test_nli_fsdp_on_gpu_nccl(run_command, tiny_bert, nli_pairs):
    result = run_command(*ONE_PROCESS, SHARDED / "nli_fsdp.py", *bert_flags(tiny_bert, nli_pairs), env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs")


@needs_datasets
def test_accelerate_fsdp2_config_on_one_gpu(run_command, tiny_bert, nli_pairs):
    result = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "fsdp2_gpus.yaml",
                         "--num_processes", "1", CH4 / "nli_accelerate.py", *bert_flags(tiny_bert, nli_pairs),
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs")


# ---- nn.DataParallel: one process driving every visible GPU ----

@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_mnist_data_parallel_on_every_gpu(run_command, tiny_mnist, precision):
    """Every visible GPU; fp16 with its loss scaler, bf16 through the Autocast wrapper inside each replica."""
    result = run_command(PYTHON, CH4 / "mnist_2_data_parallel.py", "--data-dir", tiny_mnist, "--precision", precision,
                         env_extra=ON_GPU)
    assert_ran(result, f"one process, DataParallel over {GPU_COUNT} ", f", {precision}, global batch 64",
               f"over {TEST_IMAGES} images")


@needs_datasets
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("script", ["data_parallel.py", "nli_loss_in_forward.py"])
def test_bert_data_parallel_on_every_gpu(run_command, tiny_bert, nli_pairs, script, precision):
    """The logits gathered on the first GPU (data_parallel.py), or one loss per replica (nli_loss_in_forward.py);
    fp16 unscales before clipping. Evaluation gathers the model's whole output."""
    result = run_command(PYTHON, CH4 / script, *bert_flags(tiny_bert, nli_pairs), "--precision", precision,
                         env_extra=ON_GPU)
    assert_ran(result, f"one process, DataParallel over {GPU_COUNT} ", f", {precision}, global batch 32",
               f"over {EVAL_PAIRS} pairs")


# Each call of the wrapped Linear, as a forward hook sees it (DataParallel's replicas share the module's hooks):
# the thread it ran in, the device and dtype of its output; then the output DataParallel gathered.
REPLICA_CALLS = """
import json, threading, torch, torch.nn as nn
from common.precision import Autocast
calls = []
inner = nn.Linear(8, 8).cuda()
inner.register_forward_hook(lambda module, args, output: calls.append(
    {"thread": threading.get_ident(), "device": str(output.device), "dtype": str(output.dtype)}))
model = nn.DataParallel(Autocast(inner, torch.device("cuda"), "bf16"))
gathered = model(torch.randn(8 * torch.cuda.device_count(), 8, device="cuda"))
print(json.dumps({"main": threading.get_ident(), "gpus": torch.cuda.device_count(), "calls": calls,
                  "gathered": [str(gathered.device), str(gathered.dtype)]}))
"""


def replica_calls(run_command, env) -> dict:
    result = run_command(PYTHON, "-c", REPLICA_CALLS, env_extra=env)
    assert_ran(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_data_parallel_on_one_gpu_calls_the_module_in_this_thread(run_command):
    """With one GPU there is nothing to replicate: DataParallel calls the module once, in the caller's thread,
    so this shows the Autocast wrapper's bf16 but not that it survives a replica thread (the test below)."""
    report = replica_calls(run_command, ON_ONE_GPU)
    assert report["gpus"] == 1
    assert report["calls"] == [{"thread": report["main"], "device": "cuda:0", "dtype": "torch.bfloat16"}]
    assert report["gathered"] == ["cuda:0", "torch.bfloat16"]


@two_gpus
def test_data_parallel_replicas_compute_in_bf16(run_command):
    """One replica per GPU, each run in a thread of its own (autocast state is per thread), each computing in
    the bf16 that the Autocast wrapper enters inside it; the outputs gathered on the first GPU."""
    report = replica_calls(run_command, ON_GPU)
    assert report["gpus"] == GPU_COUNT
    assert sorted(call["device"] for call in report["calls"]) == sorted(f"cuda:{index}" for index in range(GPU_COUNT))
    threads = {call["thread"] for call in report["calls"]}
    assert len(threads) == GPU_COUNT and report["main"] not in threads, report
    assert {call["dtype"] for call in report["calls"]} == {"torch.bfloat16"}, report
    assert report["gathered"] == ["cuda:0", "torch.bfloat16"]


# ---- the resume rungs: checkpoints written on the GPU, final.pt read where there is none ----

# The trained weights as a user on a machine without a GPU loads them: torch.load with no map_location.
LOADS_ON_A_CPU = """
import sys, torch
weights = torch.load(sys.argv[1])
print("tensors on", sorted({tensor.device.type for tensor in weights.values()}))
if sys.argv[2] == "mnist":
    from common.mnist import BasicNet
    BasicNet().load_state_dict(weights)
    print("loads into BasicNet")
"""


def assert_loads_on_a_cpu(run_command, path, kind: str):
    result = run_command(PYTHON, "-c", LOADS_ON_A_CPU, path, kind, env_extra=ON_THE_CPU)
    assert_ran(result, "tensors on ['cpu']", *(["loads into BasicNet"] if kind == "mnist" else []))


RESUME_SCRIPTS = {  # script: (kind, checkpoint suffix: DDP writes step-N.pt, FSDP a folder step-N)
    "mnist_3_ddp_resume.py": ("mnist", ".pt"),
    "ddp_resume.py": ("bert", ".pt"),
    "mnist_fsdp_resume.py": ("mnist", ""),
}


def resume_data(script, tiny_mnist, tiny_bert, nli_pairs, steps: int = BERT_STEPS) -> list:
    if RESUME_SCRIPTS[script][0] == "mnist":
        return ["--data-dir", tiny_mnist]
    if importlib.util.find_spec("datasets") is None:
        pytest.skip("needs the `datasets` package: ddp_resume.py reads its pairs with it (common/nli.py); "
                    "pip install datasets")
    return bert_flags(tiny_bert, nli_pairs, steps)


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=two_gpus)])
@pytest.mark.parametrize("script", list(RESUME_SCRIPTS))
def test_resume_rung_on_gpu_writes_a_final_pt_a_cpu_loads(run_command, tiny_mnist, tiny_bert, nli_pairs, tmp_path,
                                                           script, processes):
    """A run to the end, then the same command again: it loads the last checkpoint into the GPU model and
    optimizer, finds nothing left to train, says so and exits 0. final.pt loads with torch.load where no GPU
    is visible, before the rerun and after it."""
    kind, suffix = RESUME_SCRIPTS[script]
    folder = tmp_path / "checkpoints"
    command = [*TORCHRUN, f"--nproc_per_node={processes}", RESUME / script,
               *resume_data(script, tiny_mnist, tiny_bert, nli_pairs), "--checkpoint-dir", folder]
    over = f"over {TEST_IMAGES} images" if kind == "mnist" else f"over {EVAL_PAIRS} pairs"
    result = run_command(*command, env_extra=ON_GPU)
    assert_ran(result, f"{processes} process{'es' if processes > 1 else ''} on cuda", f"final weights in {folder / 'final.pt'}",
               over)
    if suffix == "":  # one file of pieces per rank, the index, and rank 0's metadata
        assert sorted(path.name for path in (folder / "step-00000003").iterdir()) == \
            [".metadata", *(f"__{rank}_0.distcp" for rank in range(processes)), "meta.pt"]
    assert_loads_on_a_cpu(run_command, folder / "final.pt", kind)
    again = run_command(*command, env_extra=ON_GPU)
    assert_ran(again, f"resumed from {folder / f'step-00000003{suffix}'}",
               f"nothing to train: the run in {folder} ended at step 3")
    assert_loads_on_a_cpu(run_command, folder / "final.pt", kind)


# fp16: the one precision with a loss-scaler state (scale, growth tracker) for a checkpoint to carry.

def scaler_state(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["scaler"]


def with_scaler(source, destination, scale: float, tracker: int) -> None:
    """A copy of a one-file checkpoint whose loss scaler says `scale` after `tracker` steps without an inf:
    a state no fresh GradScaler has (65536 and 0), so that a resume that drops it shows."""
    state = torch.load(source, map_location="cpu", weights_only=True)
    assert isinstance(state["scaler"].get("scale"), float), f"{source} holds no loss-scaler state: {state['scaler']}"
    state["scaler"] = {**state["scaler"], "scale": scale, "_growth_tracker": tracker}
    torch.save(state, destination)


@pytest.mark.parametrize("script, steps", [("mnist_3_ddp_resume.py", MNIST_STEPS), ("ddp_resume.py", 4)],
                         ids=["mnist_3_ddp_resume.py", "ddp_resume.py"])
def test_fp16_resume_carries_the_loss_scaler(run_command, tiny_mnist, tiny_bert, nli_pairs, tmp_path, script, steps):
    """A run in fp16 checkpoints every 2 steps; its step-2 checkpoint, alone in a new folder with its scaler set
    to scale 1024 after 1000 clean steps, is resumed by the same command. The steps after it go on from there:
    the scale stays 1024 and the tracker counts on (1000 + steps), or an inf halved the scale and reset the
    tracker; a scaler that the resume dropped would start again at 65536."""
    data = resume_data(script, tiny_mnist, tiny_bert, nli_pairs, steps)
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    flags = [*data, "--precision", "fp16", "--checkpoint-every", "2"]
    result = run_command(*ONE_PROCESS, RESUME / script, *flags, "--checkpoint-dir", first, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda, fp16", f"final weights in {first / 'final.pt'}")
    resumed.mkdir()
    with_scaler(first / "step-00000002.pt", resumed / "step-00000002.pt", scale=1024.0, tracker=1000)
    result = run_command(*ONE_PROCESS, RESUME / script, *flags, "--checkpoint-dir", resumed, env_extra=ON_GPU)
    assert_ran(result, f"resumed from {resumed / 'step-00000002.pt'}: epoch 0", "1 process on cuda, fp16")
    after = steps - 2
    scaler = scaler_state(resumed / f"step-{steps:08d}.pt")
    if scaler["scale"] == 1024.0:
        assert scaler["_growth_tracker"] == 1000 + after, scaler
    else:
        assert scaler["scale"] < 1024.0 and scaler["_growth_tracker"] < after, scaler


def test_fp16_fsdp_resume_carries_the_loss_scaler(run_command, tiny_mnist, tmp_path):
    """The sharded checkpoint holds the scaler too (dcp.save's non-tensor entries): the step-2 checkpoint of a
    3-step fp16 run, resumed alone in a new folder, ends its one step with the scaler the uninterrupted run
    had after it (a dropped scaler would start again at 65536 with no steps behind it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    flags = ["--data-dir", tiny_mnist, "--precision", "fp16", "--checkpoint-every", "2"]
    result = run_command(*ONE_PROCESS, RESUME / "mnist_fsdp_resume.py", *flags, "--checkpoint-dir", first, env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda, fp16", f"over {TEST_IMAGES} images")
    shutil.copytree(first / "step-00000002", resumed / "step-00000002")
    result = run_command(*ONE_PROCESS, RESUME / "mnist_fsdp_resume.py", *flags, "--checkpoint-dir", resumed,
                         env_extra=ON_GPU)
    assert_ran(result, f"resumed from {resumed / 'step-00000002'}: epoch 0, 128 samples into it, step 2",
               f"over {TEST_IMAGES} images")
    scalers = []
    for folder in (first, resumed):
        whole = tmp_path / f"{folder.name}-step-3.pt"  # beside the checkpoint folder, not in it
        dcp_to_torch_save(folder / "step-00000003", whole)
        scalers.append(scaler_state(whole))
    assert isinstance(scalers[0].get("scale"), float) and isinstance(scalers[0].get("_growth_tracker"), int), scalers[0]
    assert scalers[1] == scalers[0]


# ---- scaling out at one process: HSDP's mesh, the communication hooks, DiLoCo ----

@pytest.mark.parametrize("param_dtype, precision", [("fp32", "bf16"), ("bf16", "fp32")])
def test_hsdp_one_process_mesh(run_command, tiny_mnist, param_dtype, precision):
    """One process: a 1 x 1 mesh (one node, so one replica of one shard); --param-dtype bf16 is FSDP2's own
    mixed precision, run with --precision fp32 as the script says."""
    result = run_command(*ONE_PROCESS, SCALE_OUT / "mnist_hsdp.py", "--data-dir", tiny_mnist, "--param-dtype", param_dtype,
                         "--precision", precision, env_extra=ON_GPU)
    assert_ran(result, f"1 process on cuda, {precision}",
               f"mesh (replicate, shard) = 1 x 1: shard groups (rows) [[0]], parameters in {param_dtype}, gradients reduced in fp32",
               f"over {TEST_IMAGES} images")


def payload_per_step(hook: str, steps: int, powersgd_rank: int = 1) -> str:
    """What mnist_comm_hooks.py prints as the mean payload per step: the first 2 steps of PowerSGD are plain."""
    if hook == "powersgd":
        from common.lessons.comm_hooks import powersgd_numel
        from common.mnist import BasicNet
        compressed = 4 * sum(powersgd_numel(p.shape, powersgd_rank) for p in BasicNet().parameters())
        return f"{(2 * PLAIN_BYTES + (steps - 2) * compressed) / steps:,.0f}"
    return f"{PLAIN_BYTES / (2 if hook in ('fp16', 'bf16') else 1):,.0f}"


@pytest.mark.parametrize("hook", COMM_HOOKS)
def test_comm_hook_one_process_nccl(run_command, tiny_mnist, hook):
    """Each hook the script offers, on NCCL (DDP's default buckets: the single-bucket rule is gloo's), over a
    group of one: DDP still hands every bucket to the hook, and the payload is what the hook sends."""
    result = run_command(*ONE_PROCESS, SCALE_OUT / "mnist_comm_hooks.py", "--data-dir", tiny_mnist, "--comm-hook", hook,
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"comm hook {hook}" + (", rank 1" if hook == "powersgd" else ""),
               f"mean of {MNIST_STEPS} steps): {payload_per_step(hook, MNIST_STEPS)} B",
               f"plain DDP's {PLAIN_BYTES:,} B", f"over {TEST_IMAGES} images")


def test_diloco_one_process(run_command, tiny_mnist):
    """3 steps, synchronised every 2: once after step 2 and once at the end of the epoch."""
    result = run_command(*ONE_PROCESS, SCALE_OUT / "mnist_diloco.py", "--data-dir", tiny_mnist, "--sync-every", "2",
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", "synchronised every 2 steps by outer SGD, lr 0.7, Nesterov momentum 0.9",
               f"mean of {MNIST_STEPS} steps): {2 * PLAIN_BYTES / MNIST_STEPS:,.0f} B", f"over {TEST_IMAGES} images")


# ---- torchft: one replica group on the GPU (its process group across groups is NCCL) ----

FAULT_TOLERANT = ["fault_tolerant/mnist_3_ddp_ft.py", "fault_tolerant/mnist_fsdp_ft.py"]
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="needs torchft: pip install -e '.[ft]' (Linux x86-64, Python 3.10-3.12)")


@pytest.fixture
def lighthouse():
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50)
    yield server.address()
    server.shutdown()


@needs_torchft
@pytest.mark.timeout(600)
@pytest.mark.parametrize("compile_flag", [[], ["--compile", "inductor"]], ids=["eager", "inductor"])
@pytest.mark.parametrize("script", FAULT_TOLERANT)
def test_fault_tolerant_rung_one_group_on_gpu(run_command, tiny_mnist, lighthouse, script, compile_flag):
    """One group alone: the quorum, the manager's all-reduce over NCCL and the commit, on the GPU (two groups on one
    GPU would put one GPU twice in an NCCL communicator, which NCCL refuses)."""
    if compile_flag and not (os.environ.get("CC") or any(shutil.which(name) for name in ("gcc", "clang"))):
        pytest.skip("--compile inductor needs a C compiler")
    result = run_command(*ONE_PROCESS, CH4 / script, "--data-dir", tiny_mnist, "--lighthouse", lighthouse,
                         "--max-steps", "3", *compile_flag, env_extra={**ON_GPU, "no_proxy": "*"}, timeout=540)
    assert_ran(result, "on cuda", "1 of 1 groups in the quorum", f"over {TEST_IMAGES} images")


# ---- two processes, one GPU each: NCCL between processes ----

@two_gpus
def test_two_gpus_mnist_ddp(run_command, tiny_mnist):
    result = run_command(*TWO_PROCESSES, CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", "global batch 64 = 2 x 32", f"over {TEST_IMAGES} images")
    assert result.stdout.count("test accuracy") == 1


@two_gpus
@needs_datasets
def test_two_gpus_bert_ddp(run_command, tiny_bert, nli_pairs):
    result = run_command(*TWO_PROCESSES, CH4 / "ddp.py", *bert_flags(tiny_bert, nli_pairs), env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", "global batch 32 = 2 x 16", f"over {EVAL_PAIRS} pairs")
    assert result.stdout.count("eval accuracy") == 1


@two_gpus
def test_two_gpus_accelerate_fp16(run_command, tiny_mnist):
    result = run_command(*ACCELERATE, "--config_file", MULTI_GPU_FP16, "--num_processes", "2",
                         CH4 / "mnist_4_accelerate.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda, fp16", "global batch 64 = 2 x 32", f"over {TEST_IMAGES} images")


@two_gpus
def test_two_gpus_mnist_fsdp(run_command, tiny_mnist):
    result = run_command(*TWO_PROCESSES, SHARDED / "mnist_fsdp.py", "--data-dir", tiny_mnist, env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", "global batch 64 = 2 x 32", f"over {TEST_IMAGES} images")


@two_gpus
@needs_datasets
def test_two_gpus_nli_fsdp(run_command, tiny_bert, nli_pairs):
    result = run_command(*TWO_PROCESSES, SHARDED / "nli_fsdp.py", *bert_flags(tiny_bert, nli_pairs), env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", "global batch 32 = 2 x 16", f"over {EVAL_PAIRS} pairs")


@two_gpus
@pytest.mark.parametrize("replicas, rows", [(1, "[[0, 1]]"), (2, "[[0], [1]]")], ids=["1x2", "2x1"])
def test_two_gpus_hsdp(run_command, tiny_mnist, replicas, rows):
    """1 x 2: both GPUs shard the model (the default on one node); 2 x 1: each GPU holds it whole, a replica."""
    result = run_command(*TWO_PROCESSES, SCALE_OUT / "mnist_hsdp.py", "--data-dir", tiny_mnist, "--replicas", str(replicas),
                         env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda",
               f"mesh (replicate, shard) = {replicas} x {2 // replicas}: shard groups (rows) {rows}",
               f"over {TEST_IMAGES} images")


@two_gpus
def test_two_gpus_powersgd(run_command, tiny_mnist):
    """As tests/test_comm_hooks.py runs it on gloo, now on NCCL with DDP's default buckets: a global batch of 6,
    32 steps, the first 2 plain (4,799,528 B), then rank 4 (159,432 B)."""
    result = run_command(*TWO_PROCESSES, SCALE_OUT / "mnist_comm_hooks.py", "--data-dir", tiny_mnist, "--batch-size", "6",
                         "--comm-hook", "powersgd", "--powersgd-rank", "4", env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", "comm hook powersgd, rank 4",
               f"mean of 32 steps): {payload_per_step('powersgd', 32, 4)} B", f"over {TEST_IMAGES} images")
    assert payload_per_step("powersgd", 32, 4) == "449,438"  # the figure the gloo test checks


@two_gpus
def test_two_gpus_diloco(run_command, tiny_mnist):
    """At H = 5 over 32 steps: synchronised 6 times, and once more at the end of the epoch."""
    result = run_command(*TWO_PROCESSES, SCALE_OUT / "mnist_diloco.py", "--data-dir", tiny_mnist, "--batch-size", "6",
                         "--sync-every", "5", env_extra=ON_GPU)
    assert_ran(result, "2 processes on cuda", f"mean of 32 steps): {7 * PLAIN_BYTES / 32:,.0f} B",
               f"over {TEST_IMAGES} images")


# ---- --compile inductor (Triton kernels on the GPU), each script that has the flag, at one process ----

MNIST_COMPILE = {
    "mnist_1_single.py": [PYTHON],
    "mnist_2_data_parallel.py": [PYTHON],
    "mnist_3_ddp.py": ONE_PROCESS,
    "mnist_4_accelerate.py": [*ACCELERATE, "--config_file", MULTI_GPU_FP16, "--num_processes", "1"],
    "sharded/mnist_fsdp.py": ONE_PROCESS,
    "scale_out/mnist_hsdp.py": ONE_PROCESS,
    "scale_out/mnist_comm_hooks.py": ONE_PROCESS,
    "scale_out/mnist_diloco.py": ONE_PROCESS,
}
BERT_COMPILE = {"data_parallel.py": [PYTHON], "nli_loss_in_forward.py": [PYTHON], "ddp.py": ONE_PROCESS}


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One inductor cache for this file's compiled runs: a graph that several scripts share is generated once."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


def test_every_script_with_compile_is_compiled_here():
    with_flag = {path.relative_to(CH4).as_posix() for path in CH4.rglob("*.py") if "add_compile_flag(" in path.read_text()}
    assert with_flag == set(MNIST_COMPILE) | set(BERT_COMPILE) | set(FAULT_TOLERANT)


@needs_compiler
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", list(MNIST_COMPILE))
def test_mnist_compile_inductor_on_one_gpu(run_command, tiny_mnist, inductor_cache, script):
    result = run_command(*MNIST_COMPILE[script], CH4 / script, "--data-dir", tiny_mnist, "--compile", "inductor",
                         env_extra={**ON_GPU, **inductor_cache}, timeout=540)
    assert_ran(result, f"over {TEST_IMAGES} images")


@needs_compiler
@needs_datasets
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", list(BERT_COMPILE))
def test_bert_compile_inductor_on_one_gpu(run_command, tiny_bert, nli_pairs, inductor_cache, script):
    """The pairs are padded per batch to their own longest, so the shapes change: dynamic shapes, recompiles."""
    result = run_command(*BERT_COMPILE[script], CH4 / script, *bert_flags(tiny_bert, nli_pairs), "--compile", "inductor",
                         env_extra={**ON_GPU, **inductor_cache}, timeout=540)
    assert_ran(result, f"over {EVAL_PAIRS} pairs")
