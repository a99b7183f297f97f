"""The layout says what each module is: common/ is what the scripts run on, common/lessons/ the lessons written
out, planner/ the planning tools. What the scripts run on never imports a lesson or the planner, so that
editing a lesson stales only the recordings of the runs that use it."""
import ast
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import record_outputs  # noqa: E402  (tools/ is not a package)

RUNTIME = sorted(path for path in (ROOT / "common").glob("*.py"))
FORBIDDEN = ("common.lessons", "planner")


def imported_modules(source: str) -> set[str]:
    """Every module a source imports, at the top or inside a function: `from common.lessons import zero` is
    common.lessons.zero."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def forbidden_imports(source: str) -> list[str]:
    return sorted(module for module in imported_modules(source)
                  if any(module == name or module.startswith(name + ".") for name in FORBIDDEN))


@pytest.mark.parametrize("path", RUNTIME, ids=lambda path: path.name)
def test_what_the_scripts_run_on_imports_no_lesson_and_no_planner(path):
    assert not forbidden_imports(path.read_text()), f"{path.relative_to(ROOT)} imports {forbidden_imports(path.read_text())}"


@pytest.mark.parametrize("planted", ["from common.lessons.comm_hooks import register_comm_hook",
                                     "from common.lessons import allreduce",
                                     "def f():\n    import planner.plan\n"])
def test_the_import_check_catches_a_planted_import(planted):
    """The negative control: a runtime module with one planted import of a lesson or of the planner fails."""
    source = (ROOT / "common" / "cli.py").read_text() + "\n" + planted + "\n"
    assert forbidden_imports(source)


def recordings_behind(path):
    """The recordings whose sources include this repository file: the ones an edit of it makes stale."""
    behind = set()
    for page in record_outputs.pages():
        for name, _, _, _ in record_outputs.regions(page):
            recording = record_outputs.load(page, name)
            if recording and path in recording["sources"]:
                behind.add(f"{page.stem}/{name}")
    return behind


def sources_now(page, name):
    """What the recording's commands import today (not what they imported when it was recorded)."""
    spec = next(spec for found, spec, _, _ in record_outputs.regions(page) if found == name)
    return {path.relative_to(ROOT).as_posix() for path in record_outputs.source_files(spec["commands"])}


def test_editing_the_ring_lesson_stales_only_the_runs_that_use_it():
    """common/lessons/allreduce.py lies behind the runs that execute it: the ring's benchmark, the compression
    rung (which counts bytes with its formula), and the planner with the benchmarks that print the planner's
    numbers (its time model is the ring's formula); behind nothing of the MNIST ladder, resume, sharding or BERT."""
    ring = "common/lessons/allreduce.py"
    using = {f"{page.stem}/{name}" for page in record_outputs.pages() for name, _, _, _ in record_outputs.regions(page)
             if ring in sources_now(page, name)}
    planner_printed = {"deepspeed/memory", "sharded/sharded-memory"}
    assert using and all(name.split("/")[0] in {"inside_ddp", "compression", "plan", "simulate"} or name in planner_printed
                         for name in using), using
    for untouched in ["mnist/ladder", "resume/stop-and-resume", "sharded/fsdp-vs-ddp", "bert/minilm", "deepspeed/mnist-stages"]:
        page, name = untouched.split("/")
        assert ring not in sources_now(ROOT / "docs" / f"{page}.md", name), untouched
    # the control: the same check sees what the ladder does import, so an import of the ring would show
    assert "common/cli.py" in sources_now(ROOT / "docs" / "mnist.md", "ladder")
