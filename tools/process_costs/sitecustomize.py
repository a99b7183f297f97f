"""Each Python process of a `make test-durations` run notes, as it ends, the CPU seconds it used itself and
the test that started it (tools/durations.py puts this folder on PYTHONPATH and names PROCESS_COSTS).

A process forked by multiprocessing (a DataLoader worker, a process of common/spawn.py's fork server) ends
through os._exit, which skips atexit: it notes its own through multiprocessing's exit finalizers instead.
The suite's warm launches (tests/warm_python.py) end their forks as python ends, running the exit functions.
Children are not added in, so that no second is counted twice. On PYTHONPATH, this module is found before
a sitecustomize of the Python installation, which does not run during such a run.
"""
import atexit
import json
import multiprocessing.util
import os
import resource
import sys
import time

FOLDER = os.environ.get("PROCESS_COSTS")


def note(forked=False):
    if os.getpid() in noted:  # a multiprocessing child that also runs the exit functions notes once
        return
    noted.add(os.getpid())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"argv": sys.argv[:4], "cpu": usage.ru_utime + usage.ru_stime, "forked": forked,
              "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
    path = os.path.join(FOLDER, f"{os.getpid()}-{time.monotonic_ns()}.json")
    with open(path + ".part", "w") as file:  # renamed once whole: a process killed as it writes leaves no half note
        json.dump(record, file)
    os.replace(path + ".part", path)


def note_from_a_forked_child(_):
    multiprocessing.util.Finalize(None, note, kwargs={"forked": True}, exitpriority=-1000)


noted = set()
if FOLDER:
    started_by = os.getpid()
    atexit.register(lambda: note(forked=os.getpid() != started_by))  # a fork runs them only if it calls them
    multiprocessing.util.register_after_fork(note, note_from_a_forked_child)
