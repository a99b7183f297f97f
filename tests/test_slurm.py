"""The real slurm/ job scripts, submitted with sbatch (and one run in salloc) to a two-node SLURM cluster on localhost.

tests/slurm/local_cluster.sh installs SLURM if missing and starts munge, slurmctld and two slurmd
daemons (nodes n1 and n2). Where that is impossible (no root, no packages) the tests are skipped
with the reason; any other failure to start fails them. All jobs (and one salloc session, the
interactive recipe) start at once and run side by side, each with a time limit.
"""
import getpass
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TEST_IMAGES

HARNESS = ROOT / "tests" / "slurm" / "local_cluster.sh"
SKIP = 3  # the harness's exit code for "cannot start SLURM here"
# The fixtures below bound their own waits (the cluster's start 300 s, the jobs 420 s, the requeued jobs
# 300 s) and cancel what is left; pytest-timeout's 300 s per test would cut them short under load.
pytestmark = pytest.mark.timeout(900)
# name: launcher, its options, job script, chapter script, the world size it must report. torchrun on
# 2 nodes x 1 process is the salloc job's; 2 nodes x 2 processes takes the job script's one path with
# NPROC_PER_NODE=2 that a single node would, and a second node besides
JOBS = {
    "torchrun, 2 nodes x 2 processes": ("sbatch", ["-N2", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=2"],
                                        "slurm/torchrun.sbatch", "src/ch4/mnist_3_ddp.py", "4 processes"),
    "srun tasks, 2 nodes x 2 tasks": ("sbatch", ["-N2", "--ntasks-per-node=2", "--cpus-per-task=1"],
                                      "slurm/srun_tasks.sbatch", "src/ch4/mnist_3_ddp.py", "4 processes"),
    "accelerate, 2 nodes x 1 process": ("sbatch", ["-N2", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=1"],
                                        "slurm/accelerate.sbatch", "src/ch4/mnist_4_accelerate.py", "2 processes"),
    "accelerate, 1 node x 1 process, bf16": ("sbatch", ["-N1", "--cpus-per-task=2",
                                                        "--export=ALL,NPROC_PER_NODE=1,MIXED_PRECISION=bf16"],
                                             "slurm/accelerate.sbatch", "src/ch4/mnist_4_accelerate.py",
                                             "1 process on cpu, bf16"),
    "lightning, 2 nodes x 1 task": ("sbatch", ["-N2", "--ntasks-per-node=1", "--cpus-per-task=2"],
                                    "slurm/srun_tasks.sbatch", "src/ch4/mnist_5_lightning.py", "2 processes"),
    "lightning, 1 node x 2 tasks": ("sbatch", ["-N1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                                    "slurm/srun_tasks.sbatch", "src/ch4/mnist_5_lightning.py", "2 processes"),
    # MASTER_PORT: a port the test holds, so that the lighthouse's first start fails as when another process takes
    # the free port first, and the job script starts it again on another
    "torchft, 2 replica groups on 2 nodes": ("sbatch", ["-N2", "--ntasks-per-node=1", "--cpus-per-task=2",
                                                        "--export=ALL,MASTER_PORT={taken}"],
                                             "slurm/fault_tolerant.sbatch", "src/ch4/fault_tolerant/mnist_3_ddp_ft.py",
                                             "group 1 of 2"),
    "salloc, 2 nodes x 1 process": ("salloc", ["-N2", "--ntasks-per-node=1", "--cpus-per-task=2"],
                                    "slurm/torchrun.sbatch", "src/ch4/mnist_3_ddp.py", "2 processes"),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", HARNESS, "start", folder], capture_output=True, text=True, timeout=300)
    if started.returncode == SKIP:
        pytest.skip(f"SLURM cannot be started here: {started.stderr.strip()}")
    assert started.returncode == 0, f"SLURM did not start:\n{started.stdout}\n{started.stderr}"
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "PYTHON": sys.executable}
    yield folder, env
    subprocess.run(["bash", HARNESS, "stop", folder], timeout=60)


@pytest.fixture(scope="module")
def job_outputs(cluster, tiny_mnist):
    """Start every job at once (sbatch, or salloc running the job script as a user would in its shell); return
    for each job whether it succeeded, how it ended and its output. The test asks scontrol each second whether
    a job has ended: `sbatch --wait` asked after 2, 10, 42 and 74 s (measured on this cluster), so a job
    that ended at 43 s came back at 74 s."""
    folder, env = cluster
    running, jobs = {}, {}
    taken = socket.socket()  # bound, not listening: a bind fails on its port, a connection is refused
    taken.bind(("0.0.0.0", 0))
    for index, (name, (launcher, options, job_script, chapter_script, _)) in enumerate(JOBS.items()):
        output = folder / f"{index}.out"
        options = [option.format(taken=taken.getsockname()[1]) for option in options]
        flags = [chapter_script, "--data-dir", str(tiny_mnist), "--dist-timeout", "120"]
        if launcher == "sbatch":
            jobs[name] = (submit(["--time=5", f"--output={output}", *options, job_script, *flags], env), output)
        else:  # in the shell that salloc opens, a user runs the job script with bash
            running[name] = subprocess.Popen(["salloc", "--time=5", *options, "bash", job_script, *flags], cwd=ROOT,
                                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 420
    states = wait_until_ended([job for job, _ in jobs.values()], env, deadline)
    taken.close()
    results = {name: (states[job].startswith("JobState=COMPLETED"), states[job],  # COMPLETED: the script exited 0
                      output.read_text() if output.exists() else "") for name, (job, output) in jobs.items()}
    for name, process in running.items():
        try:
            process.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            subprocess.run(["scancel", "--user", getpass.getuser()], env=env)
        results[name] = (process.returncode == 0, f"salloc exited {process.returncode}", process.stdout.read())
    return results


def submit(arguments: list, env) -> str:
    """sbatch a job; return its id."""
    submitted = subprocess.run(["sbatch", "--parsable", *arguments], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def job_state(job, env) -> str:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return " ".join(field for field in shown.split() if field.startswith(("JobState=", "Reason=", "ExitCode=")))


ENDED = ("JobState=COMPLETED", "JobState=FAILED", "JobState=CANCELLED", "JobState=TIMEOUT", "JobState=OUT_OF_MEMORY",
         "JobState=NODE_FAIL")


def wait_until_ended(jobs: list[str], env, deadline: float, each_second=lambda states: None,
                     requeued=False) -> dict[str, str]:
    """Each job's state once all have ended or the deadline has passed (then the jobs left are cancelled), asking
    scontrol each second; each_second sees the states as they are. A job is asked about until it has ended (SLURM
    drops a job's record MinJobAge, 300 s by default, after its end), or, where jobs are requeued, until all have."""
    states = dict.fromkeys(jobs, "")
    while True:
        states |= {job: job_state(job, env) for job, state in states.items() if requeued or not state.startswith(ENDED)}
        left = [job for job, state in states.items() if not state.startswith(ENDED)]
        if not left or time.monotonic() > deadline:
            if left:
                subprocess.run(["scancel", *left], env=env)
            return states
        each_second(states)
        time.sleep(1)


@pytest.mark.parametrize("name", list(JOBS))
def test_job_trains_and_evaluates_exactly(job_outputs, name):
    succeeded, how, output = job_outputs[name]
    assert succeeded, f"{name}: {how or 'no record of the job'}\n{output[-4000:]}"
    assert f"over {TEST_IMAGES} images" in output, output[-4000:]
    assert JOBS[name][4] in output and " on cpu" in output, output[-4000:]
    cpus = next(option.split("=")[1] for option in JOBS[name][1] if option.startswith("--cpus-per-task"))
    assert f"{cpus} CPU(s) per" in output, output[-4000:]  # the job asked for them and passed them to srun
    if name.startswith("torchft"):  # its lighthouse failed on the port the test holds, and started on another
        assert "Address already in use" in output and "lighthouse at http://n1:" in output, output[-4000:]


def test_job_script_outside_an_allocation_says_how_to_submit():
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    result = subprocess.run(["bash", "slurm/torchrun.sbatch", "src/ch4/mnist_3_ddp.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "run this inside a SLURM allocation" in result.stderr


# tests/crash.py runs the script unchanged, 0.3 s slower per step until the requeue: a window to interrupt it
RESUME = ["tests/crash.py", "slow-first-run", "src/ch4/resume/mnist_3_ddp_resume.py", "--checkpoint-every", "4", "--batch-size", "32",
          "--epochs", "6", "--precision", "fp32", "--dist-timeout", "120"]
INTERRUPT = {  # how each job is stopped once it has trained an epoch
    "uninterrupted": None,
    "preempted (scontrol requeue)": lambda job: ["scontrol", "requeue", job],
    "time limit near (USR1 to the batch shell)": lambda job: ["scancel", "--signal=USR1", "--batch", job],
}


@pytest.fixture(scope="module")
def requeued_jobs(cluster, tiny_mnist):
    """Three 2-node jobs of slurm/requeue.sbatch at once. Two are interrupted after their first epoch; a
    requeued job waits about 2 minutes (its BeginTime) before SLURM starts it again, which the test cuts
    short with `scontrol update StartTime=now`. Returns each job's final state, output and checkpoint folder."""
    folder, env = cluster
    jobs = {}
    for name in INTERRUPT:
        checkpoints, output = folder / f"resume-{len(jobs)}", folder / f"resume-{len(jobs)}.out"
        job = submit(["--time=5", f"--output={output}", "-N2", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=1",
                      "slurm/requeue.sbatch", *RESUME, "--data-dir", str(tiny_mnist), "--checkpoint-dir", str(checkpoints)],
                     env)
        jobs[name] = (job, output, checkpoints)
    interrupted, released = set(), set()

    def interrupt_and_release(states):
        for name, (job, output, _) in jobs.items():
            text = output.read_text() if output.exists() else ""
            if INTERRUPT[name] and name not in interrupted and "epoch 0:" in text:
                subprocess.run(INTERRUPT[name](job), env=env, check=True, timeout=30)
                interrupted.add(name)
            if name in interrupted and name not in released and "Reason=BeginTime" in states[job]:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=30)
                released.add(name)
    states = wait_until_ended([job for job, _, _ in jobs.values()], env, time.monotonic() + 300, interrupt_and_release,
                              requeued=True)
    return {name: (states[job], output.read_text() if output.exists() else "", checkpoints)
            for name, (job, output, checkpoints) in jobs.items()}


@pytest.mark.parametrize("name", [name for name in INTERRUPT if INTERRUPT[name]])
def test_requeued_job_resumes_and_ends_bitwise_equal(requeued_jobs, name):
    from test_resume import bitwise_equal, final_state
    state, output, checkpoints = requeued_jobs[name]
    assert state.startswith("JobState=COMPLETED"), f"{name}: {state}\n{output[-4000:]}"
    assert "stopped by SIGTERM at step" in output and "after saving a checkpoint" in output, output[-4000:]
    assert "requeue: run 1 of job" in output and "resumed from" in output and f"over {TEST_IMAGES} images" in output
    if "USR1" in name:
        assert "USR1: time limit near: the workers save, then job" in output
    reference_state, reference_output, reference = requeued_jobs["uninterrupted"]
    assert reference_state.startswith("JobState=COMPLETED") and "resumed from" not in reference_output, reference_output
    assert bitwise_equal(final_state(checkpoints), final_state(reference))
