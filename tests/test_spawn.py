"""common/spawn.py's processes meet however busy the machine's ports are: the rendezvous store is bound by
the parent to a port the kernel picks, so no other process can take the port between its choice and its bind."""
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
