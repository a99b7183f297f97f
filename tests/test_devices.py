"""Every accelerator torch knows, checked on a CPU: which device each process takes on CUDA, XPU and
MPS, which backend moves its tensors, what --precision means there, and the GPU-only habits that a
CPU can still show: pinned batches, fp32 without TF32, the C compiler Triton needs."""
import sys

import pytest
import torch
from torch.utils.data import SequentialSampler, TensorDataset

import common.distributed as distributed
from common.compile import check_backend
from common.distributed import Launch, accelerator_type, backend_for, device_for
from common.gather import sum_across_ranks
from common.lightning_launch import lightning_accelerator
from common.mnist import mnist_loader
from common.precision import auto_precision, resolve_precision

PYTHON_LAUNCH = Launch(0, 0, 1, "python")


def torchrun(local_rank, local_world_size):
    return Launch(local_rank, local_rank, local_world_size, "torchrun", local_world_size)


# ---- which device, which backend ----

@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_each_process_takes_the_accelerator_at_its_local_rank(kind):
    assert device_for(torchrun(1, 2), gpu_count=2, kind=kind) == torch.device(kind, 1)
    assert device_for(PYTHON_LAUNCH, gpu_count=1, kind=kind) == torch.device(kind, 0)


def test_one_process_trains_on_mps_and_a_launched_group_on_the_cpu(capsys):
    """No process-group backend moves MPS tensors: a torchrun or srun group falls back to gloo on the CPU,
    and says so once (rank 0); a plain python process takes the MPS device."""
    assert device_for(PYTHON_LAUNCH, gpu_count=1, kind="mps") == torch.device("mps")
    assert device_for(torchrun(0, 2), gpu_count=1, kind="mps") == torch.device("cpu")
    assert device_for(torchrun(1, 2), gpu_count=1, kind="mps") == torch.device("cpu")
    assert capsys.readouterr().err.count("no process-group backend moves MPS tensors") == 1


def test_no_accelerator_means_the_cpu():
    assert device_for(torchrun(0, 2), gpu_count=0, kind="cuda") == torch.device("cpu")
    assert accelerator_type() is None  # the CPU suite hides the GPUs (conftest.py)
    assert device_for(torchrun(0, 2)) == torch.device("cpu")


@pytest.mark.parametrize("kind, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("xpu", "xccl")])
def test_the_backend_is_the_one_that_moves_the_devices_tensors(kind, backend):
    assert backend_for(torch.device(kind)) == backend


# ---- precision, per device type ----

@pytest.mark.parametrize("kind", ["xpu", "mps", "cpu"])
def test_auto_is_bf16_where_the_device_supports_it_else_fp32(kind):
    assert auto_precision(torch.device(kind), has_bf16=True) == "bf16"
    assert auto_precision(torch.device(kind), has_bf16=False) == "fp32"


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_fp16_runs_where_torch_has_a_grad_scaler(kind):
    assert resolve_precision("fp16", torch.device(kind)) == "fp16"


def test_fp16_on_the_cpu_is_one_sentence():
    with pytest.raises(SystemExit, match=r"fp16 needs a GPU \(CUDA, XPU or MPS\).*use --precision bf16 or fp32"):
        resolve_precision("fp16", torch.device("cpu"))


def test_bf16_on_a_cpu_without_bf16_units_says_once_that_it_is_emulated_and_trains(capsys, monkeypatch):
    """Without AVX512-BF16 or AMX units oneDNN emulates bf16, several times slower than fp32 (about 6x on an
    AVX2-only CPU): an explicit --precision bf16 is kept, after one line on stderr, from rank 0 only. With the
    units, or asked for auto (fp32 there), nothing is said. The CPU's units are passed in: this machine has them."""
    cpu = torch.device("cpu")
    assert resolve_precision("bf16", cpu, has_bf16=False) == "bf16"
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "bf16 is emulated here and runs several times slower than fp32" in said[0], said
    assert resolve_precision("bf16", cpu, has_bf16=True) == "bf16"
    assert resolve_precision("auto", cpu, has_bf16=False) == "fp32"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_precision("bf16", cpu, has_bf16=False) == "bf16"
    assert capsys.readouterr().err == ""


def test_fp32_turns_off_cudnns_tf32_convolutions(monkeypatch):
    """cuDNN runs fp32 convolutions in TF32 by default on Ampere and newer: an "fp32" row would not be fp32.
    bf16 leaves the setting alone (its convolutions are bf16 anyway)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    resolve_precision("bf16", torch.device("cpu"))
    assert torch.backends.cudnn.allow_tf32
    resolve_precision("fp32", torch.device("cpu"))
    assert not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("kind, accelerator", [(None, "auto"), ("cuda", "auto"), ("mps", "cpu"), ("xpu", "cpu")])
def test_lightning_takes_the_cpu_where_its_ddp_strategy_cannot_run(kind, accelerator, monkeypatch, capsys):
    monkeypatch.setattr("common.lightning_launch.accelerator_type", lambda: kind)
    assert lightning_accelerator() == accelerator
    assert ("trains on the CPU" in capsys.readouterr().err) == (accelerator == "cpu")


# ---- what a GPU run needs, shown on the CPU ----

@pytest.mark.parametrize("kind, pinned", [(None, False), ("cuda", True), ("xpu", True), ("mps", False)])
def test_loaders_pin_their_batches_where_copies_can_overlap(kind, pinned, monkeypatch):
    """non_blocking=True copies from pageable memory are synchronous: the loaders pin on CUDA and XPU."""
    monkeypatch.setattr(distributed, "accelerator_type", lambda: kind)
    data = TensorDataset(torch.zeros(4, 2))
    assert mnist_loader(data, 2, SequentialSampler(data)).pin_memory == pinned


def test_sum_across_ranks_needs_the_device_the_group_moves():
    """A default of "cpu" would fail only on NCCL, at the first caller that forgot the device."""
    with pytest.raises(TypeError, match="device"):
        sum_across_ranks(1, 2)


def test_inductor_on_a_gpu_without_a_c_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"Triton kernels, which need a C compiler .* leave out --compile"):
        check_backend("inductor", kind="cuda", environ={})
    check_backend("aot_eager", kind="cuda", environ={})  # the way out needs none


def test_inductor_on_a_gpu_without_pythons_headers_says_so(tmp_path):
    with pytest.raises(SystemExit, match=r"Python.h is missing; install them \(e.g. apt install python3-dev\)"):
        check_backend("inductor", kind="cuda", environ={"CC": "gcc"}, python_include=str(tmp_path))
    (tmp_path / "Python.h").touch()
    check_backend("inductor", kind="cuda", environ={"CC": "gcc"}, python_include=str(tmp_path))


def test_inductor_on_the_cpu_still_asks_for_a_cpp_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"needs a C\+\+ compiler"):
        check_backend("inductor", kind="cpu", environ={"CC": sys.executable})
