"""tools/durations.py, which turns a run's --durations=0 report into the time tables of docs/tests.md: a test's
phases add up (an id may hold spaces), and a test over the budget is flagged while one under it is not."""
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
    assert "| Jobs that fail and come back | 62 | 51% |" in table and "| Plan before you rent | 59 | 49% |" in table
