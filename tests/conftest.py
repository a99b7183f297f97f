import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The CPU suite runs on the CPU even where there are GPUs: hidden from this process (before anything
# initializes CUDA) and from every process it starts. test_gpu.py gets them back from GPU_DEVICES. The
# pytest-xdist workers are started by a process that has already hidden them: the session's setting
# reaches them in SESSION_GPUS ("unset" where the variable was).
SESSION_GPUS = "CPU_SUITE_SESSION_CUDA_VISIBLE_DEVICES"
os.environ.setdefault(SESSION_GPUS, os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
GPU_DEVICES = None if os.environ[SESSION_GPUS] == "unset" else os.environ[SESSION_GPUS]
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The suite runs more processes than the machine has cores. An OpenMP thread of torch's (GNU libgomp in torch's
# wheels) that has done its share of an operation spins a while before it sleeps, on a core another process
# needs; PASSIVE makes it sleep at once, and changes nothing the processes compute. Set before the workers start,
# as above, so that every process of the suite, SLURM's jobs included, reads it; a value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import warm_python  # noqa: E402  (tests/ modules after the settings above, which every process of the suite reads)
from mnist_files import write_tiny_mnist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TEST_IMAGES = 101  # divides by neither 2 nor 3 processes


# pyproject's addopts run the suite on pytest-xdist workers, each file on one worker (--dist loadfile:
# a file's module fixtures, such as the SLURM cluster, are made once), handed out in collection order.
# The files that take longest (measured on a 2-core CPU) go first, so that no worker is left running one of
# them alone at the end: every chapter script launched afresh on one worker, the DeepSpeed rungs on the other,
# then the fault-tolerant tests, mostly waiting on their groups' timeouts, beside busy files rather than beside
# other waits.
LONGEST_FIRST = ["test_as_users_run.py", "test_deepspeed_rungs.py", "test_fault_tolerant.py", "test_resume.py", "test_slurm.py", "test_gpu_paths.py",
                 "test_warm_launch.py", "test_benchmarks.py", "test_compile.py", "test_notebooks.py", "test_lessons.py",
                 "test_simulate.py", "test_debugging.py", "test_figures.py", "test_deepspeed.py", "test_data_pipeline.py",
                 "test_nli_scripts.py", "test_plan.py", "test_nli_trainer.py", "test_hsdp.py", "test_mnist_scripts.py",
                 "test_uneven.py", "test_launch.py"]


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """--numprocesses=auto: one worker per CPU this process may run on (a container's CPUs, not the
    host's), at most 8."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return min(8, len(usable))


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """What a worker holds once it has collected the suite (the libraries, every test) it holds to its end: frozen
    out of the garbage collector's scans, so that a collection during a test (planner.simulate asks for one each
    simulation) scans what the test made, as it would in a process of its own, not the worker's half a million."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory) -> Path:
    return write_tiny_mnist(tmp_path_factory.mktemp("mnist"), train_size=192, test_size=TEST_IMAGES)


def offline_env(extra=None) -> dict:
    """This process's environment, offline: any download attempt fails at once instead of reaching
    (or waiting on) the network."""
    return {**os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1",
            "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_as_user(*args, cwd=ROOT, timeout=180, env_extra=None):
    """Run a command as a user would, from the repository root, offline, with a time limit. `python SCRIPT`
    runs forked from a process that has imported torch in the same environment (tests/warm_python.py), and ends
    as python ends; tests/test_as_users_run.py launches every chapter script afresh."""
    env = offline_env(env_extra)
    try:
        if args[0] == PYTHON and str(args[1]).endswith(".py"):
            return warm_python.run(args[1:], cwd, env, timeout)
        return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        out, err = (text.decode(errors="replace") if isinstance(text, bytes) else text for text in (expired.stdout, expired.stderr))
        pytest.fail(f"{' '.join(map(str, args))} did not finish within {timeout} s:\n{out}\n{err}")


@pytest.fixture
def run_command():
    return run_as_user


# torchrun itself, and torchrun whose workers are forks of the warm server that forked it (tests/warm_torchrun.py):
# the suite's runs, each worker started about 3 CPU seconds sooner, ended as a fresh one ends. The runs that prove
# what holds between fresh interpreters (equal weights across ranks, which each draw their own hash seed) or read
# torchrun's summary of a failed script by its name use torchrun itself.
TORCHRUN_FRESH = [PYTHON, "-m", "torch.distributed.run", "--standalone"]
TORCHRUN = [PYTHON, str(ROOT / "tests" / "warm_torchrun.py"), "--standalone"]
# accelerate launch listens on port 29500 unless told otherwise, and two pytest-xdist workers launching at
# once would race for it: each worker has its own (29500 itself stays the notebooks' notebook_launcher's).
# The suite's runs fork its processes as TORCHRUN does (tests/warm_accelerate.py); ACCELERATE_FRESH is
# accelerate launch itself.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
ACCELERATE_FRESH = [PYTHON, "-m", "accelerate.commands.launch", "--main_process_port", str(29510 + WORKER)]
ACCELERATE = [PYTHON, str(ROOT / "tests" / "warm_accelerate.py"), "--main_process_port", str(29510 + WORKER)]


def assert_ran(result, *phrases):
    """A run that exits 0 and prints each phrase; on failure, the output says why."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    for phrase in phrases:
        assert phrase in result.stdout, result.stdout


def assert_clear_error(result, *phrases):
    """Bad input ends with a non-zero exit and one sentence on stderr, never a traceback."""
    assert result.returncode != 0
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


EVAL_PAIRS = 13  # 10% of 130 pairs: divides by neither 2 nor 3 processes


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    from nli_files import write_tiny_bert
    return write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def nli_pairs(tmp_path_factory) -> Path:
    from nli_files import write_nli_pairs
    return write_nli_pairs(tmp_path_factory.mktemp("nli") / "pairs.jsonl", count=130)
