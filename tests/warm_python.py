"""`python SCRIPT ARGS` for the suite, forked from a process that has imported torch once.

start() hands the command to a server that forks a process for it and returns it as subprocess.Popen shows
one (pid, poll(), wait(), returncode); run() starts one and waits, as subprocess.run does. The fork takes the
command's folder, environment and output files, is made what a new interpreter would be (tests/as_python.py),
with the signals the caller ignores now still ignored (those of the server's own start may have changed since),
and runs the script; its end propagates out of the server's code, so the fork ends as `python SCRIPT` ends:
non-daemon threads joined, exit functions run, the interpreter finalized, the C library's exit handlers run. A
fault at that teardown fails the fork as it fails python (tests/test_warm_launch.py). The server reports the
process's number, then its end, and forks the next command at once, so processes may run side by side (a
test's replica groups); a caller that closes its connection first has its process killed.

A server is a fresh interpreter started in the command's environment: a new interpreter reads some variables
as it starts and imports torch (PYTHONPATH, CUDA_VISIBLE_DEVICES, ...), so each environment (but for the
variables read only as a process runs, READ_AS_IT_RUNS) has a server of its own. A pytest worker starts one at
its first command in an environment, keeps the SERVERS it used last (each holds an imported torch), and ends
them with it.
"""
import atexit
import ctypes
import gc
import importlib
import json
import locale
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from as_python import PRELOAD, afresh, ignored_signals
from as_python import run as run_script

SERVERS = 6  # a worker meets 7 to 9 environments a suite; each server holds an imported torch
_servers = {}  # the started servers by environment, the one used last at the end
_lock = threading.Lock()
SOCKET = "WARM_PYTHON_SOCKET"  # in each forked process: its server, where a launcher's workers ask for their forks


def _serve(path: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())  # an ordinary exit, its exit functions run (afresh() resets it)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end when the thread that started it ends
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # a library this environment lacks, or a module a release renamed: the forks import their own
            pass
    gc.collect()  # what the imports made, out of the collector's scans in every fork: see PRELOAD's note
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    # The listener; for each running process a pidfd, readable at its end, and its caller's connection, readable
    # (at its end of file) if the caller gives up on it first.
    waiting = selectors.DefaultSelector()
    waiting.register(listener, selectors.EVENT_READ)
    print("ready", flush=True)
    server = os.getpid()
    try:
        _answer(listener, waiting)
    finally:
        if os.getpid() == server:  # the server's own end (a fork's end passes here too, and leaves its siblings)
            for key in list(waiting.get_map().values()):
                if isinstance(key.data, tuple):  # a process still running, which nobody else would end
                    _kill(key.data[0])


def _answer(listener: socket.socket, waiting: selectors.BaseSelector) -> None:
    """Fork a process for each request, report each process's end, and kill one whose caller gave up on it."""
    while True:
        for key, _ in waiting.select():
            if key.fileobj is listener:
                _take_request(listener.accept()[0], waiting)
            elif waiting.get_map().get(key.fd) is not key:  # unregistered by an earlier key of this round
                continue
            elif isinstance(key.data, int):  # a caller's connection
                if not key.fileobj.recv(1):
                    waiting.unregister(key.fileobj)
                    _kill(key.data)  # its end is reported as any other's
            else:
                pid, connection = key.data
                waiting.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                if waiting.get_map().get(connection.fileno()):
                    waiting.unregister(connection)
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                connection.close()


def _take_request(connection: socket.socket, waiting: selectors.BaseSelector) -> None:
    """Fork the process a caller asks for, tell it the pid, and wait for the process's end and the caller's."""
    pid = _fork(connection, waiting)
    if pid is None:  # the caller closed the connection before its request was whole
        connection.close()
        return
    try:
        connection.sendall(f"{pid}\n".encode())
    except OSError:  # the caller is gone already: so is its process
        _kill(pid)
    waiting.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, connection))
    waiting.register(connection, selectors.EVENT_READ, pid)


def _kill(pid: int) -> None:
    """SIGKILL the process and, where it leads a session of its own, its group (its DataLoader workers), as torchrun
    kills a worker's."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork(connection: socket.socket, waiting: selectors.BaseSelector) -> int | None:
    """Read a request and fork its process; return its pid (None for a request cut short)."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 2)
    while message and not message.endswith(b"\n"):  # a stream: the request may come in more than one piece
        piece = connection.recv(1 << 16)
        message = message + piece if piece else b""
    if not message:
        for fd in fds:
            os.close(fd)
        return None
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    for key in list(waiting.get_map().values()):  # the listener, the other processes' pidfds and their callers
        if isinstance(key.fileobj, int):
            os.close(key.fd)
        else:
            key.fileobj.close()
    waiting.close()
    connection.close()
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    afresh(request["ignored"])
    run_script(request["argv"])  # raises SystemExit (or KeyboardInterrupt): this process ends as python ends


class Process:
    """A process a server forked, as subprocess.Popen shows one: its pid, poll(), wait() and returncode."""

    def __init__(self, args: list, connection: socket.socket, log=None):
        self.args, self.returncode = args, None
        self._connection, self._log, self._received = connection, log, b""
        answer = self._line(None)
        if answer is None:
            raise RuntimeError(f"tests/warm_python.py's server did not take the command:\n{_read(log)}")
        self.pid = int(answer)

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line, None if it closed the connection first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())  # 0: poll(), which still reads what has arrived
                if not select.select([self._connection], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout)
            piece = self._connection.recv(64)
            if not piece:
                return None
            self._received += piece
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            end = self._line(timeout)
            if end is None:
                raise RuntimeError(f"tests/warm_python.py's server ended before its process:\n{_read(self._log)}")
            self.returncode = int(end)
            self._connection.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


def start(args: list, cwd, env: dict, stdout, stderr, new_session: bool = False, server: str | None = None) -> Process:
    """Start `python SCRIPT ARGS` (args without the python) in environment env, its output into the files
    stdout and stderr (either may be the other), in a session of its own if new_session. The process finds the
    server that forked it in its variable SOCKET; server, a server's socket, sends the command there (what
    tests/warm_worker.py does for a launcher's workers)."""
    started = None if server else _server_for(env)
    connection = socket.socket(socket.AF_UNIX)
    try:
        connection.connect(server or started["path"])
    except OSError as refused:
        connection.close()
        raise RuntimeError(f"tests/warm_python.py's server is gone ({refused}):\n{_read(started and started['log'])}") from None
    request = {"argv": [str(a) for a in args], "cwd": str(cwd), "env": {**env, SOCKET: server or started["path"]},
               "new_session": new_session, "ignored": ignored_signals()}
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [stdout.fileno(), stderr.fileno()])
    process = Process(args, connection, started and started["log"])
    if started:
        started["started"].add(process)
    return process


def run(args: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run `python SCRIPT ARGS` (args without the python) in environment env, as subprocess.run(text=True) would."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = start(args, cwd, env, out, err)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(args, timeout, _text(out), _text(err)) from None
        return subprocess.CompletedProcess(args, code, _text(out), _text(err))


def socket_for(env: dict) -> str:
    """The socket of the server for env, started if there is none (a warm launcher started afresh, by a test that
    runs it with subprocess, gives its workers this one)."""
    return _server_for(env)["path"]


def _server_for(env: dict) -> dict:
    """The server of this environment, started if there is none; the least recently used one ended past SERVERS."""
    key = json.dumps(_imported_with(env), sort_keys=True)
    with _lock:
        server = _servers.pop(key, None)
        if server and server["process"].poll() is not None:  # ended by something else: say what, start another
            print(f"tests/warm_python.py's server ended (exit {server['process'].returncode}):\n{_read(server['log'])}",
                  file=sys.stderr)
            server = None
        if server is None:
            idle = [name for name, other in _servers.items() if all(p.returncode is not None for p in other["started"])]
            while len(_servers) >= SERVERS and idle:  # one whose processes still run stays: they report to it
                _servers.pop(idle.pop(0))["process"].terminate()
            server = _start(env)
        _servers[key] = server
        return server


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
    return {"path": path, "process": process, "log": log, "started": weakref.WeakSet()}


def _read(log) -> str:
    if log is None:
        return "(the server's log is the pytest worker's)"
    log.seek(0)
    return log.read()[-3000:]


# Variables read only as a process runs, never as it starts: the test's name (pytest sets it for each), the folder
# tests/crash.py records samples into, torchrun's rendezvous switch (torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py reads it as it makes the store), the hosts a request goes to without a proxy (read at each
# request), and an address inductor leaves in the environment of a process that compiled, for its own compilers.
READ_AS_IT_RUNS = ("PYTEST_CURRENT_TEST", "RECORD_SAMPLES", SOCKET, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "no_proxy",
                   "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def _imported_with(env: dict) -> dict:
    """The variables a process could read as it starts: all but READ_AS_IT_RUNS."""
    return {name: value for name, value in env.items() if name not in READ_AS_IT_RUNS}


def _text(file) -> str:
    """What subprocess.run(text=True) reads: the locale's encoding, with universal newlines."""
    file.seek(0)
    return file.read().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
