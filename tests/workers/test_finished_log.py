"""The worker's "finished" log lines count durable rows only: a worker killed (-9) while finished
rows wait in its buffer has logged exactly the rows that are on disk."""

from __future__ import annotations

import os
import signal
import subprocess

from mqinfer.client import Client, Delta, Final
from tests import zygote
from tests.helpers import mqinfer_cmd, rows

STREAM = "finished-log"


def _finished_lines(log_path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if " mqinfer.worker: finished {" in line]


def _tokens_seen(client: Client, request_id: str, want: int) -> None:
    """Read the request's deltas until ``want`` tokens came (no final: its row is not durable)."""
    seen = 0
    for event in client.stream(request_id, timeout=120):
        assert not isinstance(event, Final), f"{request_id} already has a durable row"
        if isinstance(event, Delta):
            seen += len(event.token_ids)
        if seen >= want:
            return


def test_finished_lines_equal_rows_on_disk_at_a_kill(redis_url, tmp_path):
    out, log_path = tmp_path / "out", tmp_path / "worker.log"
    env = dict(os.environ, MQINFER_LOG_LEVEL="info", OMP_NUM_THREADS="1")
    # Rows are flushed when the engine goes idle, or after a minute, or 100,000 rows.
    with open(log_path, "w") as log_file:
        worker = zygote.popen(
            mqinfer_cmd("worker", "--redis", redis_url, "--out", str(out), "--stream", STREAM,
                    "--flush-interval-s", "60", "--flush-rows", "100000", "--max-wait-ms", "0"),
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        with Client(redis_url, stream=STREAM) as client:
            # Four short requests: the engine goes idle after them, so their rows are flushed.
            client.submit_many([{"id": f"a{i}", "prompt": "a", "max_tokens": 3, "ignore_eos": True}
                                for i in range(4)])
            for i in range(4):
                assert client.result(f"a{i}", timeout=120).finish_reason == "length"
            # A long request, then five short ones that finish while it still runs: their rows wait
            # in the buffer, unwritten.
            client.submit({"id": "long", "prompt": "b", "max_tokens": 1900, "ignore_eos": True})
            _tokens_seen(client, "long", 1)
            client.submit_many([{"id": f"b{i}", "prompt": "b", "max_tokens": 3, "ignore_eos": True}
                                for i in range(5)])
            for i in range(5):
                _tokens_seen(client, f"b{i}", 3)
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    on_disk = sorted(r["id"] for r in rows(out / "results"))
    logged = _finished_lines(log_path)
    assert on_disk == ["a0", "a1", "a2", "a3"]
    assert len(logged) == len(on_disk) == 4, log_path.read_text()[-3000:]
    assert all('"finish_reason": "length"' in line for line in logged)
