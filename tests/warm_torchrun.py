"""torchrun, each worker a fork of the warm server instead of a new interpreter (tests/warm_worker.py).

    python tests/warm_torchrun.py --standalone --nproc_per_node=3 src/ch4/mnist_3_ddp.py FLAGS...

The suite runs this as `python SCRIPT`, so the launcher itself is forked from a warm server (tests/warm_python.py).
It takes torchrun's own arguments and runs torchrun's own code (rendezvous, restarts, signals, exit codes,
the summary of failed ranks), with one change: each worker runs tests/warm_worker.py SCRIPT ARGS, which has the
same server fork the script. Every fork ends through the interpreter's own exit, as a fresh worker does.
"""
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import parse_args, run
from warm_python import SOCKET, socket_for

WORKER = Path(__file__).resolve().with_name("warm_worker.py")


def forked(args):
    """torchrun's parsed arguments, changed to start each worker as tests/warm_worker.py (tests/warm_accelerate.py
    changes accelerate's the same way)."""
    if args.no_python or args.module or args.run_path:
        sys.exit("a warm launch runs a Python script: use the launcher itself for --no-python, --module or --run-path")
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(WORKER)
    if SOCKET not in os.environ:  # a launcher started afresh (by subprocess), not forked by a warm server
        os.environ[SOCKET] = socket_for(dict(os.environ))
    return args


if __name__ == "__main__":
    record(run)(forked(parse_args(sys.argv[1:])))
