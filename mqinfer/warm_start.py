"""Worker processes forked from a template that has imported the engine once.

A worker spends about 2 s of CPU importing PyTorch and the engine before it does anything. `mqinfer
run` and `mqinfer bench` start several workers, and start a worker again when one dies; instead of
an interpreter each, they start one template process (:mod:`mqinfer.warm_template`) that imports
those modules once, and ask it to fork each worker. A forked worker is ready in the time it takes to
load its model, and the pages of the imported modules are shared between the workers until written.

What a worker sees is what `python -P -m mqinfer worker ...` started by its parent would see: its
own pid, the standard streams, extra file descriptors, working folder, environment and session its
parent asked for, its command line in /proc (what `ps` and the run lock's check of a stale pid read),
and a status its parent reads as a ``subprocess.Popen``'s. Two things differ: its parent process is
the template, and it gets SIGTERM when the template dies (the template dies with its owner), as a
cold worker does when its parent dies.

The other ranks of a tensor- or pipeline-parallel worker (``ENTRY_POINTS``) are forked the same way
where the worker can reach a shared template (below); they get SIGKILL instead, as cold ones do.

Linux only (``PR_SET_PDEATHSIG``, /proc); elsewhere, or when the template cannot start, or for a
command whose import-time environment differs from the template's, :meth:`WarmStarter.popen`
starts the command cold, as ``subprocess.Popen``. ``MQINFER_WARM_START=0`` turns it off.

``MQINFER_WARM_TEMPLATE=PATH`` names the Unix socket of a template that serves several owners
(``python -m mqinfer.warm_template --listen PATH``), so that runs started one after
another on a machine do not each import the engine: the test suite starts one for its whole session.
A worker forked there gets SIGTERM (a rank SIGKILL) when its owner's connection ends, the owner
killed included.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from mqinfer.procs import OPENMP_SPIN_COUNT, mqinfer_command, process_gone, with_death_signal

log = logging.getLogger(__name__)

SWITCH = "MQINFER_WARM_START"
SHARED = "MQINFER_WARM_TEMPLATE"
# Bytes of command line the template is started with beyond its own, so that a worker can write
# its own command line over them (/proc/PID/cmdline cannot grow after exec).
ARGV_ROOM = 16384

# Environment variables that the interpreter, the C library or a module the template has loaded
# (torch with its OpenMP and BLAS, numpy, pyarrow) read when they start or load, which a fork
# cannot read again: a command that asks for values other than the template's is started cold.
# Modules not loaded there read theirs in the child: triton, and torch's compiler (dynamo and
# inductor).
_IMPORT_TIME = re.compile(r"(PYTHON|OMP_|GOMP_|KMP_|MKL_|OPENBLAS_|ARROW_|PYTORCH_|CUDA_|NUMPY_|LD_|MALLOC_|LC_).*"
                          r"|TORCH(?!INDUCTOR_|DYNAMO_).*|LANG|LANGUAGE|TZ|TMPDIR|TEMP|TMP|HOME")


def import_settings(env) -> dict[str, str]:
    """The import-time part of ``env`` as `mqinfer` sees it. OMP_NUM_THREADS is not part of it where
    it is a count: the forked child sets PyTorch's thread count from it instead, as OpenMP would
    have at start."""
    settings = {k: v for k, v in env.items() if _IMPORT_TIME.fullmatch(k)}
    if settings.get("OMP_NUM_THREADS", "").isdigit() and int(settings["OMP_NUM_THREADS"]) > 0:
        del settings["OMP_NUM_THREADS"]
    if "GOMP_SPINCOUNT" not in settings and "OMP_WAIT_POLICY" not in settings:
        settings["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT  # what `mqinfer`'s main sets before torch loads
    return settings


# Entry points other than `mqinfer` itself that a template can fork: ``python -P -m MODULE ARGS`` runs
# ``FUNCTION(ARGS)`` of the module named here (a tensor- or pipeline-parallel worker's other ranks).
ENTRY_POINTS = {"mqinfer.workers.engine.tp_rank": ("mqinfer.workers.engine.ranks", "follower_main")}


def entry_point(args: list[str]) -> str | None:
    """The module ``args`` runs with this interpreter (``mqinfer`` or one of ``ENTRY_POINTS``), or
    None where a template cannot fork it."""
    prefix = mqinfer_command()[:-1]
    if len(args) >= len(prefix) + 1 and list(args[:len(prefix)]) == prefix:
        module = args[len(prefix)]
        if module == "mqinfer" or module in ENTRY_POINTS:
            return module
    return None


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(SWITCH, "1") not in ("0", "false", "no", "off")


class WarmProcess:
    """A forked worker, with the parts of ``subprocess.Popen`` its owner uses: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``. Its status comes
    from the template over a socket of its own, once the template has reaped it."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._inbox = b""
        self._lock = threading.Lock()

    def _read_status(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._inbox:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], remaining)
            if not ready:
                return
            data = self._conn.recv(4096)
            if not data:
                # The template died before reaping it, and the worker got SIGTERM (PDEATHSIG): its
                # status is its new parent's to read; it counts as ended by SIGTERM once gone.
                if process_gone(self.pid):
                    self._finish(-signal.SIGTERM)
                else:
                    time.sleep(min(0.05, remaining) if remaining is not None else 0.05)
                return
            self._inbox += data
        line, _, self._inbox = self._inbox.partition(b"\n")
        self._finish(os.waitstatus_to_exitcode(json.loads(line)["status"]))

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.close()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.returncode is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                    self._read_status(None if remaining is None else min(remaining, 0.5))
                if self.returncode is not None:
                    return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """Starts `mqinfer` commands (workers) forked from one template process, started at the first
    command. Close it when done: the template exits, and workers still running get SIGTERM."""

    def __init__(self, *, warm: bool | None = None, shared: bool = True, tiny: bool = False) -> None:
        """``warm``: fork (where it can) or start every command cold; None: as MQINFER_WARM_START
        says. ``shared``: use the template MQINFER_WARM_TEMPLATE names, if any. ``tiny``: the
        workers load the built-in tiny model (a template of this starter's own makes its weights
        once for all of them)."""
        self._tiny = tiny
        self._template: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._template_pid: int | None = None
        self._broken = not (enabled() if warm is None else warm and sys.platform.startswith("linux"))
        self._shared = os.environ.get(SHARED) if shared else None

    @property
    def template_pid(self) -> int | None:
        return self._template_pid

    def _start_template(self) -> None:
        shared = self._shared
        if shared:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(shared)
                pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
                self._conn, self._template_pid = conn, pid
                return
            except OSError as exc:
                conn.close()
                log.warning("%s=%s cannot be used (%s): starting a template of this run's own", SHARED, shared, exc)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv, preexec = with_death_signal(
            [*mqinfer_command()[:-1], "mqinfer.warm_template", *(["--tiny"] if self._tiny else []),
             str(theirs.fileno()), "." * ARGV_ROOM], signal.SIGKILL)
        self._template = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                          preexec_fn=preexec)
        theirs.close()
        self._conn, self._template_pid = mine, self._template.pid

    def prepare(self) -> "WarmStarter":
        """Start the template now, so that it imports while this process does other work."""
        if not self._broken and self._conn is None:
            self._start_template()
        return self

    def popen(self, args: list[str], *, env: dict[str, str] | None = None, stdin=None, stdout=None, stderr=None,
              pass_fds: tuple[int, ...] = (), start_new_session: bool = False, cwd: str | None = None,
              death_signal: int = signal.SIGTERM):
        """``subprocess.Popen(args, ...)`` for an `mqinfer` command (``mqinfer_command(...)``) or an
        entry point of ``ENTRY_POINTS``, forked from the template where it can be; ``stdin``,
        ``stdout``, ``stderr``: None (this process's), ``subprocess.DEVNULL``, a file descriptor or
        a file object, and ``subprocess.STDOUT`` for ``stderr`` (``subprocess.PIPE`` starts the
        command cold: pass the ends of an ``os.pipe()`` instead). ``death_signal``: what the command
        gets when this process (its owner) or the template dies."""
        env = dict(os.environ if env is None else env)
        if not self._broken and entry_point(args) and subprocess.PIPE not in (stdin, stdout, stderr):
            if self._conn is None:
                self._start_template()
            try:
                forked = self._fork(list(args), env, (stdin, stdout, stderr), pass_fds, start_new_session, cwd,
                                    death_signal)
                if forked is not None:
                    return forked
            except (OSError, EOFError, ValueError) as exc:
                self._give_up(exc)
        argv, preexec = with_death_signal(list(args), death_signal)
        return subprocess.Popen(argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
                                start_new_session=start_new_session, cwd=cwd, preexec_fn=preexec)

    def _fork(self, args, env, streams, pass_fds, start_new_session, cwd, death_signal) -> WarmProcess | None:
        opened: list[int] = []
        fds = []
        for i, stream in enumerate(streams):
            if stream is None:
                fds.append(i)
            elif stream == subprocess.STDOUT and i == 2:
                fds.append(fds[1])
            elif stream == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
                fds.append(fd)
            elif isinstance(stream, int):
                fds.append(stream)
            else:
                fds.append(stream.fileno())
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {"argv": args, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                   "session": bool(start_new_session), "extra_fds": len(pass_fds), "death_signal": int(death_signal)}
        try:
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"],
                            [theirs.fileno(), *fds, *pass_fds])
        finally:
            theirs.close()
            for fd in opened:
                os.close(fd)
        # No time limit: the first command waits for the template's imports, as a cold start would
        # wait for its own.
        first = b""
        while not first.endswith(b"\n"):
            data = mine.recv(4096)
            if not data:
                mine.close()
                raise EOFError("the worker template closed the connection before starting the command")
            first += data
        reply = json.loads(first)
        if "cold" in reply:  # the template cannot start this one as it would start: cold, then
            mine.close()
            return None
        return WarmProcess(args, reply["pid"], mine)

    def _give_up(self, exc: BaseException) -> None:
        self._broken = True
        log.warning("warm start off: the worker template failed (%s); workers start cold", exc)

    def close(self) -> None:
        """Let the template go (a shared one stays); workers still running get SIGTERM."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._template_pid = None
        if self._template is not None:
            try:
                self._template.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._template.kill()
                self._template.wait()
            self._template = None  # a later command starts a new one
