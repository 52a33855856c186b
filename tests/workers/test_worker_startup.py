"""A worker that cannot reach or log in to Redis stops with one clear line and no traceback: at
once for wrong or missing credentials, after its wait for a server that never answers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

from tests import zygote
from tests.helpers import mqinfer_cmd

PASSWORD_IN_TEST = "not-the-password-123"


def _run(argv: list[str], tmp_path, timeout: float = 120.0) -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_LOG_LEVEL="info")
    started = time.monotonic()
    proc = zygote.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                      timeout=timeout, cwd=tmp_path)
    return proc.returncode, proc.stderr, time.monotonic() - started


def _worker_argv(url: str, tmp_path) -> list[str]:
    return mqinfer_cmd("worker", "--redis", url, "--out", str(tmp_path / "out"))


def test_wrong_password_exits_at_once_with_one_line(redis_server, tmp_path):
    url = redis_server.url.replace(redis_server.password, PASSWORD_IN_TEST)
    assert url != redis_server.url
    code, err, elapsed = _run(_worker_argv(url, tmp_path), tmp_path)
    shown = f"redis://:***@127.0.0.1:{redis_server.port}/0"
    assert code != 0
    assert err.splitlines() == [
        f"mqinfer worker: error: cannot authenticate to {shown}: invalid username-password pair or user is disabled."
    ], err
    assert PASSWORD_IN_TEST not in err and "Traceback" not in err
    # Python and torch imports take most of it; nothing was retried.
    assert elapsed < 30


def test_missing_password_exits_at_once_with_one_line(redis_server, tmp_path):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    code, err, _ = _run(_worker_argv(url, tmp_path), tmp_path)
    assert code != 0
    assert err.splitlines() == [f"mqinfer worker: error: cannot authenticate to {url}: Authentication required."], err


def test_a_server_that_never_answers_ends_the_wait_with_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"redis://:{PASSWORD_IN_TEST}@127.0.0.1:{port}/0"
    # The start-up wait shortened from a minute to a second.
    code, err, elapsed = _run([*_worker_argv(url, tmp_path), "--redis-wait-s", "1"], tmp_path)
    assert code != 0
    assert "Traceback" not in err and PASSWORD_IN_TEST not in err
    lines = err.splitlines()
    shown = f"redis://:***@127.0.0.1:{port}/0"
    assert re.fullmatch(rf"mqinfer worker: error: cannot connect to {re.escape(shown)} \(tried for 1s\): "
                        r".*[Cc]onnect.*", lines[-1]), err
    # Before it: only the waiting notices.
    assert lines[:-1] and all("waiting for redis at " + shown in line for line in lines[:-1]), err
    assert elapsed < 60
    code, err, _ = _run([*_worker_argv(url, tmp_path), "--redis-wait-s", "0"], tmp_path)
    assert code == 2 and "--redis-wait-s must be a number of seconds > 0, got 0" in err
