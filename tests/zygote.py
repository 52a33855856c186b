"""`python -m mqinfer ...` processes for the tests, forked from a process that has already
imported what they import.

A fresh `mqinfer worker` spends about 2.5 s of CPU on imports (torch most of it) before it does
anything, and the suite starts about 150 mqinfer processes on a 2-core machine. Instead, each
test process keeps one helper process, the zygote (tests/zygote_server.py), that imports those
modules once and forks a child per command; the child then runs as `python -m mqinfer ARGS`
would: its own pid (the test signals it, and scans /proc for its children, as before), the
standard streams, working folder, environment, umask and session the test asked for, the command
line /proc shows, and the interpreter's ending (exit code, or death by signal).

:func:`popen` and :func:`run` take the place of ``subprocess.Popen`` and ``subprocess.run``. A
command the zygote can serve gets a :class:`ForkedPopen`, a ``subprocess.Popen`` whose child
comes from the zygote and whose exit status comes over the zygote's socket; anything else (other
programs, other interpreter flags, a ``preexec_fn``, an environment whose import-time settings
differ from the zygote's) is started as a real subprocess, and so is everything when
``MQINFER_TEST_NO_ZYGOTE=1``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

# What a fork cannot change (import-time environment variables): the same rule as the warm start's.
from mqinfer.warm_start import ARGV_ROOM, import_settings

SWITCH = "MQINFER_TEST_NO_ZYGOTE"
# The socket of a zygote that serves every test process of the session (the xdist controller
# starts it: tests/conftest.py), read when this module is imported (tests that clear MQINFER_*
# variables keep it); unset, each test process starts its own at its first command.
SHARED = "MQINFER_TEST_ZYGOTE"
ROOT = Path(__file__).resolve().parent.parent
_PREFIX = [sys.executable, "-m", "mqinfer"]
_HEADER = struct.Struct("!I")

# Popen arguments a forked child honours; any other (preexec_fn, pass_fds, user, umask, ...)
# means a real subprocess.
_SUPPORTED = {"stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "encoding", "errors",
              "bufsize", "start_new_session", "process_group", "close_fds"}

# The environment the zygote starts with: this process's before any test changed it.
_BASE_ENV = dict(os.environ)


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(SWITCH, "") in ("", "0")


def popen(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, forked from the zygote where it can serve it."""
    if servable(args, kwargs):
        return ForkedPopen(args, **kwargs)
    return subprocess.Popen(args, **kwargs)


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` over :func:`popen` (the same steps: a timeout kills the process)."""
    if input is not None:
        if kwargs.get("stdin") is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        if kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output.")
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        if check and code:
            raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


def servable(args, kwargs: dict) -> bool:
    """Whether the zygote can start ``args`` with these Popen arguments as a real exec would."""
    if not enabled() or not isinstance(args, (list, tuple)) or len(args) < 3:
        return False
    if not all(isinstance(a, (str, os.PathLike)) for a in args) or [os.fspath(a) for a in args[:3]] != _PREFIX:
        return False
    if not set(kwargs) <= _SUPPORTED or not kwargs.get("close_fds", True):
        return False
    if sum(len(os.fsencode(a)) + 1 for a in args) > ARGV_ROOM:
        return False
    env = os.environ if kwargs.get("env") is None else kwargs["env"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return False
    threads = env.get("OMP_NUM_THREADS")
    if threads != _BASE_ENV.get("OMP_NUM_THREADS") and not (threads and threads.isdigit() and int(threads) > 0):
        return False
    return import_settings(env) == import_settings(_BASE_ENV)


def _umask() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


class ForkedPopen(subprocess.Popen):
    """A ``subprocess.Popen`` whose child the zygote forks (a real exec if the zygote cannot be
    had). Everything but starting and reaping the child is Popen's own: pipes, text mode,
    communicate(), signals (sent to the child's real pid)."""

    _conn: socket.socket | None = None
    _inbox = b""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        conn = _ZYGOTE.connect()
        reply = None
        if conn is not None:
            request = {
                "argv": [os.fspath(a) for a in args],
                "env": dict(os.environ if env is None else env),
                "cwd": os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd(),
                "umask": _umask() if umask < 0 else umask,
                "start_new_session": bool(start_new_session),
                "process_group": process_group,
            }
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            body = json.dumps(request).encode()
            try:
                socket.send_fds(conn, [_HEADER.pack(len(body)) + body], fds)
                self._conn = conn
                reply = self._message(None)
            except (OSError, EOFError):
                reply = None
            if reply is None:  # the zygote is gone: nothing was started
                conn.close()
                self._conn = None
                _ZYGOTE.broken("it closed the connection before starting the command")
        if reply is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                                          start_new_session, process_group)
        self.pid = reply["pid"]
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if "status" in reply:  # it ended before it could say it started
            self._finish(reply["status"])
        elif "errno" in reply:  # it could not enter its working folder, as a failed exec reports
            self.wait()
            number = reply["errno"]
            raise OSError(number, os.strerror(number), request["cwd"])

    def _message(self, timeout: float | None) -> dict | None:
        """The zygote's next message, None if none came within ``timeout``; EOFError where the
        connection ended without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._inbox:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], remaining)
            if not ready:
                return None
            data = self._conn.recv(4096)
            if not data:
                raise EOFError("the zygote closed the connection")
            self._inbox += data
        line, _, self._inbox = self._inbox.partition(b"\n")
        return json.loads(line)

    def _status(self, timeout: float | None) -> int | None:
        """The child's wait status once the zygote has reaped it; None while it runs."""
        try:
            message = self._message(timeout)
        except EOFError:
            raise ChildProcessError(f"the zygote that started pid {self.pid} ended before reporting its exit")
        return None if message is None else message["status"]

    def _finish(self, status: int) -> None:
        self._handle_exitstatus(status)
        self._conn.close()

    def _try_wait(self, wait_flags):
        if self._conn is None:
            return super()._try_wait(wait_flags)
        status = self._status(0 if wait_flags & os.WNOHANG else None)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **_):
        if self._conn is None:
            return super()._internal_poll(_deadstate=_deadstate)
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is None:
                    status = self._status(0)
                    if status is not None:
                        self._finish(status)
            except (OSError, ValueError):
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout):
        if self._conn is None:
            return super()._wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if not self._waitpid_lock.acquire(timeout=-1 if remaining is None else remaining):
                continue
            try:
                if self.returncode is None:
                    status = self._status(remaining)
                    if status is not None:
                        self._finish(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


class _Zygote:
    """This test process's zygote, started at the first command it can serve."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._folder: Path | None = None
        self._broken: str | None = None
        self._shared = os.environ.get(SHARED)

    def connect(self) -> socket.socket | None:
        """A connection to the zygote (started if need be), None where it cannot be had."""
        with self._lock:
            if self._broken:
                return None
            path = self._shared
            if not path:
                if self._proc is None:
                    self._start()
                path = str(self._folder / "socket")
        deadline = time.monotonic() + 60
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
            if self._proc is not None and self._proc.poll() is not None:
                self.broken(f"it exited with {self._proc.returncode}")
                return None
            if time.monotonic() > deadline:
                self.broken("its socket did not appear within 60 s")
                return None
            time.sleep(0.01)

    def start_shared(self) -> None:
        """Start the zygote now, for this process and the processes it starts (``SHARED``)."""
        if enabled():
            with self._lock:
                self._start()
            os.environ[SHARED] = str(self._folder / "socket")

    def _start(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="mqinfer-zygote-"))
        with open(self._folder / "log", "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from tests.zygote_server import serve; serve(sys.argv[1])",
                 str(self._folder / "socket"), "." * ARGV_ROOM],
                cwd=ROOT, env=_BASE_ENV, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        atexit.register(self.stop)

    def broken(self, why: str) -> None:
        """Start every later command for real, and say why once."""
        with self._lock:
            if self._broken:
                return
            self._broken = why
            log = ""
            if self._folder is not None and (self._folder / "log").exists():
                log = (self._folder / "log").read_text(errors="replace")[-4000:]
        warnings.warn(f"the test zygote cannot be used ({why}); starting mqinfer processes for real\n{log}",
                      RuntimeWarning, stacklevel=3)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


_ZYGOTE = _Zygote()


def start_shared() -> None:
    """Start this process's zygote now and name its socket in ``SHARED``, so that the processes
    this one starts afterwards (xdist's test processes) use it instead of starting their own."""
    _ZYGOTE.start_shared()
