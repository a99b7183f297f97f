"""Test accuracy against bytes sent: one MNIST epoch per way of sending fewer bytes, at 2 processes.

Each run is a fresh torchrun of src/ch4/scale_out/mnist_comm_hooks.py or mnist_diloco.py, started as a
user would start it; each reports its test accuracy over the 10,000 test images and the bytes each
rank handed to all_reduce per training step (the payload, counted as the tensors pass; a ring puts
2(N-1)/N of it on the wire). Accuracy is not a timing: a busy machine changes none of these numbers.

    python benchmarks/comm_hooks.py --data-dir data --plot images/comm_hooks_cpu.png
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

from plotting import finish

from common.machine import machine_name

ROOT = Path(__file__).resolve().parent.parent
HOOKS = "src/ch4/scale_out/mnist_comm_hooks.py"
DILOCO = "src/ch4/scale_out/mnist_diloco.py"


def runs(sync_every: int) -> dict[str, tuple[str, list[str]]]:
    """Each run's short name -> (its row label, the script and its flags)."""
    return {
        "ddp": ("DDP, fp32 gradients", [HOOKS, "--comm-hook", "none"]),
        "fp16": ("fp16 hook", [HOOKS, "--comm-hook", "fp16"]),
        "bf16": ("bf16 hook", [HOOKS, "--comm-hook", "bf16"]),
        "powersgd1": ("PowerSGD, rank 1", [HOOKS, "--comm-hook", "powersgd", "--powersgd-rank", "1"]),
        "powersgd4": ("PowerSGD, rank 4", [HOOKS, "--comm-hook", "powersgd", "--powersgd-rank", "4"]),
        "local_sgd": (f"local SGD, H = {sync_every}",
                      [DILOCO, "--sync-every", str(sync_every), "--outer-lr", "1", "--outer-momentum", "0"]),
        "diloco": (f"DiLoCo, H = {sync_every}", [DILOCO, "--sync-every", str(sync_every)]),
    }


def measure(command: list[str]) -> dict[str, float]:
    """Run one configuration and read what it printed."""
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return parse(result.stdout)


def parse(stdout: str) -> dict[str, float]:
    """The bytes-per-step and test-accuracy lines of mnist_comm_hooks.py's or mnist_diloco.py's output."""
    sent = re.search(r"sent per rank per step \(all-reduce payload, mean of \d+ steps\): ([\d,]+) B", stdout)
    accuracy = re.search(r"test accuracy ([\d.]+)% over (\d+) images", stdout)
    return {"bytes": int(sent.group(1).replace(",", "")), "accuracy": float(accuracy.group(1))}


def table(results: dict[str, dict[str, float]]) -> str:
    """A Markdown table; bytes compared with the first row's (plain DDP)."""
    first = next(iter(results.values()))
    lines = ["| method | sent per rank per step | vs DDP | test accuracy |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['bytes'] / 1e3:,.1f} kB | {first['bytes'] / r['bytes']:.1f}x less "
                     f"| {r['accuracy']:.2f}% |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, float]], title: str, path: str) -> None:
    """Accuracy against bytes per step, log scale: up and to the left is better."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labelled = set()
    for name, r in sorted(results.items(), key=lambda item: -item[1]["accuracy"]):
        ax.scatter(r["bytes"] / 1e3, r["accuracy"], color="#1f77b4")
        below = r["bytes"] in labelled  # the lower of two runs that send the same bytes: its label below
        ax.annotate(name, (r["bytes"] / 1e3, r["accuracy"]), textcoords="offset points", xytext=(6, -12 if below else 4),
                    fontsize=8)
        labelled.add(r["bytes"])
    ax.margins(x=0.15, y=0.12)
    ax.set_xscale("log")
    ax.set_xlabel("kB each rank hands to all-reduce per step (log scale; fewer is better)")
    ax.set_ylabel("test accuracy after 1 epoch, %")
    ax.grid(True, which="both", alpha=0.3)
    finish(fig, path, title)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder holding MNIST/raw (e.g. data, where the chapter scripts download it)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (default: 2)")
    parser.add_argument("--sync-every", type=int, default=8, help="H for local SGD and DiLoCo (default: 8)")
    parser.add_argument("--runs", nargs="+", choices=list(runs(8)), default=list(runs(8)),
                        help="which runs, in this order (default: all)")
    parser.add_argument("--plot", help="also save the plot to this PNG")
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    available = runs(args.sync_every)
    results = {}
    for run in args.runs:
        label, script = available[run]
        command = [*torchrun, *script, "--data-dir", args.data_dir]
        print(f"running: {' '.join(command)}", flush=True)
        results[label] = measure(command)
        print(f"  {results[label]}", flush=True)
    title = f"One MNIST epoch, {args.nproc} processes, on a {machine_name()}"
    print(title)
    print(table(results))
    if args.plot:
        plot(results, title, args.plot)


if __name__ == "__main__":
    main()
