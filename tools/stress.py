"""Run the multi-process benchmarks and tests at toy size many times in a row and count the failures.

A developer tool, not part of CI: a process-group bug that shows up once in ten runs (a worker that
aborts at exit, a rendezvous that races) passes a single CI run by luck. This makes it visible:

    python tools/stress.py --runs 50 --only "overlap figure" "step-time figure"   # the figures that aborted
    python tools/stress.py --runs 10                      # every check below, 10 times each

Each run is a fresh process with a time limit; the table shows failures per check, and the end of
the first failure's output is printed so that the cause can be read.
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
OUT = Path(tempfile.mkdtemp(prefix="stress-"))  # figures drawn here, not over images/
CHECKS = {  # name: the command, run from the repository root; every module that spawns a process group
    "overlap figure": [PY, "figures/overlap_timeline.py", "--toy", "--out", str(OUT / "overlap.png")],
    "step-time figure": [PY, "figures/step_time_breakdown.py", "--toy", "--out", str(OUT / "step_time.png")],
    **{f"{name} figure": [PY, f"figures/{name}.py", "--out", str(OUT / f"{name}.svg")]
       for name in ("accumulation_syncs", "allreduce_algorithms", "bucket_assignment", "ring_allreduce")},
    "bucketing": [PY, "benchmarks/bucketing_speed.py", "--layers", "2", "--width", "64", "--batch", "4", "--steps", "3"],
    "allreduce": [PY, "benchmarks/allreduce_speed.py", "--world-sizes", "2", "3", "--max-mb", "0.01"],
    "grad_sync": [PY, "benchmarks/grad_sync.py", "--nproc", "2", "--accumulation-steps", "2", "--micro-batch", "2",
                  "--optimizer-steps", "1"],
    "uneven": [PY, "benchmarks/uneven_inputs.py", "--batches", "1", "--timeout", "5"],
    "spawn tests": [PY, "-m", "pytest", "-n0", "-q", "-p", "no:cacheprovider", "tests/test_equivalence.py",
                    "tests/test_gather.py", "tests/test_bucketing.py", "tests/test_accumulation.py",
                    "tests/test_allreduce.py", "tests/test_zero.py", "tests/test_figures.py"],
    "resume tests": [PY, "-m", "pytest", "-n0", "-q", "-p", "no:cacheprovider", "tests/test_resume.py", "-k", "fsdp"],
    "torchft sharded heal": [PY, "-m", "pytest", "-n0", "-q", "-p", "no:cacheprovider", "tests/test_fault_tolerant.py",
                             "-k", "sharded_groups_heal"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs of each check (default: 10)")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default: 600)")
    args = parser.parse_args()
    rows = []
    for name in args.only:
        failures, first_failure, start = 0, None, time.perf_counter()
        for run in range(1, args.runs + 1):
            try:
                result = subprocess.run(CHECKS[name], cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
                failed, output = result.returncode != 0, result.stdout + result.stderr
            except subprocess.TimeoutExpired as expired:
                failed, output = True, f"timed out after {args.timeout:g} s\n{expired.stdout}{expired.stderr}"
            failures += failed
            if failed and first_failure is None:
                first_failure = output[-3000:]
            print(f"{name}: run {run}/{args.runs} {'FAILED' if failed else 'ok'}", flush=True)
        rows.append((name, failures, time.perf_counter() - start))
        if first_failure:
            print(f"--- first failure of {name}:\n{first_failure}\n---", flush=True)
    print("\n| check | runs | failures | seconds per run |\n|---|---:|---:|---:|")
    for name, failures, seconds in rows:
        print(f"| {name} | {args.runs} | {failures} | {seconds / args.runs:.1f} |")
    sys.exit(1 if any(failures for _, failures, _ in rows) else 0)


if __name__ == "__main__":
    main()
