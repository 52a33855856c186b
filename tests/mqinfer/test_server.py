"""The embedded server: loopback / unix socket only, a password, an append-only file, clean stop."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from mqinfer.schemas.connection import connect, redact
from mqinfer.server import EmbeddedServer
from tests import zygote


def test_tcp_server_requires_password_and_binds_loopback(tmp_path):
    with EmbeddedServer(tmp_path / "data") as server:
        assert server.url.startswith("redis://:") and "@127.0.0.1:" in server.url
        client = server.client()
        assert client.ping() is True
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        unauthenticated = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.exceptions.AuthenticationError):
            unauthenticated.ping()
        client.set("k", "v")
        pid = server.process.pid
    # Stopped: the process is gone and the append-only file was written in the data folder.
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
    assert (tmp_path / "data" / "appendonlydir").is_dir()


def test_unix_socket_server_and_restart_from_append_only_file(tmp_path):
    server = EmbeddedServer(tmp_path / "data", unix_socket=True, password="s3cret")
    server.start()
    assert server.url.startswith("unix://:s3cret@")
    client = server.client()
    assert client.config_get("port")["port"] == "0"  # no TCP listener at all
    client.xadd("mqinfer:{requests}", {"json": "{}"})
    client.close()
    server.stop()
    again = EmbeddedServer(tmp_path / "data", unix_socket=True, password="s3cret").start()
    try:
        assert again.client().xlen("mqinfer:{requests}") == 1
    finally:
        again.stop()


def test_connect_rejects_unknown_scheme_and_redacts():
    with pytest.raises(ValueError, match="unsupported Redis URL 'http://u:\\*\\*\\*@h:1'"):
        connect("http://u:pw@h:1")
    assert redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://localhost:6379") == "redis://localhost:6379"


def test_mqinfer_redis_command_prints_url_and_stops_on_sigterm(tmp_path):
    proc = zygote.popen(
        [sys.executable, "-m", "mqinfer", "redis", "--dir", str(tmp_path / "srv")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("redis://:")
        assert connect(url).ping() is True
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
