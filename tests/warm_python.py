"""`python SCRIPT ARGS` for the suite, forked from a process that has imported torch once.

run() hands the command to a server (one per pytest worker, started at its first call, ended with it) that
forks a process for it: the fork takes the command's folder and output files, is made what a new
interpreter would be (tests/as_python.py), with the signals the caller ignores now still ignored (those of
the server's own start may have changed since), runs the script, and exits with its code. The server reports the
process's number, then its end. The server's environment is the command's (but for the name of the test
that runs it, which pytest changes for each): a fresh interpreter reads some variables as it imports torch,
so a command in another environment gets a new server.
"""
import atexit
import ctypes
import importlib
import json
import locale
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from as_python import PRELOAD, afresh, ignored_signals
from as_python import run as run_script

_server = {}
_one_at_a_time = threading.Lock()


def _serve(path: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())  # an ordinary exit, its exit functions run (afresh() resets it)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end with the pytest worker that started it
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 2)
        with connection.makefile("rb") as rest:  # a stream: the request may come in more than one piece
            message += rest.read()
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            listener.close()
            connection.close()
            for fd, target in zip(fds, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            afresh(request["ignored"])
            os._exit(run_script(request["argv"]))
        for fd in fds:
            os.close(fd)
        try:
            connection.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:  # the caller gave up on it (its time limit): it killed the process
            pass
        connection.close()


def _start(env: dict) -> dict:
    folder = tempfile.mkdtemp(prefix="warm-python-")
    path = os.path.join(folder, "socket")
    log = open(os.path.join(folder, "log"), "w+")  # noqa: SIM115  (the server's, for as long as it runs)
    process = subprocess.Popen([sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=log, text=True)
    if process.stdout.readline() != "ready\n":
        raise RuntimeError(f"tests/warm_python.py's server did not start:\n{_read(log)}")
    atexit.register(shutil.rmtree, folder, True)  # after the server's end (atexit runs the last registered first)
    atexit.register(process.terminate)
    return {"env": env, "path": path, "process": process, "log": log}


def run(args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run `python SCRIPT ARGS` (args without the python) in environment env."""
    with _one_at_a_time:
        if _server and _server["process"].poll() is not None:  # ended by something else: say what, start another
            print(f"tests/warm_python.py's server ended (exit {_server['process'].returncode}):\n{_read(_server['log'])}",
                  file=sys.stderr)
            _server.clear()
        if _server and _imported_with(env) != _imported_with(_server["env"]):  # the suite's own changed (once)
            _server.pop("process").terminate()
            _server.clear()
        if not _server:
            _server.update(_start(env))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, socket.socket(socket.AF_UNIX) as server:
            try:
                server.connect(_server["path"])
            except OSError as refused:
                raise RuntimeError(f"tests/warm_python.py's server is gone ({refused}):\n{_read(_server['log'])}") from None
            socket.send_fds(server, [json.dumps({"argv": [str(a) for a in args], "cwd": str(cwd), "env": env,
                                                  "ignored": ignored_signals()}).encode()],
                            [out.fileno(), err.fileno()])
            server.shutdown(socket.SHUT_WR)  # the request's end
            replies = server.makefile()
            answer = replies.readline()
            if not answer:
                raise RuntimeError(f"tests/warm_python.py's server did not take the command:\n{_read(_server['log'])}")
            pid = int(answer)
            server.settimeout(timeout)
            try:
                end = replies.readline()
                if not end:
                    raise RuntimeError(f"tests/warm_python.py's server ended before its process:\n{_read(_server['log'])}")
                code = int(end)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(args, timeout, *(_text(f) for f in (out, err))) from None
            return subprocess.CompletedProcess(args, code, _text(out), _text(err))


def _read(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _imported_with(env: dict) -> dict:
    """The variables a process could read as it imports torch: all but the one pytest sets for each test."""
    return {name: value for name, value in env.items() if name != "PYTEST_CURRENT_TEST"}


def _text(file) -> str:
    """What subprocess.run(text=True) reads: the locale's encoding, with universal newlines."""
    file.seek(0)
    return file.read().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
