"""The embedded server's data folder across crashes and restarts: one password and port per folder,
one server per folder, no server outliving its owner, and a dying server reported as a failure."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from mqinfer.schemas.connection import connect
from mqinfer.server import EmbeddedServer, ServerError, _free_port, server_binary
from tests import zygote
from tests.helpers import mqinfer_cmd, wait_until


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _server_pid(data: Path) -> int:
    return int((data / "server.pid").read_text())


class Wrappers:
    """`mqinfer redis` processes started by a test, all stopped at its end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, data: Path, *extra: str) -> subprocess.Popen:
        proc = zygote.popen(mqinfer_cmd("redis", "--dir", str(data), *extra), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def url(self, proc: subprocess.Popen, timeout: float = 30.0) -> str:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0].strip():
            proc.kill()
            raise AssertionError(f"no URL from mqinfer redis; stderr:\n{proc.stderr.read()}")
        return line[0].strip()

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def wrappers():
    w = Wrappers()
    yield w
    w.stop_all()


def _get_after_restart(client: redis.Redis, key: str):
    """GET through a client made before the restart, retrying only while it reconnects."""
    box = []

    def attempt():
        try:
            box.append(client.get(key))
            return True
        except redis.exceptions.ConnectionError:
            return False

    wait_until(attempt, timeout=20, what="the old client to reconnect")
    return box[0]


def test_restart_prints_same_url_and_old_client_works_again(tmp_path, wrappers):
    data = tmp_path / "srv"
    first = wrappers.start(data)
    url = wrappers.url(first)
    password = (data / "password").read_text().strip()
    port = int((data / "port").read_text())
    assert url == f"redis://:{password}@127.0.0.1:{port}/0"
    client = connect(url)
    client.set("k", "before")
    first.terminate()
    assert first.wait(timeout=20) == 0
    with pytest.raises(redis.exceptions.ConnectionError):
        connect(url, socket_connect_timeout=1).ping()

    second = wrappers.start(data)
    assert wrappers.url(second) == url
    assert _get_after_restart(client, "k") == b"before"  # the same password: no auth error
    client.close()


def test_password_file_is_owner_only_and_kept_off_the_command_line(tmp_path):
    old_umask = os.umask(0)  # a permissive umask must not widen the file's mode
    try:
        with EmbeddedServer(tmp_path / "data") as server:
            path = tmp_path / "data" / "password"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert path.read_text().strip() == server.password and len(server.password) >= 24
            cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
            assert server.password.encode() not in cmdline
            assert str(tmp_path / "data").encode() in cmdline
    finally:
        os.umask(old_umask)


def test_explicit_password_wins_and_is_not_stored(tmp_path):
    # Quotes, backslashes and spaces survive the trip through the server's config syntax.
    password = 'p "w\\ x'
    with EmbeddedServer(tmp_path / "data", password=password) as server:
        assert server.client().ping() is True
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="p").ping()
    assert not (tmp_path / "data" / "password").exists()


def test_unix_socket_url_is_the_same_after_restart(tmp_path):
    data = tmp_path / "d"
    with EmbeddedServer(data, unix_socket=True) as server:
        url = server.url
        server.client().set("k", "v")
        os.kill(server.process.pid, signal.SIGKILL)  # a crash leaves the socket file behind
        server.process.wait()
    socket_dir = Path(server.socket_path).parent
    assert os.path.exists(server.socket_path) and stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
    with EmbeddedServer(data, unix_socket=True) as again:
        assert again.url == url
        assert again.client().get("k") == b"v"
    with EmbeddedServer(tmp_path / "other", unix_socket=True) as other:
        assert Path(other.socket_path).parent == socket_dir and other.socket_path != server.socket_path


def test_taken_remembered_port_is_replaced_and_said(tmp_path, caplog):
    data = tmp_path / "data"
    with EmbeddedServer(data) as server:
        port = server.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with caplog.at_level(logging.WARNING, logger="mqinfer.server"):
            with EmbeddedServer(data) as moved:
                assert moved.port != port and moved.client().ping() is True
        assert f"port {port} remembered" in caplog.text and f"using port {moved.port}" in caplog.text
    assert int((data / "port").read_text()) == moved.port


def test_second_server_on_the_same_folder_is_refused(tmp_path, wrappers):
    data = tmp_path / "srv"
    owner = wrappers.start(data)
    url = wrappers.url(owner)

    second = wrappers.start(data)
    assert second.wait(timeout=30) == 1
    err = second.stderr.read()
    assert err.count("\n") == 1 and err.startswith("mqinfer redis: error: ")
    assert f"data folder {data} is in use" in err and f"owner pid {owner.pid}" in err
    assert second.stdout.read() == ""
    assert connect(url).ping() is True  # the owner was left alone

    with pytest.raises(ServerError, match=f"owner pid {owner.pid}"):
        EmbeddedServer(data).start()
    owner.terminate()
    assert owner.wait(timeout=20) == 0
    with EmbeddedServer(data) as server:  # free again once its owner stopped
        assert server.url == url


def test_kill_9_of_the_wrapper_stops_the_server_and_a_restart_serves_its_data(tmp_path, wrappers):
    data = tmp_path / "srv"
    first = wrappers.start(data)
    url = wrappers.url(first)
    connect(url).xadd("mqinfer:{requests}", {"json": "{}"})
    server_pid = _server_pid(data)
    assert _running(server_pid)

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    try:
        wait_until(lambda: not _running(server_pid), timeout=5, what="the server to stop with its owner")
    except AssertionError:
        os.kill(server_pid, signal.SIGKILL)  # leave no orphan behind when this fails
        raise

    second = wrappers.start(data)
    assert wrappers.url(second) == url
    assert _server_pid(data) != server_pid
    assert connect(url).xlen("mqinfer:{requests}") == 1


def test_server_dying_on_its_own_makes_the_wrapper_fail(tmp_path, wrappers):
    data = tmp_path / "srv"
    proc = wrappers.start(data)
    wrappers.url(proc)
    os.kill(_server_pid(data), signal.SIGKILL)
    assert proc.wait(timeout=10) == 1
    err = proc.stderr.read().strip().splitlines()
    assert len(err) == 2, err  # the "running" line, then one error line
    assert err[1].startswith("mqinfer redis: error: embedded server exited on its own (killed by signal SIGKILL)")
    assert f"last lines of {data / 'server.log'}: " in err[1] and "Ready to accept connections" in err[1]


def _start_leftover(data: Path, password: str, *extra: str) -> subprocess.Popen:
    """A server on ``data`` as an owner killed before it had the death signal would leave it."""
    data.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    (data / "port").write_text(f"{port}\n")  # as if its owner had picked it: the next owner wants it
    proc = subprocess.Popen(
        [str(server_binary()), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
         "--pidfile", str(data / "server.pid"), "--requirepass", password, "--appendonly", "yes",
         "--logfile", str(data / "leftover.log"), *extra],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    client = redis.Redis(host="127.0.0.1", port=port, password=password)

    def ready():
        try:
            return client.ping() and (data / "server.pid").exists()
        except redis.exceptions.ConnectionError:
            return False

    wait_until(ready, timeout=15, what="the left-over server")
    client.set("left", "over")
    return proc


@pytest.mark.parametrize("title", ["cmdline", "retitled"])
def test_leftover_server_on_the_folder_is_stopped_and_replaced(tmp_path, caplog, title):
    data = tmp_path / "data"
    # Ours keep their command line; a server that retitled itself is known by its working folder.
    extra = ("--set-proc-title", "no") if title == "cmdline" else ()
    leftover = _start_leftover(data, "old-password", *extra)
    try:
        with caplog.at_level(logging.WARNING, logger="mqinfer.server"):
            with EmbeddedServer(data) as server:
                assert leftover.wait(timeout=1) == 0  # it got SIGTERM, saved its file and exited
                assert _server_pid(data) == server.process.pid != leftover.pid
                assert server.port == int((data / "port").read_text())  # the port it freed
                assert server.client().get("left") == b"over"
        assert f"a server (pid {leftover.pid}) left over" in caplog.text
    finally:
        leftover.kill()
        leftover.wait()


def test_unrelated_pids_in_the_pid_file_are_left_alone(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    other = _start_leftover(tmp_path / "other", "pw")  # a server, but on another folder
    try:
        for pid in (sleeper.pid, other.pid):
            (data / "server.pid").write_text(f"{pid}\n")
            with EmbeddedServer(data) as server:
                assert server.client().ping() is True
            assert sleeper.poll() is None and other.poll() is None
    finally:
        for p in (sleeper, other):
            p.kill()
            p.wait()


def test_one_server_per_folder_within_a_process_too(tmp_path):
    data = tmp_path / "data"
    first = EmbeddedServer(data).start()
    try:
        with pytest.raises(ServerError, match=f"owner pid {os.getpid()}"):
            EmbeddedServer(data).start()
        # A server that died without being stopped holds its folder no longer.
        first.process.kill()
        first.process.wait()
        with EmbeddedServer(data) as second:
            assert second.url == first.url and second.client().ping() is True
            with pytest.raises(ServerError, match="in use"):
                EmbeddedServer(data).start()
    finally:
        first.stop()
