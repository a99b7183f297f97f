"""Run a chapter script unchanged, and SIGKILL this process at a chosen point of torchrun's first attempt.

    torchrun --max-restarts=1 ... tests/crash.py WHAT src/ch4/resume/mnist_3_ddp_resume.py FLAGS...

WHAT is comma-separated:
  kill-rank<R>-after-step<K>   rank R dies right after its K-th optimizer step (mid-epoch, no warning)
  kill-rank<R>-in-save<K>      rank R dies in its K-th checkpoint save, after the temporary file is
                               written and before the rename puts it in place
  term-rank<R>-after-step<K>   rank R (only) gets SIGTERM right after its K-th optimizer step
  slow-first-run               0.3 s more per step until a restart or requeue, so that a test can
                               interrupt a tiny run while it still trains
  forget-rng                   negative control: a resume does not restore the random state
  replay-epoch                 negative control: a resumed epoch starts again at its first batch
  first-buckets                negative control: a resumed DDP does not rebuild its buckets before
                               its first step (common/ddp_buckets.py)
  none                         no crash
Kills happen only on the first attempt (TORCHELASTIC_RESTART_COUNT 0, SLURM_RESTART_COUNT 0), so
the restart runs clean.
"""
import os
import re
import runpy
import signal
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook


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
    what = sys.argv[1].split(",")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    rank = os.environ.get("RANK", "0")
    for item in what:
        killing = re.fullmatch(r"(kill|term)-rank(\d+)-(after-step|in-save)(\d+)", item)
        if killing and first_attempt and killing.group(2) == rank:
            how, when, count = killing.group(1), killing.group(3), int(killing.group(4))
            if when == "in-save":
                kill_in_save(count)
            else:
                after_step(count, die if how == "kill" else lambda: os.kill(os.getpid(), signal.SIGTERM))
        elif item == "slow-first-run" and first_attempt:
            register_optimizer_step_post_hook(lambda optimizer, args, kwargs: time.sleep(0.3))
        elif item == "forget-rng":
            import common.checkpoint
            common.checkpoint.set_rng_state = lambda state, device: None
        elif item == "replay-epoch":
            from common.samplers import ResumableDistributedSampler
            original_set_epoch = ResumableDistributedSampler.set_epoch
            ResumableDistributedSampler.set_epoch = lambda self, epoch, batches_done=0: original_set_epoch(self, epoch)
        elif item == "first-buckets":
            import common.ddp_buckets
            common.ddp_buckets.rebuild_buckets = lambda model, autocast, *inputs, **kwargs: None
        elif not killing and item not in ("none", "slow-first-run"):
            sys.exit(f"tests/crash.py: unknown {item}")
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
