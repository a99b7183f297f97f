"""Make a forked process what `python script.py` would have started, and run the script in it as python does.

tests/warm_python.py's processes (and through tests/warm_worker.py, the workers of the suite's warm launchers) are
forks of a process that has imported torch once; a fresh interpreter would import it again, about 3 CPU seconds
on a 2-core CPU, where a tiny test run trains in one. A fork keeps what its parent had: the parent's signal
handlers, its numpy random state, its thread's name, its thread count (read when it imported torch, before a
launcher set OMP_NUM_THREADS). afresh() gives each back as a new interpreter has it. The exit functions the
parent's imports registered stay: a fresh interpreter's are the same after the same imports. The fork ends as
python ends, through the interpreter's own exit: run() leaves it nothing else to do. One thing no fork can give
back: each interpreter draws its own hash seed, and forks share their parent's (tests/test_warm_launch.py shows
both).
"""
import builtins
import ctypes
import importlib.machinery
import multiprocessing
import os
import signal
import sys
import types
from pathlib import Path

# What the parent imports once, and afresh() finds in sys.modules: every optimizer imports torch._dynamo, and
# every BERT script transformers' model code (transformers.modeling_utils, about 1 CPU second of its own); every
# torch.compile call inductor's (torch._inductor.compile_fx, about 1 CPU second), and every DeepSpeed engine makes
# three (checking the optimizer it is given, it imports its Muon optimizer, whose functions torch.compile wraps).
# Not datasets: it imports pyarrow, whose jemalloc starts a background thread, and a fork of a process with that
# thread can deadlock in its own next fork (a rank starting its DataLoader workers hung in os.fork()).
# tests/warm_python.py's servers then freeze what these made (gc.freeze()): a fork's full collections (DeepSpeed's
# ZeRO-3 asks for one) scan what its script made, not the half a million objects of the imports.
PRELOAD = ["torch", "torch._dynamo", "numpy", "transformers.modeling_utils", "torch._inductor.compile_fx"]


def ignored_signals() -> list[int]:
    """The signals this process ignores now: those a process it starts keeps ignored."""
    return sorted(number for number in signal.valid_signals() if signal.getsignal(number) == signal.SIG_IGN)


def afresh(ignored=None) -> None:
    """ignored: the signals ignored by the process that asked for this one (by default, the fork's parent)."""
    # A new process gets its parent's signals as exec leaves them: a handled one back to its default, an ignored one
    # still ignored (nohup ignores SIGHUP; a shell without job control, SIGINT and SIGQUIT in a background
    # command); then Python's start sets its own.
    ignored = set(ignored_signals() if ignored is None else ignored)
    for number in set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}:
        handler = signal.SIG_IGN if number in ignored else \
            {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN, signal.SIGXFSZ: signal.SIG_IGN}.get(number, signal.SIG_DFL)
        try:
            signal.signal(number, handler)
        except OSError:  # signals the kernel reserves
            pass
    multiprocessing.set_start_method(None, force=True)  # the platform's default, not the parent's
    sys.modules["numpy"].random.seed()  # a seed of its own, as a new interpreter draws (random reseeds at fork itself)
    ctypes.CDLL(None).prctl(15, os.path.basename(sys.executable).encode()[:15])  # PR_SET_NAME: the thread's name
    if "OMP_NUM_THREADS" in os.environ:  # a fresh import of torch reads it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def run(argv: list[str]) -> None:
    """Run argv[0] as `python argv...` runs it, and leave its end to the interpreter that runs this.

    The script runs in a module __main__ whose __file__ is its absolute path, with sys.argv as given and the
    script's folder first on sys.path (runpy would set __file__ and sys.argv[0] to one path). Its end is python's:
    an uncaught exception is printed and becomes exit code 1, and SystemExit and KeyboardInterrupt go on up, so
    that the fork ends through the interpreter's own exit (threads joined, exit functions, finalization, the C
    library's exit handlers), as `python SCRIPT` would, never through os._exit."""
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = script, builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    try:
        exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    raise SystemExit(0)
