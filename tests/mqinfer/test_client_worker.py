"""The client against a real server and a real worker process: results, error rows, cancel (running,
queued, and a later request with the same id), the asyncio client, timeouts."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request

import pytest

from mqinfer.schemas import keys
from mqinfer.client import AsyncClient, Client, Delta, Final
from tests.helpers import start_worker, wait_exit, wait_until


STREAM = "client-e2e"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = _free_port()


@pytest.fixture(scope="module")
def served(redis_server, tmp_path_factory):
    """One worker for the module, on its own stream; at most two requests run at once; the
    batcher's wait is adaptive."""
    out = tmp_path_factory.mktemp("client-e2e")
    worker = start_worker(redis_server.url, out, "--stream", STREAM, "--max-num-seqs", "2",
                          "--flush-interval-s", "0.05", "--max-wait-ms", "auto",
                          "--metrics-port", str(METRICS_PORT))
    yield redis_server.url
    worker.terminate()
    code, err = wait_exit(worker, timeout=60)
    assert code == 0, err


def _client(url: str, **kwargs) -> Client:
    return Client(url, stream=STREAM, **kwargs)


def test_results_and_error_rows_come_back(served):
    with _client(served) as client:
        client.submit_many([{"id": f"ok{i}", "prompt": f"p{i}", "max_tokens": 5 + i, "temperature": 0,
                             "ignore_eos": True} for i in range(3)]
                           + [{"id": "long-prompt", "prompt_token_ids": [65] * 3000}])
        for i in range(3):
            row = client.result(f"ok{i}", timeout=120)
            assert (row.id, row.finish_reason, row.output_tokens) == (f"ok{i}", "length", 5 + i)
            assert row.text is not None and len(row.output_token_ids) == 5 + i
        bad = client.result("long-prompt", timeout=60)
        assert (bad.finish_reason, bad.error_code) == ("error", "prompt_too_long")
        assert "3000" in bad.error


def test_cancel_stops_a_running_and_a_queued_request(served):
    with _client(served) as client:
        started = time.monotonic()
        long = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}
        client.submit_many([{"id": "run-a", "prompt": "a", **long}, {"id": "run-b", "prompt": "b", **long}])
        # Both run (each has streamed a token); the worker reads nothing more while full, so the
        # third waits in the stream.
        for rid in ("run-a", "run-b"):
            first = next(iter(client.stream(rid, timeout=120)))
            assert isinstance(first, Delta)
        client.submit({"id": "queued", "prompt": "c", **long})
        client.cancel("queued")
        client.cancel("run-a")
        client.cancel("run-b")
        a = client.result("run-a", timeout=30)
        b = client.result("run-b", timeout=30)
        # Read once the others made room, and ended at once: it never started.
        queued = client.result("queued", timeout=30)
        elapsed = time.monotonic() - started
    assert (queued.finish_reason, queued.output_tokens, queued.started_at) == ("cancelled", 0, None)
    for row in (a, b):
        assert row.finish_reason == "cancelled"
        assert 0 < row.output_tokens < 1900 and len(row.output_token_ids) == row.output_tokens
    assert elapsed < 60


def test_an_old_cancel_does_not_hit_the_same_id_submitted_again(served):
    with _client(served) as client:
        client.submit({"id": "again", "prompt": "x", "max_tokens": 1900, "ignore_eos": True})
        client.cancel("again")
        assert client.result("again", timeout=30).finish_reason == "cancelled"
        client.submit({"id": "again", "prompt": "x", "max_tokens": 4, "ignore_eos": True})
        row = client.result("again", timeout=60)
    assert (row.finish_reason, row.output_tokens) == ("length", 4)


def test_async_client_against_the_worker(served):
    async def main():
        async with AsyncClient(served, stream=STREAM) as client:
            ids = await client.submit_many([{"id": f"as{i}", "prompt": "x", "max_tokens": 3 + i,
                                             "ignore_eos": True} for i in range(4)])
            events = [e async for e in client.stream("as0", timeout=120)]
            rows = await asyncio.gather(*(client.result(i, timeout=120) for i in ids))
            return events, rows

    events, rows = asyncio.run(main())
    assert isinstance(events[-1], Final)
    assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 3
    assert [r.output_tokens for r in rows] == [3, 4, 5, 6]


def test_the_adaptive_wait_is_exported_as_metrics(served):
    # A request of its own first: the module's worker may have served nothing yet (this test can
    # be the module's first, or the only one a test process runs), and the metrics come up with it.
    with _client(served) as client:
        client.submit({"id": "metrics-probe", "prompt": "p", "max_tokens": 2, "ignore_eos": True})
        assert client.result("metrics-probe", timeout=120).finish_reason == "length"
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    values = {name: float(v) for name, v in re.findall(r"^(mqinfer_batcher_\w+) (\S+)$", text, re.M)}
    assert set(values) == {"mqinfer_batcher_max_wait_seconds", "mqinfer_batcher_arrival_rate",
                           "mqinfer_batcher_step_time_seconds"}
    assert 0 < values["mqinfer_batcher_step_time_seconds"] < 1.0  # steps were observed
    assert 0 <= values["mqinfer_batcher_max_wait_seconds"] <= 0.050  # within the default bounds


def test_everything_finished_is_acked(served, redis_server):
    # A result reaches its client before the worker's next flush of rows, and the worker acks an
    # entry (and deletes it) once its rows are durable: the last ones a moment after their replies.
    client = redis_server.client()
    key = keys.request_stream(STREAM)
    wait_until(lambda: client.xpending(key, keys.GROUP)["pending"] == 0 and client.xlen(key) == 0, timeout=30,
               what="every entry of the finished requests acked and deleted")
