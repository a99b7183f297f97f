"""The GPU paths on real GPUs: runs only on a machine that has one, and says so where it skips.

The rest of the suite hides the GPUs (conftest.py); these tests give them back to what they start.
"""
import shutil
import subprocess

import pytest

from conftest import ACCELERATE, EVAL_PAIRS, GPU_DEVICES, PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_ran

CH4 = ROOT / "src" / "ch4"


def visible_gpus() -> str | None:
    """CUDA_VISIBLE_DEVICES as this session had it, spelled out; None where there is no GPU."""
    if GPU_DEVICES is not None:
        return GPU_DEVICES or None
    if not shutil.which("nvidia-smi"):
        return None
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return ",".join(str(i) for i in range(listed.count("GPU "))) or None


GPUS = visible_gpus()
pytestmark = pytest.mark.skipif(GPUS is None, reason="no GPU on this machine: the GPU paths run where there is one")
ON_GPU = {"CUDA_VISIBLE_DEVICES": GPUS or ""}


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


def test_data_parallel_replicas_compute_in_bf16(run_command):
    """With one GPU DataParallel calls the module in this thread; replica threads need two or more."""
    code = ("import torch, torch.nn as nn; from common.precision import Autocast;"
            "m = nn.DataParallel(Autocast(nn.Linear(8, 8).cuda(), torch.device('cuda'), 'bf16'));"
            "print(m(torch.randn(8, 8, device='cuda')).dtype)")
    assert_ran(run_command(PYTHON, "-c", code, env_extra=ON_GPU), "torch.bfloat16")


def test_torchrun_one_process_nccl(run_command, tiny_mnist):
    result = run_command(*TORCHRUN, "--nproc_per_node=1", CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist,
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {TEST_IMAGES} images")
    assert "using the device under current context" not in result.stderr  # device_id was given


def test_accelerate_fp16_config_on_one_gpu(run_command, tiny_mnist):
    result = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "multi_gpu_fp16.yaml",
                         "--num_processes", "1", CH4 / "mnist_4_accelerate.py", "--data-dir", tiny_mnist,
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda, fp16", f"over {TEST_IMAGES} images")


@pytest.mark.skipif(GPUS is None or "," in GPUS, reason="needs exactly one GPU")
def test_two_processes_on_one_gpu_say_so(run_command, tiny_mnist):
    result = run_command(*TORCHRUN, "--nproc_per_node=2", CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist,
                         env_extra=ON_GPU)
    assert result.returncode != 0 and "processes cannot share a GPU" in result.stderr


def test_bert_ddp_on_gpu(run_command, tiny_bert, nli_pairs):
    result = run_command(*TORCHRUN, "--nproc_per_node=1", CH4 / "ddp.py", "--model", tiny_bert, "--dataset", nli_pairs,
                         "--max-steps", "3", env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", "pairs")


def test_fsdp_scripts_on_gpu_nccl(run_command, tiny_mnist, tiny_bert, nli_pairs):
    result = run_command(*TORCHRUN, "--nproc_per_node=1", CH4 / "sharded" / "mnist_fsdp.py", "--data-dir", tiny_mnist,
                         env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {TEST_IMAGES} images")
    result = run_command(*TORCHRUN, "--nproc_per_node=1", CH4 / "sharded" / "nli_fsdp.py", "--model", tiny_bert, "--dataset",
                         nli_pairs, "--max-steps", "3", env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs")


def test_accelerate_fsdp2_config_on_one_gpu(run_command, tiny_bert, nli_pairs):
    result = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "fsdp2_gpus.yaml",
                         "--num_processes", "1", CH4 / "nli_accelerate.py", "--model", tiny_bert, "--dataset", nli_pairs,
                         "--max-steps", "3", env_extra=ON_GPU)
    assert_ran(result, "1 process on cuda", f"over {EVAL_PAIRS} pairs")
