"""The zygote's side of tests/zygote.py: a process that imports what `mqinfer` commands import,
once, and forks a child per command that then runs as `python -m mqinfer ARGS` would.

It listens on a Unix socket. Each connection asks for one command: a length-prefixed JSON request
(argv, environment, working folder, umask, session) with the child's stdin, stdout and stderr
passed as file descriptors (SCM_RIGHTS). The child reports ``{"pid": ...}`` (or the error that
kept it from starting) on that connection; once the zygote has reaped it, it sends
``{"pid": ..., "status": <wait status>}`` and closes the connection.

The zygote itself starts no thread and runs torch on one thread only (the tiny model's weights),
so that forking it is safe. It exits when the test process that started it is gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
import weakref

from mqinfer.procs import freeze_heap
from mqinfer.warm_template import exit_code, finish, prebuild, reaped, report, retitle

# What a worker, `mqinfer run` and the other commands the tests start import before they do
# anything (the command line imports the bench and plan options for any command; compact and
# report read Parquet datasets): loaded once here instead of in every child.
PRELOAD = (
    "mqinfer.cli",
    "mqinfer.run",
    "mqinfer.jobs_cli",
    "mqinfer.loadgen.bench_options",
    "mqinfer.loadgen.plan.options",
    "mqinfer.workers.queue.worker",
    "mqinfer.workers.engine.core",
    "mqinfer.ops.compact",
    "mqinfer.ops.metrics",
    "pyarrow.dataset",
)

_HEADER = struct.Struct("!I")



def serve(path: str) -> None:
    """Import, then serve fork requests on the Unix socket ``path`` until the parent is gone."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # Clients may connect from now on; they wait until the imports are done.
    from mqinfer.procs import short_openmp_spin

    short_openmp_spin()  # what `mqinfer`'s main does before anything imports torch
    for name in PRELOAD:
        __import__(name)
    # As the warm template does: the command line's parser, and the built-in tiny model's weights
    # (most commands the tests start load it), made here once.
    prebuild(tiny=True)
    # As the warm template does: the children's collections leave the shared pages alone.
    freeze_heap()
    import_env = dict(os.environ)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, socket.socket] = {}
    own = [listener]
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
            if wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            _reap(children)
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    _fork(conn, children, own, (wake_r, wake_w), import_env)
                except Exception:  # noqa: BLE001 - one bad request must not end the zygote
                    traceback.print_exc()
                    conn.close()
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _reap(children: dict[int, socket.socket]) -> None:
    for pid, status in reaped():
        conn = children.pop(pid, None)
        if conn is not None:
            report(conn, {"pid": pid, "status": status})


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(60)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        if len(fds) != 3:
            raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
        while len(data) < _HEADER.size:
            data += _more(conn)
        (size,) = _HEADER.unpack_from(data)
        body = bytearray(data[_HEADER.size:])
        while len(body) < size:
            body += _more(conn)
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _more(conn: socket.socket) -> bytes:
    data = conn.recv(1 << 16)
    if not data:
        raise EOFError("request cut short")
    return data


def _fork(conn, children, own, wake_fds, import_env) -> None:
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError, EOFError):
        conn.close()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            for sock in [*own, *children.values()]:
                sock.close()
            for fd in wake_fds:
                os.close(fd)
            code = _child(request, fds, conn, import_env)
        except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
            try:
                traceback.print_exc()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    children[pid] = conn


def _child(request: dict, fds: list[int], conn: socket.socket, import_env: dict) -> int:
    """Become ``python -m mqinfer ARGS`` in a fresh process's state, run it, and return its exit
    code; a death by signal (an uncaught KeyboardInterrupt) does not return."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _drop_inherited_finalizers()
    try:
        if request["start_new_session"]:
            os.setsid()
        if request["process_group"] >= 0:
            os.setpgid(0, request["process_group"])
        os.umask(request["umask"])
        os.chdir(request["cwd"])
    except OSError as exc:
        conn.sendall(json.dumps({"pid": os.getpid(), "errno": exc.errno}).encode() + b"\n")
        return 255
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if not sys.stdout.write_through:  # as `python -u` leaves it
        sys.stdout.reconfigure(line_buffering=os.isatty(1))

    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        from mqinfer.procs import OPENMP_SPIN_COUNT

        # What `mqinfer`'s main sets before torch loads (there, for the processes it starts).
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    argv = request["argv"]
    retitle(argv)  # its command line, as an exec would have set it (room was made at start)
    threads = env.get("OMP_NUM_THREADS")
    if threads != import_env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))  # what OpenMP would have read from it at startup
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh process seeds numpy's global generator itself
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    conn.close()
    return _run_as_main(argv)


def _drop_inherited_finalizers() -> None:
    """The finalizers of the zygote's objects do not run at the child's exit.

    After the zygote's imports, every one of them is a ``torch.library.Library``'s: at exit it
    unregisters its operators from the dispatcher of a process that is about to end: 134 of them,
    about 38 ms of the child's CPU and 7,000 page faults (copies of pages it shares with the
    zygote) at every exit. The child's own finalizers run as in any process. (CPython keeps no
    public list of live finalizers; the registry is read where it has been since Python 3.4, and
    nothing is dropped without it.)"""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        finalizer.atexit = False


def _run_as_main(argv: list[str]) -> int:
    """Run `mqinfer.__main__` as ``python -m mqinfer`` does, then end as the interpreter does:
    the exit code of SystemExit (its message printed when it is not a number), 1 and a traceback
    for an uncaught exception, non-daemon threads joined and atexit handlers run before exiting,
    and death by SIGINT after an uncaught KeyboardInterrupt."""
    import runpy
    import types

    sys.modules["__main__"] = types.ModuleType("__main__")
    sys.orig_argv = list(argv)
    sys.argv = ["-m", *argv[3:]]
    sys.path[0] = os.getcwd()
    interrupted = False
    code = 0
    try:
        runpy._run_module_as_main("mqinfer", alter_argv=True)
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # noqa: BLE001 - the interpreter prints any uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    code = finish(code)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    return code & 0xFF
