"""The suite's launches forked from a process that imported torch once start and end their processes as fresh
interpreters do: tests/warm_torchrun.py (the suite's TORCHRUN) each worker as torchrun itself starts it,
tests/warm_accelerate.py (ACCELERATE) each as accelerate launch does,
tests/warm_python.py (run_as_user's `python SCRIPT`) each process as python does. The same process facts,
the same endings, a fault at the interpreter's teardown included. One thing a fork cannot give: each interpreter
draws its own hash seed, and forks share their parent's; the runs that prove equality across ranks use torchrun
itself (TORCHRUN_FRESH)."""
import json
import multiprocessing
import runpy
import signal
import subprocess
import textwrap

import pytest
import warm_python
from conftest import ACCELERATE, ACCELERATE_FRESH, PYTHON, ROOT, TORCHRUN, TORCHRUN_FRESH, offline_env, run_as_user

PROBE = ROOT / "tests" / "process_facts.py"
PROCESSES = 2  # the process facts hold rank by rank: two ranks show what differs between them
TORCHS_OWN_FORK = [*TORCHRUN_FRESH, "--run-path", "--start-method", "fork"]  # the negative control: no fresh_process.py


def facts_of(folder, processes):
    facts = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(processes)]
    return facts, [(folder / f"rank{rank}.exit").exists() for rank in range(processes)]


def launch(launcher, folder, end="return"):
    """The probe under torchrun (its flags for the process count) or accelerate launch (its own)."""
    folder.mkdir()
    if launcher in (ACCELERATE, ACCELERATE_FRESH):
        sized, timeout = ["--multi_gpu", "--num_processes", PROCESSES, "--num_machines", 1, "--mixed_precision", "no",
                          "--dynamo_backend", "no"], 90
    else:
        sized, timeout = [f"--nproc_per_node={PROCESSES}", "--monitor-interval=0.1"], 60
    result = run_as_user(*launcher, *sized, PROBE, end, folder, timeout=timeout)
    if not all((folder / f"rank{rank}.json").exists() for rank in range(PROCESSES)):
        pytest.fail(f"a rank did not start (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return (result, *facts_of(folder, PROCESSES))


@pytest.fixture(scope="module")
def torchrun_itself(tmp_path_factory):
    """launch(TORCHRUN_FRESH, ...), each way of ending run once: several tests compare with it."""
    runs = {}

    def launched(end="return"):
        if end not in runs:
            runs[end] = launch(TORCHRUN_FRESH, tmp_path_factory.mktemp("fresh") / "run", end)
        return runs[end]
    return launched


def alike(facts):
    """What must match: each rank's facts, the random draws replaced by whether they differ between ranks."""
    draws = {rank["numpy draw"] for rank in facts}
    return [{**{k: v for k, v in rank.items() if k not in ("numpy draw", "hash")}, "numpy draws differ": len(draws) == len(facts)}
            for rank in facts]


def test_a_forked_worker_starts_as_torchrun_starts_one(tmp_path, torchrun_itself):
    _, fresh, fresh_exits = torchrun_itself()
    _, warm, warm_exits = launch(TORCHRUN, tmp_path / "warm")
    assert alike(warm) == alike(fresh)
    assert warm_exits == fresh_exits == [True] * PROCESSES
    assert len({rank["hash"] for rank in fresh}) == PROCESSES  # a seed each
    assert len({rank["hash"] for rank in warm}) == 1  # the launcher's, shared: what only TORCHRUN_FRESH shows


def test_a_forked_worker_starts_as_accelerate_launch_starts_one(tmp_path):
    """accelerate launch's multi-process path, as the CPU configs select it: the same facts and variables in
    each worker. The shared hash seed shows the warm launch forked (and a fresh launch did not)."""
    fresh_run, fresh, fresh_exits = launch(ACCELERATE_FRESH, tmp_path / "fresh")
    warm_run, warm, warm_exits = launch(ACCELERATE, tmp_path / "warm")
    assert fresh_run.returncode == warm_run.returncode == 0, warm_run.stderr[-2000:]
    assert alike(warm) == alike(fresh)
    assert fresh[0]["launcher's variables"]["ACCELERATE_MIXED_PRECISION"] == "no"
    assert warm_exits == fresh_exits == [True] * PROCESSES
    assert len({rank["hash"] for rank in fresh}) == PROCESSES and len({rank["hash"] for rank in warm}) == 1


def test_torchs_own_fork_would_not(tmp_path, torchrun_itself):
    """The negative control: torchrun's own fork (--run-path --start-method fork), without tests/as_python.py's
    afresh(), leaves each worker in the launcher's session, with its signal handlers, thread name and numpy random
    state."""
    _, fresh, _ = torchrun_itself()
    _, forked, _ = launch(TORCHS_OWN_FORK, tmp_path / "forked")
    assert fresh[0]["handlers"]["SIGTERM"] == "default"
    assert forked[0]["handlers"]["SIGTERM"] == "_terminate_process_handler"
    assert not forked[0]["own session"] and forked[0]["thread name"] == "pt_elastic"
    assert alike(forked) != alike(fresh)


def test_a_worker_that_ends_its_process_itself_ends_the_run(tmp_path, torchrun_itself):
    """common.distributed.exit_process ends each rank's process without returning from the script, after
    the exit functions: torchrun's fork path alone would wait for such a worker forever."""
    fresh, _, fresh_exits = torchrun_itself("exit_process")
    warm, _, warm_exits = launch(TORCHRUN, tmp_path / "warm", "exit_process")
    assert fresh.returncode == warm.returncode == 0, warm.stderr[-2000:]
    assert warm_exits == fresh_exits == [True, True]


def test_a_sentence_to_sys_exit_is_printed_and_fails_the_run(tmp_path, torchrun_itself):
    fresh, _, _ = torchrun_itself("message")
    warm, _, _ = launch(TORCHRUN, tmp_path / "warm", "message")
    assert fresh.returncode == warm.returncode == 1
    assert "stops with a sentence" in fresh.stderr and "stops with a sentence" in warm.stderr, warm.stderr[-2000:]


# ---- a fault at teardown: what the interpreter does after the script's last line ----

TEARDOWN_FAULTS = {  # each after a script's last line, as gloo's threads abort or hang a process that has finished
    "an exit function aborts": "import atexit, os\natexit.register(os.abort)\n",
    "the C library's exit handler aborts": "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.on_exit(libc.abort, None)\n",
    "a thread never ends": "import threading\nthreading.Thread(target=threading.Event().wait).start()\n",
}
HUNG = "still running"


def ending(run, *args, timeout=4):
    """How a run ended: its exit code, or HUNG past its time limit."""
    try:
        return run(*args, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return HUNG


def faulty(tmp_path, fault):
    script = tmp_path / "faulty.py"
    script.write_text("print('the last line', flush=True)\n" + TEARDOWN_FAULTS[fault])
    return script


def fresh_python(script, timeout):
    return subprocess.run([PYTHON, script], cwd=ROOT, env=offline_env(), capture_output=True, timeout=timeout)


def in_multiprocessing_fork(script, timeout):
    """The script in a child of multiprocessing's fork start method, which ends with os._exit: the way the suite
    must not fork."""
    child = multiprocessing.get_context("fork").Process(target=runpy.run_path, args=(str(script),), kwargs={"run_name": "__main__"})
    child.start()
    child.join(timeout)
    if child.exitcode is None:
        child.kill()
        child.join()
        raise subprocess.TimeoutExpired(str(script), timeout)
    return subprocess.CompletedProcess(str(script), child.exitcode)


@pytest.mark.parametrize("fault", TEARDOWN_FAULTS)
def test_a_fault_at_teardown_ends_a_forked_python_as_it_ends_python(tmp_path, fault):
    """A fork of the warm server ends through the interpreter's own exit: a script that fails only after its last
    line fails forked as it fails fresh, with the same exit code (SIGABRT) or the same hang."""
    script = faulty(tmp_path, fault)
    fresh = ending(fresh_python, script)
    assert fresh in (-signal.SIGABRT, HUNG)
    assert ending(lambda *a, timeout: warm_python.run(a, ROOT, offline_env(), timeout), script) == fresh


@pytest.mark.parametrize("fault", [fault for fault in TEARDOWN_FAULTS if "aborts" in fault])
def test_a_fork_that_ends_with_os_exit_would_pass_a_faulty_script(tmp_path, fault):
    """The negative control: the same script in multiprocessing's fork, which ends its child with os._exit, exits 0:
    the interpreter's teardown, where the fault is, never runs."""
    script = faulty(tmp_path, fault)
    assert ending(fresh_python, script) == -signal.SIGABRT
    assert ending(in_multiprocessing_fork, script) == 0


def test_a_fault_at_teardown_fails_a_warm_torchrun_as_it_fails_torchrun(tmp_path):
    """Each rank's worker forked (tests/warm_worker.py) aborts at its exit as a fresh one does: torchrun fails the
    run, with the abort in its summary."""
    script = faulty(tmp_path, "the C library's exit handler aborts")
    fresh = run_as_user(*TORCHRUN_FRESH, "--nproc_per_node=2", script, timeout=60)
    warm = run_as_user(*TORCHRUN, "--nproc_per_node=2", script, timeout=60)
    assert fresh.returncode == warm.returncode == 1
    for result in (fresh, warm):
        assert "the last line" in result.stdout and "Signal 6 (SIGABRT)" in result.stderr, result.stderr[-2000:]


# ---- python SCRIPT ----

def python(folder, end, warm, env_extra=None):
    folder.mkdir()
    command, env = [PROBE, end, folder], offline_env(env_extra)
    result = warm_python.run(command, ROOT, env, timeout=60) if warm else \
        subprocess.run([PYTHON, *map(str, command)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return (result, *facts_of(folder, 1))


@pytest.mark.parametrize("end, code, said", [("return", 0, ""), ("exit_process", 0, ""),
                                             ("message", 1, "rank 0 stops with a sentence"), ("raise", 1, "ValueError: a bug")])
def test_a_forked_python_starts_and_ends_as_python_does(tmp_path, end, code, said):
    fresh, fresh_facts, fresh_exits = python(tmp_path / "fresh", end, warm=False)
    warm, warm_facts, warm_exits = python(tmp_path / "warm", end, warm=True)
    assert [{**facts, "numpy draw": 0, "hash": 0} for facts in warm_facts] == [{**facts, "numpy draw": 0, "hash": 0} for facts in fresh_facts]
    assert fresh.returncode == warm.returncode == code
    assert said in fresh.stderr and said in warm.stderr, warm.stderr
    assert ("Traceback" in warm.stderr) == ("Traceback" in fresh.stderr)
    assert warm_exits == fresh_exits == [True]


@pytest.mark.parametrize("blind", [False, True])
def test_a_forked_python_in_another_environment_starts_as_python_does_in_it(tmp_path, monkeypatch, blind):
    """A fresh interpreter reads its environment as it starts (here PYTHONPATH into sys.path and PYTHONOPTIMIZE
    into sys.flags): a command in an environment other than the suite's gets a server started in it. Control:
    servers shared across environments, and the fork has the first one's."""
    if blind:
        monkeypatch.setattr(warm_python, "_imported_with", lambda env: {})
    python(tmp_path / "suite", "return", warm=True)  # the suite's environment, and its server, first
    other = {"PYTHONPATH": str(tmp_path / "lib"), "PYTHONOPTIMIZE": "1"}
    _, fresh, _ = python(tmp_path / "fresh", "return", warm=False, env_extra=other)
    _, warm, _ = python(tmp_path / "warm", "return", warm=True, env_extra=other)
    assert fresh[0]["sys.path after it"][0] == other["PYTHONPATH"] and "optimize=1" in fresh[0]["interpreter flags"]
    assert (alike(warm) == alike(fresh)) != blind


def test_forked_pythons_run_side_by_side(tmp_path):
    """One server forks each command as it comes: the first waits for a file only the second writes."""
    waiter, writer = tmp_path / "wait.py", tmp_path / "write.py"
    waiter.write_text(f"import pathlib, time\nwhile not pathlib.Path({str(tmp_path / 'written')!r}).exists(): time.sleep(0.05)\n")
    writer.write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'written')!r}).write_text('')\n")
    with open(tmp_path / "out", "w") as out:
        first = warm_python.start([waiter], ROOT, offline_env(), out, out)
        second = warm_python.start([writer], ROOT, offline_env(), out, out)
        assert second.wait(timeout=30) == 0
        assert first.wait(timeout=30) == 0


def test_each_forked_python_draws_its_own_numpy_seed(tmp_path):
    """Forks of one server would all draw the same numbers: tests/as_python.py's afresh() reseeds each."""
    draws = {python(tmp_path / str(run), "return", warm=True)[1][0]["numpy draw"] for run in range(3)}
    assert len(draws) == 3


def test_a_forked_python_past_its_time_limit_is_killed_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([PROBE, "sleep", tmp_path], ROOT, offline_env(), timeout=3)
    assert not (tmp_path / "rank0.exit").exists()  # killed, not ended
    assert python(tmp_path / "next", "return", warm=True)[0].returncode == 0


SIGNALS = ("import json, signal; print(json.dumps({name: str(signal.getsignal(getattr(signal, name))) "
           "for name in ('SIGHUP', 'SIGINT', 'SIGQUIT', 'SIGTERM', 'SIGUSR1', 'SIGPIPE')}), flush=True)")


def as_nohup_in_a_background_command():
    for number in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, signal.SIG_IGN)


@pytest.mark.parametrize("blind", [False, True])
def test_the_signals_a_parent_ignores_stay_ignored_in_a_fork(blind):
    """A launcher started under nohup in a background command (SIGHUP, SIGINT and SIGQUIT ignored from its start) that
    then handles SIGINT and SIGTERM, as torchrun does: a process it starts afresh has what exec leaves (ignored
    stays ignored, handled goes back to the default, then Python's own), and a fork of it after afresh() the same.
    Control: afresh() blind to what the fork inherited gives the defaults, and the two differ."""
    launcher = "\n".join([
        "import importlib, os, signal, subprocess, sys", "sys.path.insert(0, 'tests')", "import as_python",
        "for module in as_python.PRELOAD: importlib.import_module(module)  # as a warm launcher has",
        "signal.signal(signal.SIGINT, print); signal.signal(signal.SIGTERM, print)  # a launcher's handlers",
        f"subprocess.run([sys.executable, '-c', {SIGNALS!r}])",
        "signal.getsignal = lambda number: signal.SIG_DFL" if blind else "",
        "if os.fork() == 0:", "    as_python.afresh()", textwrap.indent(SIGNALS, "    "), "    os._exit(0)", "os.wait()"])
    result = subprocess.run([PYTHON, "-c", launcher], cwd=ROOT, preexec_fn=as_nohup_in_a_background_command,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    fresh, forked = map(json.loads, result.stdout.splitlines())
    assert fresh["SIGHUP"] == fresh["SIGQUIT"] == str(signal.SIG_IGN) and fresh["SIGINT"] != str(signal.SIG_IGN)
    assert (forked == fresh) != blind, (forked, fresh)


@pytest.mark.parametrize("blind", [False, True])
def test_a_forked_python_ignores_the_signals_its_caller_ignores_now(tmp_path, monkeypatch, blind):
    """The server keeps the signals ignored at its start; the caller may ignore others since (a test, a library,
    a shell's background command ending its job control): the fork has the caller's, as its own `python` would.
    Control: a request without them leaves the server's, and the two differ."""
    if blind:
        monkeypatch.setattr(warm_python, "ignored_signals", lambda: None)
    script = tmp_path / "signals.py"
    script.write_text(SIGNALS.replace("'SIGPIPE'", "'SIGPIPE', 'SIGUSR2'"))
    env = offline_env({"SIGNALS_TEST": str(tmp_path)})  # an environment, and so a server, of this test's own
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        warm_python.run([script], ROOT, env, timeout=60)  # the server starts, SIGUSR2 ignored
    finally:
        signal.signal(signal.SIGUSR2, before)
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        fresh = subprocess.run([PYTHON, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        warm = warm_python.run([script], ROOT, env, timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, before)
    fresh, warm = json.loads(fresh.stdout), json.loads(warm.stdout)
    assert fresh["SIGUSR1"] == str(signal.SIG_IGN) and fresh["SIGUSR2"] != str(signal.SIG_IGN)
    assert (warm == fresh) != blind, (warm, fresh)
