"""Plant known bugs one at a time and check that the tests covering the touched file catch each one.

A developer tool, not part of CI (it runs part of the suite once per bug, several minutes in all):

    python tools/mutations.py                  # every planted bug
    python tools/mutations.py --only ddp-wrap  # one of them, by name

Each bug is applied to a fresh copy of the tracked files in a temporary folder, with that copy first
on PYTHONPATH so that its `common` package is the one imported; the covering tests run there with
-x. The table says, per bug, whether the tests failed (caught) and how long that took. A bug that
is not caught means a claim the README makes is not tested.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = "tests/test_lessons.py"
PATHS = "tests/test_gpu_paths.py"
MUTATIONS = [  # name, file, text, replacement, tests (pytest arguments)
    ("ddp-wrap", "src/ch4/mnist_3_ddp.py",
     '    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)',
     "    model = torch.nn.DataParallel(model)", [LESSONS, "-k", "torchrun"]),  # runs, but each rank trains alone
    ("set-epoch", "src/ch4/mnist_3_ddp.py", "        train_sampler.set_epoch(epoch)", "        pass",
     [LESSONS, "-k", "torchrun"]),
    ("sum-seen-not-correct (MNIST)", "src/ch4/mnist_3_ddp.py",
     "    correct, seen = sum_across_ranks(correct, seen, device=device)", "    seen = sum_across_ranks(seen, device=device)[0]",
     [LESSONS, "-k", "torchrun"]),
    ("sum-seen-not-correct (BERT)", "src/ch4/ddp.py",
     "    correct, seen = sum_across_ranks(correct, seen, device=device)", "    seen = sum_across_ranks(seen, device=device)[0]",
     [LESSONS, "-k", "bert"]),
    ("no-eval-mode (Accelerate)", "src/ch4/mnist_4_accelerate.py", "    model.eval()\n", "",
     ["tests/test_chapters.py", LESSONS, "-k", "accelerate or neighbours"]),
    ("eval-through-DDP", "src/ch4/ddp.py", "evaluate(model.module, eval_loader", "evaluate(model, eval_loader",
     [PATHS, "-k", "fewer"]),
    ("buckets-in-forward-order", "common/lessons/bucketing.py", "for param in reversed(params):", "for param in params:",
     ["tests/test_bucketing.py"]),
    ("eval-sampler-fixed-shares", "common/samplers.py",
     "            order = torch.randperm(self.dataset_size, generator=generator).tolist()",
     "            order = list(range(self.dataset_size))\n"
     "            order[self.rank::self.num_replicas] = [order[self.rank::self.num_replicas][i] for i in "
     "torch.randperm(len(self), generator=generator).tolist()]",
     ["tests/test_samplers.py"]),
    ("ring-wrong-chunk", "common/lessons/allreduce.py",
     'yield "reduce-scatter", step, (rank - step) % world_size, (rank - step - 1) % world_size',
     'yield "reduce-scatter", step, (rank - step) % world_size, (rank - step + 1) % world_size', ["tests/test_allreduce.py"]),
    ("sum-without-all-reduce", "common/gather.py", "        dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n", "        pass\n",
     ["tests/test_gather.py"]),
    ("shared-gpu-allowed", "common/distributed.py", "    if launch.local_world_size > count:", "    if False:",
     [PATHS, "-k", "gpu"]),
    ("autocast-outside-replicas", "common/precision.py",
     "        with autocast(self.device, self.precision):\n            return self.module(*args, **kwargs)",
     "        return self.module(*args, **kwargs)", [PATHS, "-k", "autocast"]),
    ("bf16-on-volta", "common/precision.py", 'return "bf16" if major >= 8 else "fp16"',
     'return "bf16" if major >= 7 else "fp16"', [PATHS, "-k", "auto"]),
    ("scheduler-steps-on-skipped-fp16", "common/precision.py", "    return scale is None or scaler.get_scale() >= scale",
     "    return True", [PATHS, "-k", "optimizer_step"]),
    ("accelerate-schedule-too-short", "src/ch4/nli_accelerate.py",
     "num_training_steps=total_steps * accelerator.num_processes", "num_training_steps=total_steps",
     [PATHS, "-k", "schedule"]),
    ("zero-no-average", "common/lessons/zero.py", "        shard_grad.div_(dist.get_world_size())\n", "",
     ["tests/test_zero.py"]),  # AdamW is nearly blind to a gradient N times too large: the gradients are compared
    ("zero-3-no-gather-for-backward", "common/lessons/zero.py",
     "        register_multi_grad_hook(tensors, lambda grad: unit.gather(), mode=\"any\")", "        pass", ["tests/test_zero.py"]),
    ("fsdp-eval-scores-repeats", "src/ch4/sharded/mnist_fsdp.py", "keep = min(labels.numel(), unpadded - seen)",
     "keep = labels.numel()", ["tests/test_fsdp.py"]),
    ("fsdp-no-broadcast", "src/ch4/sharded/mnist_fsdp.py", "        dist.broadcast(tensor, src=0)", "        pass",
     ["tests/test_fsdp.py"]),
    ("stop-ignores-sigusr1", "common/stop_signal.py", "SIGNALS = (signal.SIGTERM, signal.SIGUSR1)",
     "SIGNALS = (signal.SIGTERM,)", ["tests/test_resume_parts.py", "-k", "signal"]),  # SLURM's time-limit warning kills
    ("stop-agrees-by-sum", "common/stop_signal.py", "op=dist.ReduceOp.MAX", "op=dist.ReduceOp.SUM",
     ["tests/test_resume_parts.py", "-k", "signal"]),  # two ranks with SIGTERM would exit with 128 + 30
    ("checkpoint-drops-the-scaler", "src/ch4/resume/mnist_3_ddp_resume.py",
     ', "scaler": scaler.state_dict()}', "}", ["tests/test_resume_parts.py", "-k", "scaler"]),
    ("sharded-truncation-unchecked", "common/sharded_checkpoint.py",
     "if shard.stat().st_size < item.offset + item.length:", "if False:",
     ["tests/test_resume.py", "-k", "truncated_shard"]),
    ("resume-keeps-the-first-buckets", "src/ch4/resume/mnist_3_ddp_resume.py",
     "        rebuild_buckets(model, autocast(device, precision), torch.zeros(1, 1, 28, 28, device=device))", "        pass",
     ["tests/test_resume.py", "-k", "stopped_three_ways"]),  # bitwise only at 2 processes
    ("overlap-figure-leaves-its-hooks", "figures/overlap_timeline.py", "    for hook in hooks:", "    for hook in hooks[:0]:",
     ["tests/test_figures.py", "-k", "outlives"]),  # the DDP, its process group and gloo threads live on to the exit
    ("benchmark-ignores-bucket-size", "benchmarks/bucketing_speed.py",
     "BucketedDataParallel(module, bucket_cap_mb=bucket_cap_mb)", "BucketedDataParallel(module, bucket_cap_mb=None)",
     ["tests/test_benchmarks.py", "-k", "bucketing"]),
    ("benchmark-runs-the-wrong-variant", "benchmarks/grad_sync.py",
     '"no_sync around forward + backward": "no_sync_around_forward_and_backward"',
     '"no_sync around forward + backward": "no_sync_around_backward_only"', ["tests/test_benchmarks.py", "-k", "grad_sync"]),
    ("benchmark-times-a-no-op", "benchmarks/allreduce_speed.py", 'CONTENDERS = {"dist.all_reduce (gloo)": dist.all_reduce, **ALGORITHMS}',
     'CONTENDERS = {"dist.all_reduce (gloo)": dist.all_reduce, **ALGORITHMS, "ring": lambda tensor: tensor}',
     ["tests/test_benchmarks.py", "-k", "allreduce"]),
]


def tracked_copy(folder: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / name).read_bytes())


def run(name, path, text, replacement, tests, timeout) -> tuple[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        tracked_copy(copy)
        source = (copy / path).read_text()
        if source.count(text) != 1:
            return "NOT APPLIED (text not found once)", 0.0
        (copy / path).write_text(source.replace(text, replacement))
        env = {**os.environ, "PYTHONPATH": str(copy)}
        start = time.perf_counter()
        try:
            result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                    cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "caught (timed out)", time.perf_counter() - start
        verdict = {0: "NOT CAUGHT", 1: "caught"}.get(result.returncode, f"pytest exit {result.returncode}")
        return verdict, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[m[0] for m in MUTATIONS], help="run only these bugs")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per bug (default: 900)")
    args = parser.parse_args()
    rows = []
    for name, path, text, replacement, tests in MUTATIONS:
        if args.only and name not in args.only:
            continue
        verdict, seconds = run(name, path, text, replacement, tests, args.timeout)
        print(f"{name}: {verdict} in {seconds:.0f} s", flush=True)
        rows.append((name, path, verdict, seconds))
    print("\n| planted bug | file | tests | seconds |\n|---|---|---|---:|")
    for name, path, verdict, seconds in rows:
        print(f"| {name} | {path} | {verdict} | {seconds:.0f} |")
    sys.exit(0 if all(verdict.startswith("caught") for _, _, verdict, _ in rows) else 1)


if __name__ == "__main__":
    main()
