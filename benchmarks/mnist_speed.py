"""Time one MNIST epoch several ways and print a table: the original loop (benchmarks/reference_mnist.py), step 1,
step 1 with --compile (inductor) from a cold and then a warm compile cache, and DDP (a process per GPU,
or 2 on a CPU).

`make demo` runs step 1 and DDP; `make benchmark` runs all of them and saves the plot.

Each run is a fresh process (torchrun for DDP), started exactly as a user would start it. Two times
per run: the training time the script reports (its epochs only), and the wall time of the whole
process as a user waits for it: start-up, loading, compiling, training and evaluation. A compiled run
spends its compile time inside both (dynamo compiles at the first step). The cold run starts from an
empty inductor cache (TORCHINDUCTOR_CACHE_DIR, a fresh folder), the warm run reuses what the cold run
left there, as a second run on the same machine does.

    python benchmarks/mnist_speed.py --data-dir data --plot images/mnist_speed_cpu.png
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plotting import bar_chart, where_measured

from common.cli import mnist_parser
from common.distributed import processes_for_this_machine, processes_note
from common.mnist import RAW_FILES, load_mnist

ROOT = Path(__file__).resolve().parent.parent


RUNS = ["reference", "single", "compiled-cold", "compiled-warm", "ddp"]


def runs(data_dir: str, nproc: int) -> dict[str, tuple[str, list[str]]]:
    """Each run's short name -> (its row label, the command a user would type)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    single = [sys.executable, "src/ch4/mnist_1_single.py", "--data-dir", data_dir]
    return {
        "reference": ("original loop (per-sample transforms, fp32)",
                      [sys.executable, "benchmarks/reference_mnist.py", "--data-dir", data_dir]),
        "single": ("mnist_1_single.py", single),
        "compiled-cold": ("mnist_1_single.py --compile, cold cache", [*single, "--compile"]),
        "compiled-warm": ("mnist_1_single.py --compile, warm cache", [*single, "--compile"]),
        "ddp": (f"mnist_3_ddp.py, {nproc} processes", [*torchrun, "src/ch4/mnist_3_ddp.py", "--data-dir", data_dir]),
    }


def measure(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run one configuration, time the whole process, and read its 'train time' and 'test accuracy' lines."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    wall = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    seconds, rate = re.search(r"train time ([\d.]+) s, (\d+) samples/s", result.stdout).groups()
    accuracy = re.search(r"test accuracy ([\d.]+)% over (\d+) images", result.stdout).group(1)
    return {"seconds": float(seconds), "samples_per_s": float(rate), "accuracy": float(accuracy), "wall": wall}


def table(results: dict[str, dict[str, float]]) -> str:
    """A Markdown table; the last two columns compare each run's training time and wall time with the first run's."""
    first = next(iter(results.values()))
    lines = ["| run | train s | samples/s | test accuracy | wall s | train speed vs first row | wall speed vs first row |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['samples_per_s']:.0f} | {r['accuracy']:.2f}% | {r['wall']:.1f} "
                     f"| {first['seconds'] / r['seconds']:.2f}x | {first['wall'] / r['wall']:.2f}x |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder holding MNIST/raw (e.g. data, where the chapter scripts download it)")
    parser.add_argument("--nproc", type=int,
                        help="processes for the DDP run (default: one per GPU, or 2 on a CPU, as many as divide the "
                             "global batch)")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=RUNS,
                        help="which runs, in this order (default: all); compiled-warm reuses the cache compiled-cold "
                             "filled, or is cold itself without it")
    parser.add_argument("--plot", help="also save a bar chart to this PNG")
    parser.add_argument("--title", default="One MNIST epoch",
                        help="plot title; the machine's name (GPUs where there are) is added after it")
    args = parser.parse_args()
    raw = Path(args.data_dir, "MNIST", "raw")
    if not all((raw / name).exists() for names in RAW_FILES.values() for name in names):
        print(f"MNIST is not in {raw.resolve()}: downloading it first, so that no run times the download", flush=True)
        load_mnist(args.data_dir)  # where it cannot be downloaded: one sentence that names --data-dir, and exit
    if args.nproc is None and "ddp" in args.runs:
        global_batch = mnist_parser("").get_default("batch_size")
        args.nproc = processes_for_this_machine(global_batch)
        print(f"DDP run: {processes_note(args.nproc, global_batch)}", flush=True)
    available = runs(args.data_dir, args.nproc)
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # empty for the first compiled run
        for run in args.runs:
            label, command = available[run]
            print(f"running: {' '.join(command)}", flush=True)
            results[label] = measure(command, env)
            print(f"  {results[label]}", flush=True)
    print(table(results))
    if args.plot:
        bar_chart({name: r["seconds"] for name, r in results.items()},
                  [f"{r['seconds']:.0f} s ({r['wall']:.0f} s wall), {r['accuracy']:.2f}%" for r in results.values()],
                  "seconds for one training epoch (lower is better)", f"{args.title}, {where_measured(gpus=True)}",
                  args.plot)


if __name__ == "__main__":
    main()
