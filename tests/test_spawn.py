"""common/spawn.py's processes meet however busy the machine's ports are: the rendezvous store is bound by
the parent to a port the kernel picks, so no other process can take the port between its choice and its bind.
They come from a fork server, and still read the caller's environment of the moment, as spawned ones would,
and start processes of their own as a process that torchrun started does."""
import multiprocessing
import os
import socket

import torch
from torch.utils.data import DataLoader, TensorDataset

import common.distributed
import common.spawn
from common.lessons.notebook_workers import pass_to_the_right
from common.spawn import run_in_process_group


def test_a_port_held_by_another_process_does_not_stop_the_rendezvous(monkeypatch):
    """The race made certain: another process holds the port that a choose-then-bind helper hands out. With such a
    helper (common.distributed's free_port, which this module used before) the processes cannot meet: this test
    fails on that version."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for module in (common.distributed, common.spawn):
            monkeypatch.setattr(module, "free_port", lambda: taken.getsockname()[1], raising=False)
        assert run_in_process_group(pass_to_the_right, 3, timeout=60) == [2, 0, 1]


def variable(rank, world_size, name):
    return os.environ.get(name)


def write_variable(name, path):
    with open(path, "w") as file:
        file.write(repr(os.environ.get(name)))


def test_the_processes_read_the_callers_environment_of_the_moment(monkeypatch, tmp_path):
    """The fork server started with this process's environment (at the latest, now); a variable set after it
    started reaches run_in_process_group's processes. The control: a plain process of the same fork server
    does not see it, which is the trap run_in_process_group's hand-over of the environment avoids."""
    run_in_process_group(variable, 2, "PATH", timeout=60)  # the server is running from here on
    monkeypatch.setenv("SET_AFTER_THE_SERVER_STARTED", "yes")
    assert run_in_process_group(variable, 2, "SET_AFTER_THE_SERVER_STARTED", timeout=60) == "yes"
    process = multiprocessing.get_context("forkserver").Process(
        target=write_variable, args=("SET_AFTER_THE_SERVER_STARTED", tmp_path / "seen"))
    process.start()
    process.join(timeout=60)
    assert (tmp_path / "seen").read_text() == "None"


def load_with_a_worker(rank, world_size):
    images = torch.arange(64.0).view(16, 4) + 0.5  # a dataset the worker gets a copy of
    loaded = torch.cat([batch for batch, in DataLoader(TensorDataset(images), 4, num_workers=1)])
    return multiprocessing.get_start_method(), torch.equal(loaded, images)


def test_a_dataloader_in_the_processes_starts_its_workers_as_under_torchrun():
    """The processes' own default start method is the platform's, as in a process torchrun started, so a
    DataLoader forks its worker there (on Linux before 3.14) and loads the batches. Without the reset, the
    default is the fork server's, whose server fails to rebuild the dataset's tensors (unable to resize file)."""
    assert run_in_process_group(load_with_a_worker, 2, timeout=60) == (multiprocessing.get_context().get_start_method(), True)
