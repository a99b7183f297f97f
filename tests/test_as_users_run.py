"""Every chapter script, launched once as its page and docstring say: a fresh `python`, `torchrun` or `accelerate
launch` process (the commands `pip install -e .` put beside the suite's python), at the page's process count, on
tiny data, ending through the interpreter's own teardown, where gloo's threads abort a process or hang it.

Each run must print its last line, then end within EXIT_WITHIN seconds (a launcher ends after its workers) with the
exit code the page shows, and no launcher may report a failed rank, even one it then restarted: torchrun's
--max-restarts would turn a rank that aborted at its exit into a rerun that passes. A hang at exit fails the test
in one sentence that names the script.
"""
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import EVAL_PAIRS, ROOT, TEST_IMAGES, offline_env
from process_tree import kill_tree

BIN = Path(sys.executable).parent  # where `pip install -e .` put python, torchrun and accelerate
EXIT_WITHIN = 30  # seconds from the last line to the launcher's end; it ends its workers in about 1
# torchrun's words for a worker that failed: its error log as the worker ends (restarted or not), then its summary
LAUNCHER_FAILED = ("failed (exitcode:", "Failures:", "ChildFailedError")


@dataclass(frozen=True)
class Launch:
    command: str  # as the page writes it, with {mnist}, {bert}, {pairs}, {tmp} for the test's files
    last: str  # words of the line the script prints last, on stdout or stderr: they start the exit clock
    env: tuple = ()  # variables the page exports first
    says: tuple = ()  # more of what the page shows it print


# A rung on the test's data evaluates on every test image or pair once, and one rank prints the accuracy: over how many.
EVALUATED = {"{mnist}": f"over {TEST_IMAGES} images", "{bert}": f"over {EVAL_PAIRS} pairs"}


MNIST = "--data-dir {mnist} --epochs 1"
BERT = "--model {bert} --dataset {pairs} --max-steps 2 --batch-size 12"
RESUMABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"
# accelerate launch listens on port 29500 unless told otherwise, as the notebooks' runs do; port 0 is its "any free one"
CPU_2 = "src/ch4/accelerate_configs/cpu_2_processes.yaml --main_process_port 0"

LAUNCHES = {
    "mnist_1_single.py": Launch(f"python src/ch4/mnist_1_single.py {MNIST}", "test accuracy"),
    "mnist_2_data_parallel.py": Launch(f"python src/ch4/mnist_2_data_parallel.py {MNIST}", "test accuracy"),
    "mnist_3_ddp.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/mnist_3_ddp.py {MNIST}", "test accuracy"),
    "mnist_4_accelerate.py": Launch(f"accelerate launch --config_file {CPU_2} src/ch4/mnist_4_accelerate.py {MNIST}",
                                    "test accuracy"),
    "mnist_5_lightning.py": Launch(f"python src/ch4/mnist_5_lightning.py --devices 2 {MNIST}", "test accuracy"),
    "nli_dp_minimal.py": Launch(f"python src/ch4/nli_dp_minimal.py {BERT}", "accuracy"),
    "nli_ddp_minimal.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/nli_ddp_minimal.py {BERT}", "accuracy",
                                 says=("global batch 12 = 2 x 6",)),
    "data_parallel.py": Launch(f"python src/ch4/data_parallel.py {BERT}", "accuracy"),
    "nli_loss_in_forward.py": Launch(f"python src/ch4/nli_loss_in_forward.py {BERT}", "accuracy"),
    "ddp.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/ddp.py {BERT}", "accuracy", says=("global batch 12 = 2 x 6",)),
    "nli_accelerate.py": Launch(f"accelerate launch --config_file {CPU_2} src/ch4/nli_accelerate.py {BERT}", "accuracy"),
    "nli_trainer.py": Launch(f"torchrun --nproc_per_node=3 src/ch4/nli_trainer.py {BERT}", "accuracy"),
    "data_pipeline/mnist_workers.py": Launch(
        "torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/data_pipeline/mnist_workers.py --num-workers 2 "
        f"--augment 2 --checkpoint-dir {{tmp}}/workers {MNIST}", "test accuracy", (RESUMABLE,)),
    "data_pipeline/mnist_stateful.py": Launch(
        "torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/data_pipeline/mnist_stateful.py --num-workers 2 "
        f"--augment 2 --checkpoint-dir {{tmp}}/stateful {MNIST}", "test accuracy", (RESUMABLE,)),
    "data_pipeline/mnist_stream.py": Launch(
        "torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/data_pipeline/mnist_stream.py --num-workers 2 "
        f"--augment 2 --checkpoint-dir {{tmp}}/stream --stream-dir {{tmp}}/shards {MNIST}", "test accuracy", (RESUMABLE,)),
    "debugging/rank0_collective.py": Launch("torchrun --nproc_per_node=2 src/ch4/debugging/rank0_collective.py --fixed",
                                            "epoch 3: accuracy"),
    "debugging/shape_mismatch.py": Launch("torchrun --nproc_per_node=2 src/ch4/debugging/shape_mismatch.py --fixed",
                                          "gathered 101 predictions"),
    "debugging/stuck_outside.py": Launch("torchrun --nproc_per_node=2 src/ch4/debugging/stuck_outside.py --fixed",
                                         "every rank read 3 words"),
    "debugging/dead_rank.py": Launch("torchrun --nproc_per_node=2 src/ch4/debugging/dead_rank.py --fixed", "trained 3 steps"),
    "debugging/unused_parameter.py": Launch("torchrun --nproc_per_node=2 src/ch4/debugging/unused_parameter.py --fixed",
                                            "trained 4 steps"),
    "debugging/silently_wrong.py": Launch("torchrun --nproc_per_node=3 src/ch4/debugging/silently_wrong.py --fixed",
                                          "loss_sum: with reduction='mean', 3 ranks step 1.00 times"),
    "fault_tolerant/mnist_3_ddp_ft.py": Launch(
        f"torchrun --standalone --nproc_per_node=1 src/ch4/fault_tolerant/mnist_3_ddp_ft.py --group 0 {MNIST}",
        "train time", (("NUM_REPLICA_GROUPS", "1"),)),
    "fault_tolerant/mnist_fsdp_ft.py": Launch(
        f"torchrun --standalone --nproc_per_node=2 src/ch4/fault_tolerant/mnist_fsdp_ft.py --group 0 --groups 1 {MNIST}",
        "train time"),
    "resume/mnist_3_ddp_resume.py": Launch(
        f"torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/resume/mnist_3_ddp_resume.py --checkpoint-dir {{tmp}}/mnist {MNIST}",
        "test accuracy", (RESUMABLE,)),
    "resume/mnist_fsdp_resume.py": Launch(
        "torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/resume/mnist_fsdp_resume.py "
        f"--checkpoint-dir {{tmp}}/mnist-fsdp {MNIST}", "test accuracy", (RESUMABLE,)),
    "resume/ddp_resume.py": Launch(
        f"torchrun --nproc_per_node=2 --max-restarts=3 src/ch4/resume/ddp_resume.py --checkpoint-dir {{tmp}}/bert {BERT}",
        "accuracy", (RESUMABLE,)),
    "scale_out/mnist_comm_hooks.py": Launch(
        f"torchrun --nproc_per_node=2 src/ch4/scale_out/mnist_comm_hooks.py --comm-hook powersgd --powersgd-rank 4 {MNIST}",
        "test accuracy"),
    "scale_out/mnist_diloco.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/scale_out/mnist_diloco.py --sync-every 8 {MNIST}",
                                        "test accuracy"),
    "scale_out/mnist_hsdp.py": Launch(f"torchrun --nproc_per_node=4 src/ch4/scale_out/mnist_hsdp.py --replicas 2 {MNIST}",
                                      "test accuracy"),
    "sharded/mnist_fsdp.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/sharded/mnist_fsdp.py {MNIST}", "test accuracy"),
    "sharded/nli_fsdp.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/sharded/nli_fsdp.py {BERT}", "accuracy"),
    "sharded/mnist_deepspeed.py": Launch(
        f"torchrun --nproc_per_node=3 src/ch4/sharded/mnist_deepspeed.py --batch-size 96 --zero-stage 3 "
        f"--checkpoint-dir {{tmp}}/mnist-deepspeed {MNIST}", "test accuracy"),
    "sharded/nli_deepspeed.py": Launch(f"torchrun --nproc_per_node=2 src/ch4/sharded/nli_deepspeed.py --zero-stage 3 {BERT}",
                                       "accuracy"),
}


def test_every_chapter_script_is_launched():
    scripts = {str(path.relative_to(ROOT / "src" / "ch4")) for path in (ROOT / "src" / "ch4").rglob("*.py")}
    assert scripts == set(LAUNCHES)


def launch_as_user(command: list[str], last: str, env: dict, name: str, timeout: float = 180,
                   exit_within: float = EXIT_WITHIN) -> subprocess.CompletedProcess:
    """Run command, reading its output as it comes; fail in one sentence if it does not print `last` within timeout,
    or has not ended exit_within seconds after it did."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    seen, printed = threading.Event(), {"stdout": [], "stderr": []}

    def read(stream, lines):
        for line in stream:
            lines.append(line)
            if last in line:
                seen.set()
    readers = [threading.Thread(target=read, args=(getattr(process, stream), lines), daemon=True)
               for stream, lines in printed.items()]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while not seen.wait(0.2) and process.poll() is None and time.monotonic() < deadline:
        pass
    ended = _ends_within(process, exit_within) if seen.is_set() else process.poll() is not None
    if not ended:
        kill_tree(process.pid)
        process.wait()
    for reader in readers:
        reader.join(10)
    out, err = "".join(printed["stdout"]), "".join(printed["stderr"])
    if not seen.is_set():
        pytest.fail(f"{name} did not print {last!r} ({'exit ' + str(process.returncode) if ended else f'still running after {timeout} s'}):"
                    f"\n{out[-2000:]}\n{err[-3000:]}")
    if not ended:
        pytest.fail(f"{name} printed its last line and had not exited {exit_within} s later: it hangs at exit:"
                    f"\n{out[-1000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _ends_within(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def assert_launched_cleanly(result: subprocess.CompletedProcess, name: str) -> None:
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout[-1000:]}\n{result.stderr[-3000:]}"
    reported = [words for words in LAUNCHER_FAILED if words in result.stderr]
    assert not reported, f"{name}: its launcher reported {reported}:\n{result.stderr[-3000:]}"


def users_command(launch: Launch, files: dict) -> list[str]:
    words = launch.command.format(**files).split()
    return [str(BIN / words[0]), *words[1:]]


@pytest.fixture(scope="module")
def files(tiny_mnist, tiny_bert, nli_pairs):
    return {"mnist": tiny_mnist, "bert": tiny_bert, "pairs": nli_pairs}


@pytest.fixture(scope="module")
def lighthouse():
    """torchft's lighthouse, as the fault-tolerance page starts it (its own command), on a port of its own, listening."""
    from common.distributed import free_port
    port = free_port()
    process = subprocess.Popen([str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--join_timeout_ms", "1000",
                                "--quorum_tick_ms", "100", "--bind", f"[::]:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"torchft_lighthouse did not listen on port {port} (exit {process.poll()})")
            time.sleep(0.1)
    yield f"http://localhost:{port}"
    process.kill()
    process.wait()


@pytest.mark.parametrize("script", LAUNCHES)
def test_a_chapter_script_runs_and_exits_as_users_run_it(script, files, tmp_path, request):
    launch = LAUNCHES[script]
    if "deepspeed" in script:
        pytest.importorskip("deepspeed")
    env = offline_env(dict(launch.env))
    if "fault_tolerant" in script:
        pytest.importorskip("torchft")
        env["TORCHFT_LIGHTHOUSE"] = request.getfixturevalue("lighthouse")
    result = launch_as_user(users_command(launch, {**files, "tmp": tmp_path}), launch.last, env, script)
    assert_launched_cleanly(result, script)
    for phrase in launch.says:
        assert phrase in result.stdout, f"{script} did not print {phrase!r}:\n{result.stdout[-2000:]}"
    for data, evaluated in EVALUATED.items():
        if data in launch.command:
            assert result.stdout.count(evaluated) == 1, f"{script}: {evaluated!r} not once:\n{result.stdout[-2000:]}"


# ---- the negative controls: a rung with a fault planted after its last line fails its test ----

def planted(tmp_path, rung: str, fault: str) -> Path:
    """A copy of the rung whose process, once its last line is printed, hangs or aborts as it ends."""
    copy = tmp_path / Path(rung).name
    copy.write_text((ROOT / "src" / "ch4" / rung).read_text() + "\n" + fault)
    return copy


def test_a_rung_that_hangs_at_exit_fails_in_one_sentence(tmp_path, files):
    rung = planted(tmp_path, "mnist_1_single.py", "import threading\nthreading.Thread(target=threading.Event().wait).start()\n")
    command = [str(BIN / "python"), str(rung), *MNIST.format(**files).split()]
    with pytest.raises(pytest.fail.Exception, match="mnist_1_single.py printed its last line and had not exited 3 s later"):
        launch_as_user(command, "test accuracy", offline_env(), "mnist_1_single.py", exit_within=3)


def test_a_rung_whose_rank_aborts_at_exit_fails(tmp_path, files):
    """torchrun's summary names the rank that aborted after it printed its result; the test fails on it."""
    rung = planted(tmp_path, "mnist_3_ddp.py", "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.on_exit(libc.abort, None)\n")
    command = [str(BIN / "torchrun"), "--nproc_per_node=2", str(rung), *MNIST.format(**files).split()]
    result = launch_as_user(command, "test accuracy", offline_env(), "mnist_3_ddp.py")
    with pytest.raises(AssertionError, match="mnist_3_ddp.py exited 1"):
        assert_launched_cleanly(result, "mnist_3_ddp.py")
    assert "Signal 6 (SIGABRT)" in result.stderr


def test_a_rung_whose_rank_aborts_at_exit_once_fails_though_its_restart_passes(tmp_path, files):
    """Under --max-restarts, torchrun reruns a group whose rank aborted at its exit, and the rerun of a finished run
    exits 0: torchrun's exit code says nothing, its log of the failed worker does."""
    rung = planted(tmp_path, "resume/mnist_3_ddp_resume.py", "import atexit, os\n"
                   "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n    atexit.register(os.abort)\n")
    command = [str(BIN / "torchrun"), "--nproc_per_node=2", "--max-restarts=1", str(rung), "--checkpoint-dir",
               str(tmp_path / "checkpoints"), *MNIST.format(**files).split()]
    result = launch_as_user(command, "test accuracy", offline_env(dict([RESUMABLE])), "mnist_3_ddp_resume.py")
    assert result.returncode == 0, result.stderr[-3000:]
    with pytest.raises(AssertionError, match=r"its launcher reported \['failed \(exitcode:'\]"):
        assert_launched_cleanly(result, "mnist_3_ddp_resume.py")
