"""torchrun, each worker forked from the launcher, which has imported torch once, instead of started afresh.

    python tests/warm_torchrun.py --standalone --nproc_per_node=3 src/ch4/mnist_3_ddp.py FLAGS...

Takes torchrun's own arguments and runs torchrun's own code (rendezvous, restarts, exit codes), with two
of its options set: --start-method fork and --run-path, so that each worker is a fork of this process
running tests/fresh_process.py, which makes it the process torchrun would have started and runs the script.
"""
import importlib
import sys
from pathlib import Path

from as_python import PRELOAD
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import parse_args, run

FRESH = Path(__file__).resolve().with_name("fresh_process.py")


def preload():
    for module in PRELOAD:
        importlib.import_module(module)


def forked(args):
    """torchrun's parsed arguments, changed to fork each worker into tests/fresh_process.py (tests/warm_accelerate.py
    changes accelerate's the same way)."""
    if args.no_python or args.module or args.run_path:
        sys.exit("a warm launch runs a Python script: use the launcher itself for --no-python, --module or --run-path")
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.run_path, args.start_method = str(FRESH), True, "fork"
    return args


if __name__ == "__main__":
    preload()
    record(run)(forked(parse_args(sys.argv[1:])))
