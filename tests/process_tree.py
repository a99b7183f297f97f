"""A launch's processes as Linux's /proc shows them: whether one still runs, and every process below one (a
launcher's workers live in sessions of their own, so a process group does not find them)."""
import os
import signal
from pathlib import Path


def _fields(stat: Path) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (which may hold spaces), None once it is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether pid runs: neither gone nor a zombie its parent has yet to reap."""
    fields = _fields(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """pid's children, theirs, and so on."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _fields(stat)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def kill_tree(*pids: int) -> None:
    """SIGKILL each of pids and every process below them, all listed before the first signal (a child whose parent
    dies first is not lost to init); one that has ended meanwhile is skipped."""
    for pid in [*pids, *(below for pid in pids for below in descendants(pid))]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
