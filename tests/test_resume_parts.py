"""The parts of a resume that a killed run on the CPU cannot show: which signals stop a run, how the
ranks agree when several of them get one (SLURM signals every task), the loss scaler's state
through a checkpoint (only fp16 has one, and fp16 does not run on the CPU: a CPU GradScaler does), and
a kill at each point of replacing a sharded checkpoint saved twice at one step."""
import gc
import importlib.util
import os
import shutil
import signal
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from common.checkpoint import Checkpoints, Position
from common.sharded_checkpoint import ShardedCheckpoints
from common.spawn import run_in_process_group
from common.stop_signal import StopSignal


def signals_agreed(rank, world_size):
    """Rank 1 alone gets SIGUSR1 (the time-limit warning); then ranks 0 and 2 both get SIGTERM."""
    stop, seen = StopSignal(), []
    for senders, signum in (({1}, signal.SIGUSR1), ({0, 2}, signal.SIGTERM)):
        stop.received = 0
        if rank in senders:
            os.kill(os.getpid(), signum)  # the handler runs before the next bytecode: no race with the all-reduce
        seen.append((stop.agreed(), stop.signum))
    return seen


def test_ranks_agree_on_the_signal_any_of_them_got():
    """Every rank stops at the same step with the signal's own number (its exit status is 128 + it), also
    when two ranks got SIGTERM: an all-reduce that summed the flags would say 30."""
    assert run_in_process_group(signals_agreed, 3, timeout=120) == [(True, signal.SIGUSR1), (True, signal.SIGTERM)]


def test_the_signal_handler_does_not_keep_the_stop_signal_alive():
    """The handler stays installed after the script's main() returns; were it a bound method, it would keep
    the StopSignal, and whatever it holds, alive until the interpreter's teardown."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = StopSignal()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1  # the handler still reaches it
        gone = weakref.ref(stop)
        del stop
        gc.collect()
        assert gone() is None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def flag_groups(rank, world_size):
    """The default group under gloo; beside NCCL (the backend's name stands in for it), a gloo group of its
    own, made once, that carries an all-reduce."""
    import torch.distributed as dist

    from common.flag_group import flag_group
    under_gloo = flag_group() is dist.group.WORLD
    dist.get_backend = lambda group=None: "nccl"
    beside = flag_group()
    flag = torch.tensor([rank])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=beside)
    return under_gloo, beside is not dist.group.WORLD, flag_group() is beside, dist.get_world_size(beside), int(flag)


def test_a_flag_travels_on_gloo_beside_any_other_backend():
    assert run_in_process_group(flag_groups, 3, timeout=120) == (True, True, True, 3, 2)


def test_the_loss_scaler_goes_through_a_checkpoint(tmp_path):
    """The resume script's training_state holds the scaler, and a checkpoint gives it back as it was."""
    spec = importlib.util.spec_from_file_location("resume", ROOT / "src" / "ch4" / "resume" / "mnist_3_ddp_resume.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = SimpleNamespace(module=torch.nn.Linear(2, 2))  # all that training_state reads of the DDP wrapper
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    scaler.scale(model.module(torch.ones(1, 2)).sum()).backward()
    for _ in range(2):  # two good steps: the growth tracker counts them towards the next doubling
        scaler.step(optimizer)
        scaler.update()
    checkpoints = Checkpoints(tmp_path, 1, fingerprint={}, device=torch.device("cpu"))
    checkpoints.save(script.Position(step=2), script.training_state(model, optimizer, scaler))
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(checkpoints.load_newest()["scaler"])
    assert restored.state_dict() == scaler.state_dict() and restored.get_scale() == 2.0 ** 10
    assert restored.state_dict()["_growth_tracker"] == 2


def test_a_checkpoint_of_an_older_position_is_one_sentence(tmp_path):
    """A checkpoint written when the position counted batches per rank stops the run with one sentence,
    and the folder keeps it."""
    checkpoints = Checkpoints(tmp_path, 1, fingerprint={}, device=torch.device("cpu"))
    checkpoints.save(Position(step=2), {})
    path = tmp_path / "step-00000002.pt"
    old = torch.load(path, weights_only=True)
    old["position"] = {"epoch": 0, "batches_done": 2, "step": 2}
    torch.save(old, path)
    with pytest.raises(SystemExit, match="written by an older version of these scripts"):
        checkpoints.load_newest()
    assert torch.load(path, weights_only=True)["position"]["batches_done"] == 2


class Killed(BaseException):
    """A SIGKILL stand-in: nothing catches it, so nothing after the point where it is raised runs."""


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_kill_while_a_sharded_checkpoint_is_replaced_leaves_a_complete_one(tmp_path, monkeypatch, kill_at):
    """The end of training saves the step of the last periodic checkpoint again. The kill_at-th rename or
    removal of a folder of the checkpoint folder in that second save is killed (renaming the old step-8/
    aside, the new one into place, removing the old); a later start still finds a complete step 8, and it
    loads: the old weights before the new folder is in place, the new ones after. Removing the old folder
    first, as before, leaves no step 8 after a kill before the rename."""
    folder = tmp_path / "checkpoints"
    ShardedCheckpoints(folder, 8, {}, torch.device("cpu")).save(Position(step=8), {"model": {"w": torch.ones(4)}})
    operations = []

    def killed_at(original):
        def operation(path, *args, **kwargs):
            if Path(path).parent == folder:
                operations.append(path)
                if len(operations) == kill_at:
                    raise Killed
            return original(path, *args, **kwargs)
        return operation

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", killed_at(Path.rename))
        patch.setattr(shutil, "rmtree", killed_at(shutil.rmtree))
        with pytest.raises(Killed):
            ShardedCheckpoints(folder, 8, {}, torch.device("cpu")).save(Position(step=8), {"model": {"w": torch.full((4,), 2.0)}})
    assert (folder / "step-00000008").is_dir() or (folder / "step-00000008.old").is_dir()
    restarted = ShardedCheckpoints(folder, 8, {}, torch.device("cpu"))
    with torch.random.fork_rng():  # loading restores the saved random state
        loaded = restarted.load_newest(lambda: {"model": {"w": torch.zeros(4)}})
    assert loaded["position"]["step"] == 8
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 1.0 if kill_at < 3 else 2.0))
    assert not list(folder.glob("*.old"))  # put back, or removed beside a complete step-8/
