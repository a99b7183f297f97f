"""A launcher's worker whose script runs in a fork of the warm server that forked the launcher, instead of in a
new interpreter that imports torch again.

    (torchrun runs it for each worker, in a session of its own)  python -u tests/warm_worker.py SCRIPT ARGS...

This process is the worker the launcher sees. It imports no torch: it asks the server named in its environment
(tests/warm_python.py's SOCKET) to fork `python SCRIPT ARGS` with its own environment, folder, output files and
ignored signals, in a session of its own; passes on each signal the launcher sends; and ends as that process
ended, with its exit code or by the signal that ended it. If it is killed, the server kills the fork's
process group.
"""
import os
import signal
import sys

from warm_python import SOCKET, start

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def pass_on(number, _):
    """To the fork's process group, as torchrun signals its worker's (the fork's DataLoader workers are in it)."""
    try:
        os.killpg(process.pid, number)
    except ProcessLookupError:  # it has ended: its end is on its way
        pass


signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)  # held until there is a process to pass them on to
process = start(sys.argv[1:], os.getcwd(), dict(os.environ), sys.stdout, sys.stderr, new_session=True,
                server=os.environ[SOCKET])
for number in PASSED_ON:
    signal.signal(number, pass_on)
signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
code = process.wait()
if code < 0:  # end by the same signal: its default action (SIGKILL's cannot be set, and is that already)
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
