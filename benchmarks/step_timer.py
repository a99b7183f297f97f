"""Run a chapter script unchanged and report, as it exits, when each optimizer step ended and its peak memory.

For the benchmarks, under python or torchrun, in place of the script's path:
    torchrun --nproc_per_node=2 benchmarks/step_timer.py OUT_DIR src/ch4/ddp.py --model ... --max-steps 30
Every process writes OUT_DIR/rank{RANK}.json: its rank, the end time of each optimizer step (the GPU
synchronized first, so queued kernels count), and its peak memory, with what that is:
torch.cuda.max_memory_allocated on a GPU (the current one: GPU 0 under DataParallel), the peak
resident set of the process on a CPU. A file per process, not a line on the shared stdout: processes
that print at the same moment can interleave their lines. The benchmark can then leave out warm-up
steps, which include CUDA's start-up and the allocator's first requests, without any change to the
chapter script.
"""
import atexit
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

step_ends: list[float] = []


def step_done(optimizer, args, kwargs) -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    step_ends.append(time.perf_counter())


def report() -> None:
    if torch.cuda.is_initialized():
        peak_mb, measured = torch.cuda.max_memory_allocated() / 1e6, "GPU max_memory_allocated"
    else:
        peak_mb, measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, "host peak RSS"  # ru_maxrss: KiB
    rank = int(os.environ.get("RANK", 0))
    summary = {"rank": rank, "step_ends": step_ends, "peak_mb": peak_mb, "measured": measured}
    (Path(OUT_DIR) / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    OUT_DIR = sys.argv[1]
    register_optimizer_step_post_hook(step_done)
    atexit.register(report)
    sys.argv = sys.argv[2:]  # the chapter script sees its own path and flags
    runpy.run_path(sys.argv[0], run_name="__main__")
