"""Run a chapter script unchanged, and SIGKILL this process at a chosen point of one of torchrun's attempts.

    torchrun --max-restarts=1 ... tests/crash.py WHAT src/ch4/resume/mnist_3_ddp_resume.py FLAGS...

WHAT is comma-separated:
  kill-rank<R>-after-step<K>   rank R dies right after its K-th optimizer step (mid-epoch, no warning)
  kill-rank<R>-in-save<K>      rank R dies in its K-th checkpoint save, after the temporary file is
                               written and before the rename puts it in place
  term-rank<R>-after-step<K>   rank R (only) gets SIGTERM right after its K-th optimizer step
  termgroup-rank<R>-after-step<K>  rank R's process group (the rank and its DataLoader workers) gets SIGTERM, as
                               torchrun and SLURM send it
  slow-first-run               0.3 s more per step until a restart or requeue, so that a test can
                               interrupt a tiny run while it still trains
  forget-rng                   negative control: a resume does not restore the random state
  replay-epoch                 negative control: a resumed epoch starts again at its first batch
  per-rank-cursor-from<N>      negative control: the cursor counted per rank, as N ranks wrote it (each
                               rank's c / N samples done): every rank of the resumed run skips c / N
                               of its own indices, so M ranks skip c·M/N of the shuffle, not c
  record-samples               every rank appends the indices its training sampler yields, one a line,
                               to $RECORD_SAMPLES/rank<R>.txt (what it trains on, in order)
  record-loaded                every rank saves its parameters and optimizer state as they are before
                               its first optimizer step (what it loaded) to $RECORD_SAMPLES/loaded-rank<R>.pt
  first-buckets                negative control: a resumed DDP does not rebuild its buckets before
                               its first step (common/resume_buckets.py)
  keep-eval-padding            negative control: the Trainer gathers its evaluation without dropping the
                               padding that evens the ranks' batches (Accelerate's gather, not gather_for_metrics)
  no-agreed-stop               negative control: a stream rung's rank leaves the epoch when its own share runs out,
                               without asking the others (common/stream.py's every_rank_has)
  threads-at-exit              the last thing before the interpreter's teardown: print the names of the process's
                               threads still running ("threads at exit: python, ...")
  keep-compiled-code           negative control: dynamo's compiled code is kept to the interpreter's teardown
                               (common/compile.py's release_compiled_code)
  keep-checkpoints             every checkpoint stays (common/checkpoint.py keeps the newest KEEP), for a test
                               that starts another run from an early one
  none                         no crash
Kills and stops happen only on the first attempt (TORCHELASTIC_RESTART_COUNT 0, SLURM_RESTART_COUNT 0), so
the restart runs clean; ITEM@N does ITEM on attempt N alone (kill-rank2-after-step3@1: the first restart's
rank 2 dies after its own third step), so that one launch with --max-restarts=N can be killed N times.
"""
import atexit
import os
import re
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

KILLING = re.compile(r"(kill|term|termgroup)-rank(\d+)-(after-step|in-save)(\d+)")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int, action) -> None:
    count = 0

    def hook(optimizer, args, kwargs) -> None:
        nonlocal count
        count += 1
        if count == step:
            action()
    register_optimizer_step_post_hook(hook)


def threads_at_exit() -> None:
    """Registered before the script runs, so that it runs after the script's own exit functions."""
    def show() -> None:
        names = []
        for task in sorted(Path("/proc/self/task").iterdir()):
            try:
                names.append((task / "comm").read_text().strip())
            except FileNotFoundError:  # a thread that ended since the folder was listed: not running at exit
                pass
        # one write: print() writes the line and its newline apart, and unbuffered (PYTHONUNBUFFERED) the other
        # rank's line can land between the two, two lines in one
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"threads at exit: {', '.join(names)}\n".encode())
    atexit.register(show)


def record_samples(path: Path) -> None:
    from common.samplers import ResumableDistributedSampler
    original_iter = ResumableDistributedSampler.__iter__

    def recorded(self):
        with open(path, "a") as file:
            for index in original_iter(self):
                print(index, file=file, flush=True)  # flushed: a rank killed after a step has written its batches
                yield index
    ResumableDistributedSampler.__iter__ = recorded


def whole(tree):
    """FSDP2's DTensors as whole tensors (full_tensor is a collective: every rank records at its first step)."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {key: whole(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [whole(value) for value in tree]
    return tree


def record_loaded(path: Path) -> None:
    def hook(optimizer, args, kwargs) -> None:
        if any(group["lr"] == 0 for group in optimizer.param_groups):
            return  # get_state_dict's step with zero gradients and lr 0, which makes AdamW's state to load into
        if not path.exists():
            parameters = [whole(parameter.detach()).clone() for group in optimizer.param_groups for parameter in group["params"]]
            torch.save({"parameters": parameters, "optimizer": whole(optimizer.state_dict())}, path)
    register_optimizer_step_pre_hook(hook)


def kill_in_save(save: int) -> None:
    original, count = os.replace, 0

    def replace(source, destination):
        nonlocal count
        if re.fullmatch(r"step-\d+\.pt", os.path.basename(destination)):
            count += 1
            if count == save:
                die()
        return original(source, destination)
    os.replace = replace


if __name__ == "__main__":
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    rank = os.environ.get("RANK", "0")
    what = []
    for item in sys.argv[1].split(","):
        item, _, on = item.partition("@")
        first_attempt_only = KILLING.fullmatch(item) or item == "slow-first-run"
        if int(on or (0 if first_attempt_only else attempt)) == attempt:
            what.append(item)
    for item in what:
        killing = KILLING.fullmatch(item)
        if killing and killing.group(2) == rank:
            how, when, count = killing.group(1), killing.group(3), int(killing.group(4))
            if when == "in-save":
                kill_in_save(count)
            else:
                after_step(count, {"kill": die, "term": lambda: os.kill(os.getpid(), signal.SIGTERM),
                                   "termgroup": lambda: os.killpg(os.getpgid(0), signal.SIGTERM)}[how])
        elif item == "slow-first-run":
            register_optimizer_step_post_hook(lambda optimizer, args, kwargs: time.sleep(0.3))
        elif item == "forget-rng":
            import common.checkpoint
            common.checkpoint.set_rng_state = lambda state, device: None
        elif item == "replay-epoch":
            from common.samplers import ResumableDistributedSampler
            original_set_epoch = ResumableDistributedSampler.set_epoch
            ResumableDistributedSampler.set_epoch = lambda self, epoch, samples_done=0: original_set_epoch(self, epoch)
        elif per_rank := re.fullmatch(r"per-rank-cursor-from(\d+)", item):
            from common.samplers import ResumableDistributedSampler
            original_set_epoch, written_by = ResumableDistributedSampler.set_epoch, int(per_rank.group(1))
            ResumableDistributedSampler.set_epoch = lambda self, epoch, samples_done=0: original_set_epoch(
                self, epoch, samples_done // written_by * self.num_replicas)
        elif item == "record-samples":
            record_samples(Path(os.environ["RECORD_SAMPLES"]) / f"rank{rank}.txt")
        elif item == "record-loaded":
            record_loaded(Path(os.environ["RECORD_SAMPLES"]) / f"loaded-rank{rank}.pt")
        elif item == "first-buckets":
            import common.resume_buckets
            common.resume_buckets.rebuild_buckets = lambda model, autocast, *inputs, **kwargs: None
        elif item == "keep-eval-padding":
            import accelerate
            accelerate.Accelerator.gather_for_metrics = lambda self, data, use_gather_object=False: self.gather(data)
        elif item == "threads-at-exit":
            threads_at_exit()
        elif item == "keep-compiled-code":
            import common.compile
            common.compile.release_compiled_code = lambda: None
        elif item == "keep-checkpoints":
            import common.checkpoint
            common.checkpoint.KEEP = sys.maxsize
        elif item == "no-agreed-stop":
            import common.stream
            common.stream.every_rank_has = lambda batch: batch is not None
        elif not killing and item != "none":
            sys.exit(f"tests/crash.py: unknown {item}")
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
