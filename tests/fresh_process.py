"""Run a script in a worker that tests/warm_torchrun.py forked, as in the process torchrun would have started.

    (in the worker, run by torchrun --run-path) fresh_process.py SCRIPT ARGS...

torchrun starts each worker in a session of its own (start_new_session) as `python -u SCRIPT ARGS`; this
makes the fork the same (tests/as_python.py) and runs the script as python would.
"""
import multiprocessing
import os
import sys

from as_python import afresh, run
from torch.distributed.elastic.multiprocessing.api import _wrap

os.setsid()
afresh()
# torchrun's fork path counts a worker done when its function has returned a value (on a queue) and its
# process has exited. A script that ends its process itself (common.distributed.exit_process) returns
# nothing, and torchrun would wait for it forever: the value is handed back first, so that the run is
# over when every worker has exited, as for the processes torchrun itself starts.
launch = multiprocessing.current_process()._args  # torch.multiprocessing's (fn, local rank, fn's args, error file)
assert launch[0] is _wrap, "fresh_process.py runs in a worker that tests/warm_torchrun.py forks"
launch[2][5][launch[1]].put(None)  # _wrap's args: entrypoint, args, envs, stdouts, stderrs, return values...
code = run(sys.argv[1:])
if code:
    raise SystemExit(code)
