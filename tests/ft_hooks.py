"""Run a fault-tolerant rung unchanged, with what a test needs to time a kill, or with a planted bug.

    torchrun --standalone --nproc_per_node=1 tests/ft_hooks.py WHAT src/ch4/fault_tolerant/mnist_3_ddp_ft.py FLAGS...

WHAT is comma-separated:
  slow-while=FILE      every optimizer step sleeps 1 s more while FILE exists, so that the survivors are still
                       training when a restarted group has started (its start takes seconds on a loaded CPU);
                       FILE.G.R exists while rank R of group G (its --group) sleeps there: between two steps, where
                       it has no quorum request at the lighthouse (zero_grad asks for the next), so a kill there
                       leaves none behind
  slow-heal=FILE       the heal writes FILE when it starts fetching a peer's state, then waits 3 s: long enough
                       for a test to kill the group in the middle of its heal
  late-commit=SECONDS  rank 0 of the group reaches its second step's commit SECONDS late (should_commit waits
                       there for every rank of the group)
  skip-heal-copy       negative control: the heal loads nothing (the weights and the moments stay where they were;
                       the step still jumps to the peers')
  heal-weights-only    negative control: the heal loads the weights but not the optimizer's moments
  pids=FOLDER          FOLDER/G.R holds the process id of rank R of group G (its --group): the process a test kills
                       to kill that rank, wherever it was started from
  none                 nothing
"""
import os
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def slow_while(path: Path, group: str) -> None:
    resting = path.with_name(f"{path.name}.{group}.{os.environ.get('RANK', 0)}")

    def hook(optimizer, args, kwargs) -> None:
        if path.exists():
            resting.touch()
            time.sleep(1.0)
            resting.unlink()
    register_optimizer_step_post_hook(hook)


def slow_heal(path: Path) -> None:
    from torchft.checkpointing.http_transport import HTTPTransport
    receive = HTTPTransport.recv_checkpoint

    def slowly(self, *args, **kwargs):
        path.write_text("healing\n")
        time.sleep(3)
        return receive(self, *args, **kwargs)
    HTTPTransport.recv_checkpoint = slowly


def late_commit(seconds: float) -> None:
    """Rank 0 of the group reaches its second step's commit `seconds` late: its other ranks wait for it there."""
    import torchft
    commit, calls = torchft.Manager.should_commit, []

    def late(self, *args, **kwargs):
        calls.append(True)
        if len(calls) == 2 and os.environ["RANK"] == "0":
            time.sleep(seconds)
        return commit(self, *args, **kwargs)
    torchft.Manager.should_commit = late


def load_nothing_into(*classes) -> None:
    """The rung loads a peer's state only when it heals, so these load_state_dicts are the heal's."""
    for cls in classes:
        cls.load_state_dict = lambda self, state_dict, *args, **kwargs: None


def main() -> None:
    what, script, *argv = sys.argv[1:]
    group = argv[argv.index("--group") + 1] if "--group" in argv else os.environ.get("REPLICA_GROUP_ID", "0")  # as the rung reads it
    for item in what.split(","):
        name, _, value = item.partition("=")
        if name == "pids":
            (Path(value) / f"{group}.{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))
        elif name == "slow-while":
            slow_while(Path(value), group)
        elif name == "slow-heal":
            slow_heal(Path(value))
        elif name == "late-commit":
            late_commit(float(value))
        elif name == "skip-heal-copy":
            load_nothing_into(torch.nn.Module, torch.optim.Optimizer)
        elif name == "heal-weights-only":
            load_nothing_into(torch.optim.Optimizer)
        elif name != "none":
            sys.exit(f"tests/ft_hooks.py: unknown hook {name}")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
