"""tools/durations.py, which turns a run's --durations=0 report into the time tables of docs/tests.md: a test's
phases add up (an id may hold spaces), and a test over the budget is flagged while one under it is not; and the
CPU seconds of the processes it launches, each noted once."""
import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import durations  # noqa: E402  (a tool, not a package)


def test_a_tests_phases_add_up_and_only_a_test_over_the_budget_is_flagged():
    report = "\n".join(["31.00s setup    tests/test_resume.py::test_x", "30.50s call     tests/test_resume.py::test_x",
                        "0.01s teardown tests/test_resume.py::test_x", "59.00s call     tests/test_plan.py::test_y[a b]",
                        "(5 durations < 0.005s hidden.)"])
    seconds = durations.per_test(report)
    assert seconds == {"tests/test_resume.py::test_x": 61.51, "tests/test_plan.py::test_y[a b]": 59.0}
    table = durations.tables(seconds, wall=70)
    assert "1 over 60 s" in table and "| `test_resume.py::test_x` **over budget** | 61.5 |" in table
    assert "| `test_plan.py::test_y[a b]` | 59.0 |" in table  # under the budget: not flagged
    # each chapter's share of the wall time: its share of the test time, of the 70 s the suite took
    assert "| Jobs that fail and come back | 62 | 51% | 36 |" in table and "| Plan before you rent | 59 | 49% | 34 |" in table


def test_each_process_counts_once_under_the_program_it_ran():
    """A forked DataLoader worker is its own row, not its parent script's: no second counted twice."""
    records = [{"argv": [str(ROOT / "src/ch4/ddp.py"), "--model", "m"], "cpu": 3.0, "forked": False, "test": "tests/test_a.py::t (call)"},
               {"argv": [str(ROOT / "src/ch4/ddp.py")], "cpu": 1.0, "forked": True, "test": "tests/test_a.py::t (call)"},
               {"argv": ["/venv/lib/python3.11/site-packages/torch/distributed/run.py"], "cpu": 1.0, "forked": False,
                "test": "tests/test_b.py::u (setup)"},
               {"argv": [str(ROOT / "src/ch4/mnist_4_accelerate.py")], "cpu": 2.0, "forked": False, "test": "tests/test_b.py::v"},
               {"argv": ["/venv/lib/python3.11/site-packages/accelerate/commands/launch.py"], "cpu": 3.0, "forked": False,
                "test": "tests/test_b.py::v"},
               {"argv": ["/tmp/pytest-of-me/pytest-7/popen-gw1/test_w0/record.py"], "cpu": 0.0, "forked": False, "test": ""}]
    table = durations.process_table(records)
    assert "The suite's 6 Python processes used 10 CPU seconds" in table
    assert "| `src/ch4/ddp.py` | 1 | 3 | 30% | test_a.py |" in table
    assert "| `forked: warm launches, DataLoader workers, spawn.py's` | 1 | 1 | 10% | test_a.py |" in table
    assert "| `torchrun (the launcher itself)` | 1 | 1 | 10% | test_b.py |" in table
    assert "| `src/ch4/mnist_4_accelerate.py` | 1 | 2 | 20% | test_b.py |" in table  # a script, not the launcher
    assert "| `accelerate launch (the launcher itself)` | 1 | 3 | 30% | test_b.py |" in table
    assert "| `record.py, in a test's temporary folder` | 1 | 0 | 0% |  |" in table  # no run's own folder on the page


def test_a_process_and_its_forked_child_each_note_their_cpu(tmp_path):
    """tools/process_costs/ on PYTHONPATH: the process notes itself at exit, a child forked by multiprocessing,
    which ends through os._exit (no atexit), notes itself too, and so does a plain fork that ends as python ends
    (a warm launch's process: tests/warm_python.py). Control: without PROCESS_COSTS nothing is noted."""
    script = ("import multiprocessing as mp, os, sys\n"
              "if __name__ == '__main__':\n"
              "    child = mp.get_context('fork').Process(target=sum, args=([1, 2],))\n"
              "    child.start(); child.join()\n"
              "    if os.fork() == 0:\n"
              "        sys.exit(0)\n"
              "    os.wait()\n")
    noted, unnoted = tmp_path / "noted", tmp_path / "unnoted"
    noted.mkdir()
    unnoted.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PROCESS_COSTS"}
    env["PYTHONPATH"] = str(ROOT / "tools" / "process_costs")
    for costs in ({"PROCESS_COSTS": str(noted)}, {}):  # the control names no folder, so unnoted stays empty
        subprocess.run([sys.executable, "-c", script], env={**env, **costs}, check=True, timeout=60)
    records = [json.loads(path.read_text()) for path in noted.glob("*.json")]
    assert sorted(record["forked"] for record in records) == [False, True, True]
    assert not list(unnoted.iterdir())
