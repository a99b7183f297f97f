"""What a process starts with, written by each rank to FOLDER/rank<R>.json: run as a fresh interpreter and
forked (tests/warm_torchrun.py, tests/warm_python.py) by test_warm_launch.py, which compares them.

    torchrun --nproc_per_node=2 tests/process_facts.py END FOLDER
    python tests/process_facts.py END FOLDER

END is how the script ends: `return` (falls off its end), `exit_process` (common.distributed.exit_process,
which ends the process without the interpreter's teardown), `message` (sys.exit with a sentence), `raise`
(an exception) or `sleep` (not before its time limit).
"""
import atexit
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import numpy
import torch

end, folder = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ.get("RANK", 0))
LAUNCHERS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def described(handler) -> str:
    return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}.get(handler, getattr(handler, "__qualname__", repr(handler)))


facts = {
    "own session": os.getsid(0) == os.getpid(), "own process group": os.getpgid(0) == os.getpid(),
    "handlers": {name: described(signal.getsignal(getattr(signal, name)))
                 for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGPIPE", "SIGCHLD")},
    "__name__": __name__, "__spec__": repr(__spec__), "__loader__": type(__loader__).__name__, "__file__": __file__,
    "argv": sys.argv[:2], "sys.path[0] is the script's folder": sys.path[0] == str(Path(__file__).parent),
    "sys.path after it": sys.path[1:], "interpreter flags": repr(sys.flags),
    "thread name": Path("/proc/self/comm").read_text().strip(),
    "start method": multiprocessing.get_start_method(allow_none=True),
    "threads": torch.get_num_threads(), "inter-op threads": torch.get_num_interop_threads(),
    "numpy draw": int(numpy.random.randint(2**31)), "hash": hash("a string"),
    "launcher's variables": {name: value for name, value in sorted(os.environ.items())
                             if name.startswith("ACCELERATE_") or name in LAUNCHERS_VARIABLES},
}
(folder / f"rank{rank}.json").write_text(json.dumps(facts))
atexit.register(lambda: (folder / f"rank{rank}.exit").write_text("the exit functions ran"))

if end == "exit_process":
    from common.distributed import exit_process
    exit_process(0)
elif end == "message":
    sys.exit(f"rank {rank} stops with a sentence")
elif end == "raise":
    raise ValueError("a bug")
elif end == "sleep":
    time.sleep(600)
