"""Launch detection reads torchrun's variables, else SLURM's, else means one process; a missing peer
ends the run with a message instead of a hang."""
import pytest
import torch

from common.distributed import Launch, detect_launch, device_for, free_port, require_launcher
from common.precision import autocast
from conftest import PYTHON


def test_torchrun_variables_win():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "2"}
    assert detect_launch(env) == Launch(rank=5, local_rank=1, world_size=8, launcher="torchrun", local_world_size=4)


def test_slurm_variables_without_torchrun():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2"}
    assert detect_launch(env) == Launch(rank=3, local_rank=1, world_size=4, launcher="slurm", local_world_size=2)


def test_plain_python_is_one_process():
    assert detect_launch({}) == Launch(0, 0, 1, "python")


def test_slurm_without_rendezvous_address_says_what_to_export():
    with pytest.raises(SystemExit, match="export MASTER_ADDR"):
        require_launcher("x.py", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_device_without_gpus_is_the_cpu():
    assert device_for(Launch(3, 1, 4, "torchrun", 2)) == torch.device("cpu")


def test_missing_peer_fails_fast_with_a_message(run_command):
    """Rank 1 of 2 waits for a rank 0 that never starts: it must give up after --dist-timeout."""
    code = ("import torch; from common.distributed import detect_launch, init_process_group;"
            "init_process_group(detect_launch(), torch.device('cpu'), timeout_s=3)")
    env_vars = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}
    result = run_command("env", *[f"{k}={v}" for k, v in env_vars.items()], PYTHON, "-c", code, timeout=60)
    assert result.returncode != 0
    assert "rank 1 could not join a process group of 2 within 3 s" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_bf16_autocast_runs_matmuls_in_bf16():
    layer = torch.nn.Linear(4, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert layer(torch.randn(2, 4)).dtype == torch.float32
