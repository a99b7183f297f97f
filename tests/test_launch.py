"""Launch detection reads torchrun's variables, else SLURM's, else means one process; a missing peer
ends the run with a message instead of a hang."""
import socket

import pytest
import torch
from conftest import PYTHON, ROOT, assert_clear_error

from common.distributed import Launch, detect_launch, device_for, exit_if_peers_missing, require_launcher
from common.precision import autocast


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


@pytest.mark.parametrize("script", ["src/ch4/mnist_3_ddp.py", "src/ch4/debugging/dead_rank.py"])
def test_missing_peer_fails_fast_with_a_message(run_command, script):
    """Rank 1 of 2 waits for a rank 0 that never starts: torch's own dist.init_process_group, as the DDP rung
    and the debugging gallery call it, gives up after the timeout, and exit_if_peers_missing says so in one sentence."""
    with socket.socket() as unheard:  # bound and never listening: no rank 0, and no other process can take the port
        unheard.bind(("127.0.0.1", 0))
        env_vars = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(unheard.getsockname()[1])}
        flag = "--timeout" if "debugging" in script else "--dist-timeout"
        result = run_command("env", *[f"{k}={v}" for k, v in env_vars.items()], PYTHON, ROOT / script, flag, "1", timeout=60)
    assert_clear_error(result, "rank 1 could not join a process group of 2 within 1 s")


def test_a_restartable_launch_is_warned_of_the_shared_store(monkeypatch, capsys):
    """Under torchrun --max-restarts with its shared store, rank 0 is told how to give each restart a fresh one."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with exit_if_peers_missing(Launch(0, 0, 2, "torchrun"), 3):
        pass
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="rank 1 could not join a process group of 2 within 3 s.*RDZV_TCP_STORE=1"):
        with exit_if_peers_missing(Launch(1, 1, 2, "torchrun"), 3):
            raise RuntimeError("DistStoreError: timed out")


def test_bf16_autocast_runs_matmuls_in_bf16():
    layer = torch.nn.Linear(4, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert layer(torch.randn(2, 4)).dtype == torch.float32


# ---- Lightning: --devices and --num-nodes agree with the launcher, or one sentence says why not ----

def trainer_flags(environ, *argv):
    import argparse

    from common.cli import add_lightning_flags
    return add_lightning_flags(argparse.ArgumentParser(), environ).parse_args(list(argv))


def test_lightning_flags_default_to_what_the_launcher_started():
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    srun = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert vars(trainer_flags(torchrun)) == {"devices": 4, "num_nodes": 2}
    assert vars(trainer_flags(srun)) == {"devices": 2, "num_nodes": 2}
    assert vars(trainer_flags({})) == {"devices": "auto", "num_nodes": 1}
    assert vars(trainer_flags({}, "--devices", "2")) == {"devices": 2, "num_nodes": 1}


def test_lightning_layout_that_differs_from_the_launcher_is_one_sentence():
    from common.lightning_launch import check_launch
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    check_launch(2, 1, torchrun)  # agrees: nothing to say
    with pytest.raises(SystemExit, match=r"torchrun started 2 processes, 2 per node on 1 node\(s\), but --devices 1"):
        check_launch(1, 1, torchrun)


def test_lightning_ignores_slurm_in_an_interactive_job(monkeypatch):
    """Lightning's own detection, on the variables srun sets inside salloc (whose job is named
    "interactive"): SLURM is ignored there, so check_launch stops first and says to name the step."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from common.lightning_launch import check_launch
    srun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2"}
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert SLURMEnvironment.detect()
    check_launch(2, 1, {**srun, "SLURM_JOB_NAME": "train"})
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert not SLURMEnvironment.detect()
    with pytest.raises(SystemExit, match="srun -J train"):
        check_launch(2, 1, {**srun, "SLURM_JOB_NAME": "interactive"})


def test_lightning_refuses_ntasks_without_tasks_per_node(monkeypatch):
    """sbatch --ntasks=2 sets no SLURM_NTASKS_PER_NODE: Lightning raises when it reads the job; one sentence first."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from common.lightning_launch import check_launch
    srun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_JOB_NAME": "train"}
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="--ntasks-per-node"):
        SLURMEnvironment()
    with pytest.raises(SystemExit, match="--ntasks=2 alone"):
        check_launch(2, 1, srun)
