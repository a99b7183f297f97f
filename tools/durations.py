"""Where the suite's time goes: seconds per chapter, per test file and per test, from one run of the suite,
and the CPU seconds of the programs it launches.

    make test-durations     # python tools/durations.py --run: the whole suite, then the tables in docs/tests.md
    python tools/durations.py build/durations.txt --wall 1015 --check   # the tables from a saved report

pytest --durations=0 prints a line per phase of each test ("12.34s call     tests/test_x.py::test_y[3]").
This sums the phases of each test (a module fixture's setup, a rung's run shared by several tests, counts
where it runs), the tests of each file, and the files of each chapter (CHAPTERS), and writes between the
markers of docs/tests.md: the machine, the suite's wall time, and a row per chapter, per file and for the
30 slowest tests. The seconds are the workers' (two at once on 2 cores), so they add up to about twice the
wall time. A test over BUDGET seconds is flagged in its row, and --check exits 1 while one is.

Under --run every Python process of the suite notes its own CPU seconds as it ends (tools/process_costs/,
put on PYTHONPATH; build/process_costs/ holds the notes), and a last table sums them per launched program:
on 2 cores the suite keeps both busy most of the time, so these seconds are most of its time (waits, such as
torchft's heartbeats and SLURM's scheduling, are the rest).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from time import monotonic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_outputs import machine_description  # noqa: E402  (a sibling tool, not a package)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tests.md"
BEGIN, END = "<!-- durations -->", "<!-- end durations -->"
LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(tests/test_\w+\.py::.+?)\s*$")  # ids may hold spaces
REPORT = ROOT / "build" / "durations.txt"
COSTS = ROOT / "build" / "process_costs"
BUDGET = 60  # seconds one test (its phases together) may take
CHAPTERS = {  # the page each test file proves, in the site's order; a file in none counts as the repository's
    "The MNIST ladder": ["test_mnist_scripts", "test_lessons", "test_equivalence", "test_gather", "test_samplers",
                         "test_launch", "test_devices", "test_spawn"],
    "Lightning": [],
    "The BERT chapter": ["test_nli_scripts"],
    "Inside DDP": ["test_allreduce", "test_bucketing", "test_accumulation"],
    "When the model does not fit": ["test_zero", "test_fsdp"],
    "Jobs that fail and come back": ["test_resume", "test_resume_parts", "test_reshard", "test_augment", "test_uneven"],
    "Data that resumes exactly": ["test_data_pipeline"],
    "DeepSpeed and the Trainer": ["test_deepspeed", "test_deepspeed_rungs", "test_nli_trainer"],
    "Reductions done right": ["test_reductions", "test_reductions_demo"],
    "HSDP": ["test_hsdp"],
    "Faults without restarts": ["test_fault_tolerant"],
    "Fewer bytes, fewer syncs": ["test_comm_hooks"],
    "torch.compile on the ladder": ["test_compile"],
    "Plan before you rent": ["test_plan"],
    "Check before you rent": ["test_simulate"],
    "SLURM": ["test_slurm"],
    "Debugging": ["test_debugging"],
    "GPU paths (test_gpu.py skips on a CPU; test_gpu_paths.py runs there)": ["test_gpu", "test_gpu_paths"],
    "The repository: pages, figures, notebooks, benchmarks, lint": ["test_site", "test_chapters", "test_layout",
                                                                    "test_lint", "test_figures", "test_notebooks",
                                                                    "test_benchmarks", "test_screen", "test_mutations",
                                                                    "test_durations"],
}


def per_test(report: str) -> dict[str, float]:
    """Seconds of each test, its setup, call and teardown together."""
    seconds = defaultdict(float)
    for line in report.splitlines():
        if match := LINE.match(line):
            seconds[match.group(3)] += float(match.group(1))
    if not seconds:
        sys.exit("error: no durations in the report: run pytest with --durations=0 (make test-durations does).")
    return seconds


def short(name: str, width: int = 90) -> str:
    """A test's id cut to fit a table's column (parameters can be whole sentences); `|` would end the cell, and a
    path in a parameter is its file's name (cut, a path would name a file that is not there)."""
    name = name.replace("|", "/")
    if "[" in name:
        name = re.sub(r"[\w.-]+/(?=[\w.-])", "", name)
    return name if len(name) <= width else name[:width - 1] + "…"


def tables(seconds: dict[str, float], wall: float | None) -> str:
    files, tests_in, slowest = defaultdict(float), defaultdict(int), {}
    for test, time in seconds.items():
        name = test.split("::")[0].removeprefix("tests/").removesuffix(".py")
        files[name] += time
        tests_in[name] += 1
        if time > seconds.get(slowest.get(name, ""), -1):
            slowest[name] = test
    chapter_of = {name: chapter for chapter, names in CHAPTERS.items() for name in names}
    chapters = defaultdict(float)
    for name, time in files.items():
        chapters[chapter_of.get(name, "The repository: pages, figures, notebooks, benchmarks, lint")] += time
    total = sum(files.values())
    over = sorted(test for test, time in seconds.items() if time > BUDGET)
    lines = [f"Measured on {machine_description()}: {len(seconds)} tests, {total:.0f} s of test time"
             + (f" in {wall:.0f} s of wall time" if wall else "") + f"; {len(over)} over {BUDGET} s.", "",
             "| chapter | s | share |" + (" of the wall, s |" if wall else ""), "|---|---:|---:|" + ("---:|" if wall else "")]
    lines += [f"| {chapter} | {chapters[chapter]:.0f} | {chapters[chapter] / total:.0%} |"
              + (f" {chapters[chapter] / total * wall:.0f} |" if wall else "")
              for chapter in CHAPTERS if chapter in chapters]
    lines += ["", "| test file | s | tests | slowest test, s |", "|---|---:|---:|---|"]
    for name, time in sorted(files.items(), key=lambda item: -item[1]):
        test = slowest[name]
        lines.append(f"| `{name}.py` | {time:.0f} | {tests_in[name]} | `{short(test.split('::', 1)[1])}` {seconds[test]:.0f} |")
    lines += ["", f"The 30 slowest tests (over {BUDGET} s: **over budget**):", "", "| test | s |", "|---|---:|"]
    for test, time in sorted(seconds.items(), key=lambda item: -item[1])[:30]:
        flag = " **over budget**" if time > BUDGET else ""
        lines.append(f"| `{short(test.removeprefix('tests/'))}`{flag} | {time:.1f} |")
    return "\n".join(lines)


def program(record: dict) -> str:
    """What a process ran, as the table names it: a script of the repository, or the launcher or worker."""
    first = record["argv"][0] if record["argv"] else "-c"
    if record["forked"]:
        return "forked: warm launches, DataLoader workers, spawn.py's"
    if first.endswith("torch/distributed/run.py"):
        return "torchrun (the launcher itself)"
    if first.endswith("tests/warm_torchrun.py"):
        return "tests/warm_torchrun.py (the suite's torchrun)"
    if first.endswith("tests/warm_accelerate.py"):
        return "tests/warm_accelerate.py (the suite's accelerate launch)"
    if first.endswith("tests/warm_python.py"):
        return "tests/warm_python.py (the server of python SCRIPT)"
    if first.endswith("accelerate/commands/launch.py") or first.endswith("bin/accelerate"):
        return "accelerate launch (the launcher itself)"
    if first == "-c":
        return "python -c: pytest-xdist workers, the fork server, one-line checks"
    path = Path(first)
    if path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if "site-packages/" in first:
        return first.split("site-packages/")[-1]
    return f"{path.name}, in a test's temporary folder" if "/pytest-of-" in first else first


def process_table(records: list[dict], rows: int = 25) -> str:
    cpu, count, files = defaultdict(float), defaultdict(int), defaultdict(set)
    for record in records:
        name = program(record)
        cpu[name] += record["cpu"]
        count[name] += 1
        if record["test"]:
            files[name].add(record["test"].split("::")[0].removeprefix("tests/"))
    total = sum(cpu.values())
    lines = [f"The suite's {len(records)} Python processes used {total:.0f} CPU seconds; the {rows} programs that used "
             "the most:", "", "| program | processes | CPU s | share | launched by |", "|---|---:|---:|---:|---|"]
    for name, seconds in sorted(cpu.items(), key=lambda item: -item[1])[:rows]:
        by = ", ".join(sorted(files[name])[:3]) + (f" and {len(files[name]) - 3} more" if len(files[name]) > 3 else "")
        lines.append(f"| `{short(name, 70)}` | {count[name]} | {seconds:.0f} | {seconds / total:.0%} | {by} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, nargs="?", default=REPORT,
                        help=f"what pytest --durations=0 printed (default: {REPORT.relative_to(ROOT)})")
    parser.add_argument("--run", action="store_true", help="run the suite first, its output kept as the report")
    parser.add_argument("--wall", type=float, help="the suite's wall time in seconds, for the first line")
    parser.add_argument("--check", action="store_true", help=f"exit 1 while a test takes over {BUDGET} s")
    args = parser.parse_args()
    if args.run:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(COSTS, ignore_errors=True)
        COSTS.mkdir(parents=True)
        noting = {**os.environ, "PROCESS_COSTS": str(COSTS),
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tools" / "process_costs"),
                                                              os.environ.get("PYTHONPATH")]))}
        start = monotonic()
        with open(args.report, "w") as report:  # the run's output as make test prints it, and kept
            suite = subprocess.Popen([sys.executable, "-m", "pytest", "--durations=0", "--durations-min=0"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=noting)
            for line in suite.stdout:
                print(line, end="", flush=True)
                report.write(line)
        args.wall = monotonic() - start
        if suite.wait() != 0:
            sys.exit(f"error: the suite failed (exit {suite.returncode}); no durations written.")
    if not args.report.is_file():
        sys.exit(f"error: {args.report} does not exist: python tools/durations.py --run writes it.")
    seconds = per_test(args.report.read_text())
    page = PAGE.read_text()
    if BEGIN not in page or END not in page:
        sys.exit(f"error: {PAGE} has no {BEGIN} ... {END} markers to write between.")
    before, rest = page.split(BEGIN, 1)
    text = tables(seconds, args.wall)
    if COSTS.is_dir():
        text += "\n\n" + process_table([json.loads(path.read_text()) for path in COSTS.glob("*.json")])
    PAGE.write_text(f"{before}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(f"wrote the durations of {len(seconds)} tests into {PAGE.relative_to(ROOT)}")
    over = [test for test, time in seconds.items() if time > BUDGET]
    for test in over:
        print(f"over {BUDGET} s: {test} ({seconds[test]:.0f} s)")
    if args.check and over:
        sys.exit(1)


if __name__ == "__main__":
    main()
