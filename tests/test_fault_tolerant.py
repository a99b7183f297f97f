"""The fault-tolerant rung (src/ch4/fault_tolerant/) with real processes: a lighthouse on a free port, one torchrun per
replica group, groups killed from outside (SIGKILL of the worker and of its torchrun agent, by PID) and started again.

What the lesson claims, each checked from the groups' --step-log and --save: the survivors never stop (their steps
go on, one after another, with fewer groups in the quorum); a group started again heals from a live peer (its first
step is its peers' step, not 0, and there is no checkpoint to read); every group ends with the same weights, bit for
bit, also after two kills one after the other and after a kill in the middle of a heal; a heal that copies nothing,
or only the weights, is caught (the negative controls). tests/ft_hooks.py slows the survivors while a group starts
again, marks a process that rests between two steps, and widens the heal, so that a kill lands where the test means
it to: a group killed with its quorum request at the lighthouse can be put in the next quorum (the lighthouse counts
it healthy until its heartbeat times out), and its peers then wait --dist-timeout for it.
"""
import json
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_ran, offline_env, run_as_user
from process_tree import alive, kill_tree

os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse logs every quorum at INFO
torchft = pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[ft]'")
from torchft.coordination import LighthouseServer  # noqa: E402

RUNG = "src/ch4/fault_tolerant/mnist_3_ddp_ft.py"
FSDP_RUNG = "src/ch4/fault_tolerant/mnist_fsdp_ft.py"
HOOKS = ROOT / "tests" / "ft_hooks.py"
# The heal fetches a peer's state over HTTP from the peer's host name: past offline_env's dead proxy.
LOCAL = {"no_proxy": f"localhost,127.0.0.1,::1,{socket.gethostname()}"}
WAIT = 90  # seconds any one wait below may take before the test fails with what it waited for
pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def lighthouse():
    """A lighthouse on a free port: test files run in parallel, each with its own."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                              heartbeat_timeout_ms=3000)
    yield server.address()
    server.shutdown()


class Groups:
    """Replica groups of one process each, started as a user starts them (torchrun), in a session of their own."""

    def __init__(self, folder: Path, lighthouse: str, data: Path, groups: int, steps: int, batch: int,
                 script: str = RUNG, nproc: int = 1):
        self.folder, self.lighthouse, self.data = folder, lighthouse, data
        self.groups, self.steps, self.batch, self.script, self.nproc = groups, steps, batch, script, nproc
        self.running, self.starts = {}, {}

    def start(self, group: int, hooks: str = "none", *flags) -> None:
        run = self.starts[group] = self.starts.get(group, 0) + 1
        (self.folder / "pids").mkdir(exist_ok=True)
        hooks = f"pids={self.folder / 'pids'},{hooks}"
        command = [*TORCHRUN, f"--nproc_per_node={self.nproc}", HOOKS, hooks, self.script, "--data-dir", self.data, "--group", group,
                   "--groups", self.groups, "--batch-size", self.batch, "--max-steps", self.steps,
                   "--lighthouse", self.lighthouse, "--quorum-timeout", 30, "--dist-timeout", 30,
                   "--step-log", self.log_path(group, run), "--summary", self.folder / f"summary{group}.json",
                   "--save", self.folder / f"weights{group}.pt", *flags]
        out = (self.folder / f"out{group}-{run}.txt").open("w")
        # as subprocess.Popen(command, ..., start_new_session=True) would, forked (tests/warm_python.py)
        self.running[group] = warm_python.start(command[1:], ROOT, offline_env(LOCAL), out, out, new_session=True)

    def log_path(self, group: int, run: int) -> Path:
        return self.folder / f"log{group}-{run}.jsonl"

    def log(self, group: int, run: int | None = None) -> list[dict]:
        path = self.log_path(group, run or self.starts[group])
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def step(self, group: int) -> int:
        return max((line["step"] for line in self.log(group)), default=-1)

    def resting(self, group: int, slow: Path) -> bool:
        """Whether a worker of the group sleeps in slow-while's hook, between two steps (tests/ft_hooks.py)."""
        return any(slow.parent.glob(f"{slow.name}.{group}.*"))

    def kill(self, group: int) -> None:
        """SIGKILL the agent, its workers and the processes that run their script (forks of a warm server, whose ids
        tests/ft_hooks.py writes), and wait until they are gone: killing the agent alone would leave them training."""
        agent = self.running.pop(group)
        ranks = list((self.folder / "pids").glob(f"{group}.*"))
        scripts = [int(path.read_text()) for path in ranks]
        kill_tree(*scripts, agent.pid)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in scripts):
            assert time.monotonic() < deadline, f"group {group}'s ranks outlived a SIGKILL by 10 s"
            time.sleep(0.05)
        for path in ranks:
            path.unlink()

    def wait_for(self, what: str, condition) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            for group, process in self.running.items():
                assert process.poll() is None, f"group {group} ended (exit {process.returncode}) while the test " \
                                               f"waited for {what}:\n{self.output(group)}"
            assert time.monotonic() < deadline, f"no {what} within {WAIT} s:\n" + "\n".join(
                self.output(group) for group in self.running)
            time.sleep(0.05)

    def finish(self) -> None:
        for group, process in self.running.items():
            try:
                assert process.wait(timeout=WAIT) == 0, f"group {group} exited {process.returncode}:\n{self.output(group)}"
            except subprocess.TimeoutExpired:
                pytest.fail(f"group {group} did not finish within {WAIT} s:\n{self.output(group)}")

    def output(self, group: int) -> str:
        return (self.folder / f"out{group}-{self.starts[group]}.txt").read_text()[-3000:]

    def weights(self, group: int) -> dict:
        return torch.load(self.folder / f"weights{group}.pt")

    def summary(self, group: int) -> dict:
        return json.loads((self.folder / f"summary{group}.json").read_text())

    def stop_all(self) -> None:
        for group in list(self.running):
            if self.running[group].poll() is None:
                self.kill(group)


@pytest.fixture
def make_groups(tmp_path, lighthouse, tiny_mnist):
    made = []

    def make(groups: int, steps: int, batch: int, **options) -> Groups:
        made.append(Groups(tmp_path, lighthouse, tiny_mnist, groups, steps, batch, **options))
        return made[-1]
    yield make
    for groups in made:
        groups.stop_all()


def equal_weights(groups: Groups, count: int) -> bool:
    weights = [groups.weights(group) for group in range(count)]
    return all(torch.equal(weights[0][name], other[name]) for other in weights[1:] for name in weights[0])


def kill_and_heal(groups: Groups, group: int, slow: Path) -> tuple[float, dict]:
    """Kill a group between two of its steps, start it again while the others train slowly; return when it was killed
    and its heal's line."""
    slow.touch()
    groups.wait_for(f"group {group} between two steps", lambda: groups.resting(group, slow))
    killed = time.time()
    groups.kill(group)
    for rested in slow.parent.glob(f"{slow.name}.{group}.*"):  # left by a rank killed as it slept there
        rested.unlink()
    groups.start(group, f"slow-while={slow}")
    groups.wait_for(f"a heal of group {group}", lambda: any(line["healed"] for line in groups.log(group)))
    # Slow until every group is back in one quorum: a kill while the others set up their process group for a new
    # quorum holds them for --dist-timeout, and a group left behind must find its peers still training to heal.
    groups.wait_for("every group in one quorum", lambda: all(
        groups.log(other) and groups.log(other)[-1]["participants"] == groups.groups for other in range(groups.groups)))
    slow.unlink()
    return killed, next(line for line in groups.log(group) if line["healed"])


def test_killed_groups_heal_from_a_live_peer_while_the_others_go_on(make_groups, tmp_path):
    """3 groups; group 1 is killed and started again, then group 2: the survivors' steps never stop, each restarted
    group takes its peers' step from a peer's state (no checkpoint exists), and all three end bit for bit equal."""
    slow = tmp_path / "slow"
    groups = make_groups(groups=3, steps=50, batch=12)
    for group in range(3):
        groups.start(group, f"slow-while={slow}")
    groups.wait_for("step 5 in every group", lambda: min(groups.step(group) for group in range(3)) >= 5)
    first_kill, first = kill_and_heal(groups, 1, slow)
    groups.wait_for("5 steps with group 1 back", lambda: groups.step(0) >= first["step"] + 5)
    second_kill, second = kill_and_heal(groups, 2, slow)
    groups.finish()

    assert first["step"] > 5 and second["step"] > first["step"]  # each took its peers' step, not 0
    survivor = groups.log(0)
    steps = [line["step"] for line in survivor if line["committed"]]
    # A step that failed under a kill may commit in one group and not in another (should_commit is per group):
    # the group left behind heals from a peer at the next quorum, so a survivor's steps rise, with a jump at most.
    assert all(later > earlier for earlier, later in zip(steps, steps[1:])) and steps[-1] == 50

    assert groups.starts[0] == 1 and groups.starts[1] == groups.starts[2] == 2  # group 0 ran once, throughout

    def committed_between(start, end, fewer):  # a step of group 0 with fewer than 3 groups, or with all 3
        return any(line["committed"] and start < line["time"] <= end and (line["participants"] < 3) == fewer
                   for line in survivor)
    # The quorum shrinks after each kill (at the latest in the step in which the restarted group heals: a healing
    # group takes part in no all-reduce) and is whole again between the kills.
    assert committed_between(first_kill, second_kill, fewer=True), "the quorum did not shrink after the first kill"
    assert committed_between(first["time"], second_kill, fewer=False), "no step of all 3 between the kills"
    assert committed_between(second_kill, float("inf"), fewer=True), "the quorum did not shrink after the second kill"
    assert sorted(path.name for path in tmp_path.glob("*.pt")) == [f"weights{group}.pt" for group in range(3)]
    assert all(groups.summary(group)["final_step"] == 50 for group in range(3))
    assert groups.summary(0)["max_participants"] == 3
    assert groups.summary(1)["heals"] >= 1 and groups.summary(2)["heals"] >= 1
    assert equal_weights(groups, 3)


def test_a_group_killed_in_the_middle_of_its_heal_leaves_its_peer_training(make_groups, tmp_path):
    """Group 1 joins late, and is killed while it fetches group 0's state: group 0 goes on alone; group 1 started
    again heals, and both end equal."""
    slow, healing = tmp_path / "slow", tmp_path / "healing"
    groups = make_groups(groups=2, steps=30, batch=12)
    slow.touch()
    groups.start(0, f"slow-while={slow}")
    groups.wait_for("step 3 in group 0", lambda: groups.step(0) >= 3)
    groups.start(1, f"slow-heal={healing}")
    groups.wait_for("group 1's heal to start", healing.exists)
    groups.kill(1)
    before = groups.step(0)
    groups.wait_for("3 more steps of group 0 alone", lambda: groups.step(0) >= before + 3)
    assert groups.log(0)[-1]["participants"] == 1
    groups.start(1)
    groups.wait_for("a heal of group 1", lambda: any(line["healed"] for line in groups.log(1)))
    slow.unlink()
    groups.finish()
    assert groups.log(1)[0]["step"] > before and groups.summary(1)["heals"] >= 1
    assert equal_weights(groups, 2)


def test_sharded_groups_heal_rank_by_rank(make_groups, tmp_path):
    """2 groups, each FSDP2 over 2 processes: group 1 (its agent and both workers) is killed and started again;
    each of its ranks heals its own pieces from the same rank of group 0, and the gathered weights end equal."""
    slow = tmp_path / "slow"
    groups = make_groups(groups=2, steps=30, batch=12, script=FSDP_RUNG, nproc=2)
    for group in range(2):
        groups.start(group, f"slow-while={slow}")
    groups.wait_for("step 3 in both groups", lambda: min(groups.step(group) for group in range(2)) >= 3)
    _, healed = kill_and_heal(groups, 1, slow)
    groups.finish()
    assert healed["step"] > 3 and groups.summary(1)["heals"] >= 1
    assert all(groups.summary(group)["final_step"] == 30 for group in range(2))
    assert equal_weights(groups, 2)


@pytest.mark.parametrize("bug", ["skip-heal-copy", "heal-weights-only"])
def test_a_heal_that_does_not_copy_the_whole_state_is_caught(make_groups, tmp_path, bug):
    """Negative controls: the same late join, with a heal that copies nothing, or the weights without the optimizer's
    moments. The step still jumps to the peers', and the weights end apart: the equality above can fail."""
    slow = tmp_path / "slow"
    groups = make_groups(groups=2, steps=20, batch=12)
    slow.touch()
    groups.start(0, f"slow-while={slow}")
    groups.wait_for("step 3 in group 0", lambda: groups.step(0) >= 3)
    groups.start(1, bug)
    groups.wait_for("a heal of group 1", lambda: any(line["healed"] for line in groups.log(1)))
    slow.unlink()
    groups.finish()
    assert groups.log(1)[0]["step"] > 3
    assert not equal_weights(groups, 2)


def test_a_group_started_with_other_flags_stops_at_its_heal(make_groups, tmp_path):
    """Group 1 joins late with another --seed: the state it heals from carries group 0's settings, and it stops with
    one sentence before it loads anything, while group 0 trains on to its last step."""
    slow = tmp_path / "slow"
    groups = make_groups(groups=2, steps=12, batch=12)
    slow.touch()
    groups.start(0, f"slow-while={slow}")
    groups.wait_for("step 3 in group 0", lambda: groups.step(0) >= 3)
    groups.start(1, "none", "--seed", "1")
    stopped = groups.running.pop(1).wait(timeout=WAIT)
    slow.unlink()
    groups.finish()
    output = (tmp_path / "out1-1.txt").read_text()
    assert stopped != 0 and "error: group 1 would heal from a group of another run (seed 0 there, 1 here)" in output, output
    assert "Traceback" not in output.split("failed (exitcode:")[0], output
    assert groups.summary(0)["final_step"] == 12


def test_no_lighthouse_no_quorum_no_torchft_each_one_sentence(lighthouse, tiny_mnist, tmp_path):
    """A lighthouse that does not answer, a quorum that cannot form (the lighthouse wants 2 groups, 1 came), torchft
    missing, a group number out of range: each ends the run with one sentence, within its timeout."""
    common = [*TORCHRUN, "--nproc_per_node=1", RUNG, "--data-dir", tiny_mnist, "--max-steps", 3, "--quorum-timeout", 2]
    strict = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=50)
    fake = tmp_path / "no_torchft" / "torchft"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'torchft'\")\n")
    runs = {"closed": ([*common, "--lighthouse", "http://localhost:9"], None),
            "alone": ([*common, "--lighthouse", strict.address()], None),
            "out of range": ([*common, "--lighthouse", lighthouse, "--group", 3, "--groups", 3], None),
            "missing": ([PYTHON, RUNG], {"PYTHONPATH": str(fake.parent)})}
    try:
        with ThreadPoolExecutor(len(runs)) as pool:  # side by side: each waits on a timeout, not on the CPU
            results = dict(zip(runs, pool.map(lambda run: run_as_user(*run[0], env_extra=run[1], timeout=60),
                                              runs.values())))
    finally:
        strict.shutdown()
    assert_one_sentence(results["closed"], "error: no lighthouse answered: failed to connect to http://localhost:9 within")
    assert_one_sentence(results["alone"], "error: no quorum formed within --quorum-timeout")
    assert_one_sentence(results["out of range"], "error: --group 3 is not one of the 3 groups 0 .. 2.")
    assert_one_sentence(results["missing"], "error: the fault-tolerant rungs need torchft", "pip install torchft==0.2.0")


@pytest.mark.parametrize("script", [RUNG, FSDP_RUNG])
def test_one_group_alone_trains_compiled(lighthouse, tiny_mnist, script):
    """A quorum of one commits every step; --compile (in place) leaves the state a peer would get as the model's."""
    result = run_as_user(*TORCHRUN, "--nproc_per_node=1", script, "--data-dir", tiny_mnist, "--lighthouse", lighthouse,
                         "--max-steps", 3, "--compile", "eager", env_extra=LOCAL, timeout=120)
    assert_ran(result, "1 of 1 groups in the quorum", f"over {TEST_IMAGES} images")


def test_a_commit_a_rank_reaches_too_late_is_one_sentence_not_a_missing_quorum(lighthouse, tiny_mnist):
    """A group of 2 FSDP2 processes whose rank 0 reaches its second commit 6 s late, with --dist-timeout 2: rank 1's
    should_commit times out with the same gRPC TimeoutError as a quorum that does not form, and the sentence says
    which (before, it said no quorum had formed)."""
    result = run_as_user(*TORCHRUN, "--nproc_per_node=2", HOOKS, "late-commit=6", FSDP_RUNG, "--data-dir", tiny_mnist,
                         "--lighthouse", lighthouse, "--max-steps", 4, "--batch-size", 12, "--dist-timeout", 2,
                         "--quorum-timeout", 30, env_extra=LOCAL, timeout=120)
    assert_one_sentence(result, "error: a step was not committed within --dist-timeout")
    assert "no quorum formed" not in result.stderr


def assert_one_sentence(result, *phrases):
    """A non-zero exit whose worker printed the sentence and no traceback (torchrun's agent adds its own report of
    the failed worker, which is not the script's)."""
    assert result.returncode != 0, result.stdout
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr[-3000:]
    worker = result.stderr.split("failed (exitcode:")[0]
    assert "Traceback" not in worker, result.stderr[-3000:]
