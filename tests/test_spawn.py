"""common/spawn.py's processes meet however busy the machine's ports are: the rendezvous store is bound by
the parent to a port the kernel picks, so no other process can take the port between its choice and its bind.
They come from a fork server, and still read the caller's environment of the moment, as spawned ones would."""
import multiprocessing
import os
import socket

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
