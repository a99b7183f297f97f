"""The parts of a resume that a killed run on the CPU cannot show: which signals stop a run, how the
ranks agree when several of them get one (SLURM signals every task), and the loss scaler's state
through a checkpoint (only fp16 has one, and fp16 does not run on the CPU: a CPU GradScaler does)."""
import gc
import importlib.util
import os
import signal
import weakref
from types import SimpleNamespace

import pytest
import torch

from common.checkpoint import Checkpoints, Position
from common.spawn import run_in_process_group
from common.stop_signal import StopSignal

from conftest import ROOT


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
    the StopSignal and its process group alive past destroy_process_group(), and gloo's threads would race
    the interpreter's teardown (an abort in about one exit in eight of the resume rung)."""
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
