"""The template process of :mod:`mqinfer.warm_start`: imports the worker once, then forks a worker
per request.

``python -P -m mqinfer.warm_template FD PADDING``: FD is a Unix socket to the owner (`mqinfer run`,
`mqinfer bench`). Each request on it is a JSON line (argv, environment, working folder, session)
with file descriptors (SCM_RIGHTS): a socket for this command's replies, its stdin, stdout and
stderr, then the descriptors it is to keep (the run lock's, say). The reply socket gets
``{"pid": N}`` once the child is forked, then ``{"status": S}`` (a wait status) once it has been
reaped. The template exits when the owner closes its socket or dies.

The template starts no thread and runs no PyTorch operation on more than one thread before it
forks, so each child starts from a quiet copy: it sets up OpenMP's threads itself, at its first
parallel operation.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import random
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from mqinfer.procs import die_with_parent, freeze_heap, set_owner, short_openmp_spin
from mqinfer.warm_start import ARGV_ROOM, ENTRY_POINTS, entry_point, import_settings

# What a worker imports before it reads its first request.
PRELOAD = ("mqinfer.cli", "mqinfer.workers.queue.worker", "mqinfer.workers.engine.core", "mqinfer.ops.metrics")
# What every worker builds first from those modules, built here once (no thread, no PyTorch
# operation): the command line's parser, with the modules it imports as it is built.
PREBUILD = ("mqinfer.cli.command_parser",)
# With --tiny: the built-in tiny model's weights, made once (on one thread) for every worker.
TINY_WEIGHTS = "mqinfer.workers.engine.loader.make_tiny_weights"


def prebuild(tiny: bool) -> None:
    """Build PREBUILD's objects, and with ``tiny`` the tiny model's weights, before any fork."""
    for name in [*PREBUILD, *([TINY_WEIGHTS] if tiny else [])]:
        module, _, function = name.rpartition(".")
        getattr(importlib.import_module(module), function)()


def main(argv: list[str]) -> int:
    """``FD PADDING``: serve the one owner on socket FD, and exit when it is gone. ``--listen PATH
    PADDING``: serve every process that connects to the Unix socket PATH, until this process's
    parent is gone. Either way, the workers of an owner whose connection ends (it exited or was
    killed) get their death signal (SIGTERM, a rank SIGKILL), as a cold one does when its parent
    dies. ``--tiny`` first: the workers will load the built-in tiny model, whose weights are made
    here once for all of them."""
    listener = None
    owners: dict[int, _Owner] = {}
    tiny = argv[:1] == ["--tiny"]
    if tiny:
        argv = argv[1:]
    if len(argv) < 3 and argv[:1] == ["--listen"]:  # started by hand: again, with room for the workers' command lines
        os.execv(sys.executable, [sys.executable, "-P", "-m", "mqinfer.warm_template", *(["--tiny"] if tiny else []),
                                  *argv, "." * ARGV_ROOM])
    if argv[0] == "--listen":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(argv[1])
        listener.listen(64)
    else:
        conn = socket.socket(fileno=int(argv[0]))
        owners[conn.fileno()] = _Owner(conn)
    parent = os.getppid()
    retitle(["mqinfer", "warm-template"])
    short_openmp_spin()  # what `mqinfer`'s main does before torch loads
    for name in PRELOAD:
        importlib.import_module(name)
    prebuild(tiny)
    # What the imports made, out of the collector's reach before any fork: a child's collections
    # (a worker's first, at the end of its start-up) walk only the objects it made itself, and
    # write nothing into the pages it shares with this process.
    freeze_heap()
    import_env = import_settings(os.environ)
    # CUDA cannot be used in a child forked after the parent initialized it: should an import ever
    # do so, every command starts cold.
    forkable = not sys.modules["torch"].cuda.is_initialized()
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    replies: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            ready = _select([*owners, wake_r, *([listener.fileno()] if listener else [])])
            if wake_r in ready:
                _drain(wake_r)
            _reap(replies, owners)
            if listener is not None and listener.fileno() in ready:
                conn, _ = listener.accept()
                owners[conn.fileno()] = _Owner(conn)
            for fd in [fd for fd in ready if fd in owners]:
                owner = owners[fd]
                requests = owner.receive()
                if requests is None:  # the owner is gone: so are its workers
                    owner.stop_children()
                    owner.conn.close()
                    del owners[fd]
                    if listener is None:
                        return 0
                    continue
                for request, fds in requests:
                    own = [*owners, wake_r, wake_w, *([listener.fileno()] if listener else []),
                           *(r.fileno() for r in replies.values())]
                    pid = _fork(dict(request, owner=owner.pid), fds, import_env if forkable else None, own)
                    if pid is not None:
                        replies[pid] = socket.socket(fileno=fds[0])
                        owner.children[pid] = request.get("death_signal", signal.SIGTERM)
        return 0
    finally:
        for reply in replies.values():
            reply.close()


class _Owner:
    """One connected owner: its requests as they arrive, and the workers forked for it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        self.children: dict[int, int] = {}  # pid: the signal it gets when this owner is gone
        self._buffer = b""

    def receive(self) -> list[tuple[dict, list[int]]] | None:
        """The requests in what has arrived (one message each, with its descriptors); None once the
        connection has ended."""
        try:
            data, fds, _, _ = socket.recv_fds(self.conn, 1 << 20, 64)
        except OSError:
            return None
        if not data:
            return None
        self._buffer += data
        line, sep, self._buffer = self._buffer.partition(b"\n")
        if not sep:  # a request comes in one message; anything else is a broken owner
            for fd in fds:
                os.close(fd)
            return None
        return [(json.loads(line), fds)]

    def stop_children(self) -> None:
        for pid, sig in self.children.items():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _select(fds: list[int]) -> list[int]:
    import select

    while True:
        try:
            return select.select(fds, [], [], 1.0)[0]
        except InterruptedError:
            continue


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _reap(replies: dict[int, socket.socket], owners: dict[int, _Owner]) -> None:
    for pid, status in reaped():
        for owner in owners.values():
            owner.children.pop(pid, None)
        reply = replies.pop(pid, None)
        if reply is not None:
            report(reply, {"status": status})


def reaped() -> Iterator[tuple[int, int]]:
    """Each child that has exited and is not yet reaped, as (pid, wait status); never blocks."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def report(reply: socket.socket, message: dict) -> None:
    """Send a child's last message (a JSON line) on its reply socket, and close it."""
    try:
        reply.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the one who asked is gone; nobody to tell
    reply.close()


def _fork(request: dict, fds: list[int], import_env: dict[str, str] | None, own: list[int]) -> int | None:
    """Fork the child for ``request``; its pid (told on the reply socket, ``fds[0]``), or None where
    it is to start cold: its import-time environment differs from this process's (``import_env``;
    None: no command can be forked here)."""
    reply = socket.socket(fileno=os.dup(fds[0]))
    if import_env is None or import_settings(request["env"]) != import_env or not entry_point(request["argv"]):
        try:
            reply.sendall(json.dumps({"cold": "not forked here (import-time environment, CUDA or command)"}).encode()
                          + b"\n")
        except OSError:
            pass
        reply.close()
        for fd in fds:
            os.close(fd)
        return None
    streams, extra = fds[1:4], fds[4:]
    sys.stdout.flush()
    sys.stderr.flush()
    # Made here: it checks the child's parent against this pid.
    orphaned = die_with_parent(request.get("death_signal", signal.SIGTERM))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(request, reply, streams, extra, [*own, fds[0]], orphaned)
        except BaseException:  # noqa: BLE001 - a child must never return into the template's loop
            try:
                traceback.print_exc()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)
    for fd in fds[1:]:
        os.close(fd)
    try:
        reply.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:
        pass
    reply.close()
    return pid


def _child(request: dict, reply: socket.socket, streams: list[int], extra: list[int], inherited: list[int],
           orphaned) -> int:
    """Become `mqinfer ARGS` as a fresh process started with these streams would be, run it, and
    return its exit code (a death by signal does not return)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    reply.close()
    for fd in inherited:
        os.close(fd)
    if orphaned is not None:
        orphaned()  # its death signal when the template dies, as a cold one gets when its parent does
    set_owner(request["owner"])  # the process it works for, which it outlives only a moment
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    keep = []
    for fd in extra:  # kept, inheritable, at numbers of their own
        os.set_inheritable(fd, True)
        keep.append(fd)
    for fd in set(streams) - {0, 1, 2} - set(keep):
        os.close(fd)
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads != os.environ.get("OMP_NUM_THREADS"):
        import torch

        # What OpenMP reads from it when it loads, which happened here before the fork.
        torch.set_num_threads(int(threads) if threads else os.cpu_count() or 1)
    os.environ.clear()
    os.environ.update(request["env"])
    # A fresh interpreter seeds its generators itself; a fork would share the template's state.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    retitle(argv)
    atexit._clear()
    module, args = argv[3], argv[4:]
    sys.argv = [module, *args]
    code = 0
    try:
        if module == "mqinfer":
            from mqinfer.cli import main
        else:  # the module's function that `python -m MODULE` runs
            where, name = ENTRY_POINTS[module]
            main = getattr(importlib.import_module(where), name)
        code = main(args)
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    return finish(code or 0)


def exit_code(value) -> int:
    """The exit code of ``SystemExit(value)``, as the interpreter makes it: None is 0, a number is
    itself, anything else is printed on stderr and gives 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    try:
        print(value, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def finish(code: int = 0) -> int:
    """What the interpreter does on its way out: join non-daemon threads, run atexit, flush."""
    import threading

    try:
        threading._shutdown()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the interpreter turns a failed final flush into 120
            code = code or 120
    return code & 0xFF


def retitle(argv: list[str]) -> None:
    """Write ``argv`` over this process's command line as /proc/PID/cmdline shows it (what `ps`
    and the run lock's check of a stale pid read). The process was started with room to spare
    (ARGV_ROOM); the rest of the area is zeroed. Also names the thread (``comm``) after the
    `mqinfer` command in ``argv``."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end (fields 48 and 49)
    data = b"".join(os.fsencode(a) + b"\0" for a in argv)
    if len(data) > end - start:
        data = data[:end - start - 1] + b"\0"
    ctypes.memmove(start, data + bytes(end - start - len(data)), end - start)
    libc = ctypes.CDLL(None, use_errno=True)
    words = argv[argv.index("mqinfer") + 1:] if "mqinfer" in argv else []
    name = ("mqinfer " + (words[0] if words else ""))[:15]
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
