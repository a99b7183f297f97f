"""What a dead worker costs: restart from a checkpoint (the resume chapter) against healing from a live peer (torchft).

The same job both ways, on real MNIST: 3 processes, global batch 96 (32 each), one epoch (625 steps), fp32; and
the same fault: process 1 is SIGKILLed right after its --kill-after-th step, and its torchrun starts it again.
  (a) restart: src/ch4/resume/mnist_3_ddp_resume.py, one torchrun of 3 processes with --max-restarts=1 and
      --checkpoint-every N: torchrun stops the other two, starts all three again, and they resume from the
      newest checkpoint; the steps since then are taken again.
  (b) heal: src/ch4/fault_tolerant/mnist_3_ddp_ft.py, 3 replica groups of one process each, each its own torchrun
      with --max-restarts=1, and a lighthouse: the other two go on; the one started again heals from a live peer.
Each also runs without the fault, as its baseline. Every process's steps are traced
(an optimizer step hook in this file, the scripts unchanged), and the table gives, per run: wall seconds, the
longest pause between two steps (for the restart, the time its processes took to come back and reload; the wall
times of the heal runs vary by more than that between identical runs on a loaded 2-core CPU), steps taken again,
steps taken by fewer than 3 processes, and the test accuracy over 10,000 images (the lowest group's, for a heal run); and
whether the heal runs' groups end with the same weights, bit for bit.

    python benchmarks/fault_cost.py --data-dir data --plot images/fault_cost_cpu.png   # 4 runs, minutes on a CPU
"""
import argparse
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS, BATCH = 3, 96
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]


def worker(trace: Path, kill_rank: int, kill_after: int, script: str, argv: list[str]) -> None:
    """In a worker: run the chapter script unchanged, append (time, steps this process has taken) to its trace after
    every optimizer step, and, on torchrun's first attempt, SIGKILL process kill_rank after its kill_after-th step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    rank = int(os.environ.get("REPLICA_GROUP_ID") or os.environ["RANK"])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    path, count = trace / f"process{rank}.jsonl", 0

    def hook(optimizer, args, kwargs) -> None:
        nonlocal count
        count += 1
        with path.open("a") as file:
            file.write(json.dumps({"time": time.time(), "steps": count, "first_attempt": first_attempt}) + "\n")
        if first_attempt and rank == kill_rank and count == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    register_optimizer_step_post_hook(hook)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def launch(script: str, trace: Path, kill_after: int, nproc: int, flags: list, env: dict) -> subprocess.Popen:
    """torchrun --max-restarts=1 of this file as the worker, which runs the script."""
    command = [*TORCHRUN, str(nproc), "--standalone", "--max-restarts=1", __file__, "worker", trace, 1, kill_after,
               script, *flags]
    return subprocess.Popen([str(part) for part in command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def restart_run(args, folder: Path, kill_after: int) -> dict:
    trace = folder / "trace"
    trace.mkdir(parents=True)
    flags = ["--data-dir", args.data_dir, "--batch-size", BATCH, "--precision", "fp32", "--checkpoint-dir",
             folder / "checkpoints", "--checkpoint-every", args.checkpoint_every]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    start = time.time()
    process = launch("src/ch4/resume/mnist_3_ddp_resume.py", trace, kill_after, GROUPS, flags, env)
    output = process.communicate()[0]
    if process.returncode:
        sys.exit(f"error: the restart run failed:\n{output[-3000:]}")
    resumed = re.search(r"resumed from .* step (\d+)", output)
    return {"seconds": time.time() - start, "start": start, "output": output, "trace": trace,
            "resumed_at": int(resumed.group(1)) if resumed else None,
            "accuracy": float(re.search(r"test accuracy ([\d.]+)%", output).group(1))}


def heal_run(args, folder: Path, kill_after: int) -> dict:
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse in this process logs every quorum at INFO
    from torchft.coordination import LighthouseServer
    trace = folder / "trace"
    trace.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=5000)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "NUM_REPLICA_GROUPS": str(GROUPS),
           "RUST_LOG": "warn", "no_proxy": "*"}
    start = time.time()
    processes = [launch("src/ch4/fault_tolerant/mnist_3_ddp_ft.py", trace, kill_after, 1,
                        ["--data-dir", args.data_dir, "--batch-size", BATCH, "--precision", "fp32",
                         "--step-log", folder / f"steps{group}.jsonl", "--summary", folder / f"summary{group}.json",
                         "--save", folder / f"weights{group}.pt"], {**env, "REPLICA_GROUP_ID": str(group)})
                 for group in range(GROUPS)]
    outputs = [process.communicate()[0] for process in processes]
    lighthouse.shutdown()
    if any(process.returncode for process in processes):
        sys.exit("error: a heal run's group failed:\n" + "\n".join(output[-2000:] for output in outputs))
    summaries = [json.loads((folder / f"summary{group}.json").read_text()) for group in range(GROUPS)]
    steps = [[json.loads(line) for line in (folder / f"steps{group}.jsonl").read_text().splitlines()]
             for group in range(GROUPS)]
    import torch
    weights = [torch.load(folder / f"weights{group}.pt") for group in range(GROUPS)]
    equal = all(torch.equal(weights[0][name], other[name]) for other in weights[1:] for name in weights[0])
    return {"seconds": time.time() - start, "start": start, "output": "\n".join(outputs), "trace": trace,
            "summaries": summaries, "steps": steps, "accuracy": 100 * min(s["accuracy"] for s in summaries),
            "equal": equal}


def main():
    if sys.argv[1:2] == ["worker"]:
        trace, kill_rank, kill_after, script, *argv = sys.argv[2:]
        return worker(Path(trace), int(kill_rank), int(kill_after), script, argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data", help="folder holding MNIST/raw (default: data)")
    parser.add_argument("--kill-after", type=int, default=300, help="process 1 dies after this step (default: 300)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="the restart run's interval (default: 200)")
    parser.add_argument("--plot", help="save the figure (steps and processes against time) here")
    parser.add_argument("--json", type=Path, help="save the runs' numbers here")
    args = parser.parse_args()
    from common.machine import machine_name
    folder = Path(tempfile.mkdtemp(prefix="fault_cost_"))
    runs = {}
    for name, run in (("restart", restart_run), ("heal", heal_run)):
        for fault in (False, True):
            label = f"{name}, {'killed' if fault else 'no fault'}"
            print(f"running: {label}", flush=True)
            runs[label] = run(args, folder / label.replace(", ", "-").replace(" ", "_"),
                              args.kill_after if fault else 0)
    print("\nWhat the groups of the heal run with the kill printed (group 1: both its starts, one after the other):")
    print("\n".join(line for line in runs["heal, killed"]["output"].splitlines()
                    if re.match(r"group \d+: (step|mean|train)", line)))
    for label in ("heal, no fault", "heal, killed"):
        print(f"{label}: the 3 groups' final weights {'are' if runs[label]['equal'] else 'are NOT'} equal, bit for bit")
    rows = table(runs, args)
    print(f"\nMNIST, 3 processes, global batch {BATCH}, one epoch (625 steps), fp32; process 1 killed after step "
          f"{args.kill_after}; checkpoints every {args.checkpoint_every} steps. {machine_name()}.\n")
    print("| run | wall s | longest pause s | steps taken again | steps with fewer processes | test accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps({label: {key: run[key] for key in ("seconds", "accuracy")} for label, run
                                         in runs.items()}, indent=1))
    if args.plot:
        plot(runs, args, args.plot)
    shutil.rmtree(folder, ignore_errors=True)


def table(runs: dict, args) -> list[list[str]]:
    rows = []
    for label, run in runs.items():
        times = timeline(run, label)[0]
        pause = max((later - earlier for earlier, later in zip(times, times[1:])), default=0.0)
        if label.startswith("restart"):  # all 3 take every step, or none: the job is down until they restart
            again, fewer = (0 if run["resumed_at"] is None else args.kill_after - run["resumed_at"]), 0
        else:  # group 0's steps: it is never the one killed
            again = 0
            fewer = sum(line["committed"] and line["participants"] < GROUPS for line in run["steps"][0])
        rows.append([label, f"{run['seconds']:.0f}", f"{pause:.1f}", str(again),
                     str(fewer), f"{run['accuracy']:.2f}%"])
    return rows


def timeline(run: dict, label: str) -> tuple[list, list, list]:
    """(seconds, step, processes training) over the run: from process 0's trace for a restart (its step resumes
    at the checkpoint's), from group 0's step log for a heal."""
    if label.startswith("restart"):
        lines = [json.loads(line) for line in (run["trace"] / "process0.jsonl").read_text().splitlines()]
        offset = {True: 0, False: run["resumed_at"] or 0}
        times, steps, processes = [], [], []
        for i, line in enumerate(lines):
            if i and lines[i - 1]["first_attempt"] and not line["first_attempt"]:  # none train until the restart
                times.append(times[-1]), steps.append(steps[-1]), processes.append(0)
            times.append(line["time"] - run["start"])
            steps.append(line["steps"] + offset[line["first_attempt"]])
            processes.append(3)
        return times, steps, processes
    lines = run["steps"][0]
    return ([line["time"] - run["start"] for line in lines], [line["step"] for line in lines],
            [line["participants"] for line in lines])


def plot(runs: dict, args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plotting import finish, where_measured
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 5.4), sharex=True)
    for label, run in runs.items():
        times, steps, processes = timeline(run, label)
        style = {"color": "C0" if label.startswith("restart") else "C1",
                 "linestyle": "-" if "killed" in label else ":"}
        top.plot(times, steps, label=label, **style)
        if "killed" in label:
            bottom.step(times, processes, where="post", label=label, **style)
    top.axhline(args.kill_after, color="grey", linewidth=0.6)
    top.set_ylabel("step reached")
    top.legend(fontsize=8, loc="upper left")
    bottom.set_ylabel("processes in the step")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylim(-0.2, 3.5)
    bottom.set_yticks(range(GROUPS + 1))
    bottom.legend(fontsize=8, loc="lower right")
    finish(fig, path, f"Process 1 of 3 killed after step {args.kill_after}, {where_measured()}")


if __name__ == "__main__":
    main()
