"""Faults on the Redis side: the server killed and restarted from its append-only file, and the
request stream trimmed below its backlog (entries pending under a dead worker, running under a
live one, and never delivered)."""

from __future__ import annotations

import secrets
import signal
import time

from mqinfer.schemas import keys
from mqinfer.server import EmbeddedServer, _free_port
from tests.faults.faultkit import (
    DEAD,
    STREAM,
    compact_and_check,
    killed,
    pending_by_consumer,
    pending_ids,
    record,
    requests,
    spawn,
    submit,
    wait_rows,
)
from tests.helpers import rows, wait_until


def test_redis_kill_9_mid_job_and_restart_from_its_append_only_file(tmp_path):
    data, port, password = tmp_path / "redis", _free_port(), secrets.token_urlsafe(18)
    server = EmbeddedServer(data, port=port, password=password, appendonly=True).start()
    restarted = None
    workers = []
    try:
        url = server.url
        expected = submit(url, requests("redis-kill", 16, 50))
        out = tmp_path / "out"
        workers = [spawn(url, out, name, "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-rows", "1",
                         "--idle-exit-s", "4", log_level="info") for name in ("A", "B")]
        wait_rows(out, 2, what="the first rows")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        server.stop()
        rows_while_down = len(rows(out / "results"))
        # The outage lasts on purpose; the workers keep stepping, writing rows and backing off meanwhile.
        time.sleep(1.5)
        restarted = EmbeddedServer(data, port=port, password=password, appendonly=True).start()
        assert restarted.url == url
        for w in workers:
            assert w.wait(timeout=120) == 0, w.log()
        logs = "".join(w.log() for w in workers)
        assert "redis unavailable" in logs and "redis reachable again" in logs
        client = restarted.client()
        assert pending_by_consumer(client) == {}
        assert client.xlen(STREAM) == 0
        outcome = compact_and_check(out, expected, client)
        client.close()
        assert all(r["output_tokens"] == 50 for r in outcome.by_key.values())
        assert rows_while_down >= 2
        record("Redis server kill -9 mid-job, restart from its AOF", submitted=len(expected),
               rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=0,
               duplicated=outcome.duplicates_removed, worker_crashes=0, injected_kills=1)
    finally:
        for w in workers:
            w.kill()
        server.stop()
        if restarted is not None:
            restarted.stop()


def test_stream_trimmed_below_its_backlog_is_detected_counted_and_reported(redis_url, redis_client, tmp_path):
    first = requests("trim", 4, 30, prefix="a")
    submit(redis_url, first)
    out = tmp_path / "out"
    # A reads four entries and dies: they stay pending under its name.
    a = spawn(redis_url, out, "A", "--max-num-seqs", "4", "--claim-idle-ms", "1000",
              faults="worker.after_step=kill@3")
    a.wait()
    assert killed(a), a.log()
    held = pending_ids(redis_client, "A")
    assert len(held) == 4
    second = requests("trim", 8, 30, prefix="b")
    submit(redis_url, second)
    # 4 pending + 8 undelivered entries; keep the newest 5: the 4 pending ones and 3 never read go.
    assert redis_client.xtrim(STREAM, maxlen=5, approximate=False) == 7

    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--metrics-port", "0", log_level="info")
    try:
        port = b.metrics_port()
        wait_until(lambda: len(rows(out / "results")) >= 9 and not pending_by_consumer(redis_client),
                   timeout=90, what="B to finish what is left and report what is lost")
        metrics = b.metrics(port)
    finally:
        b.signal(signal.SIGTERM)
    assert b.wait() == 0, b.log()
    log = b.log()

    # Pending under the dead worker: the in-flight hash still names them: a `lost` error row each.
    assert metrics['mqinfer_stream_entries_lost_total{state="pending"}'] == 4
    assert log.count("was pending but is no longer in the stream (trimmed)") == 4
    # Never delivered: ids unknown, so a count, an error log line and one dead letter.
    assert metrics['mqinfer_stream_entries_lost_total{state="undelivered"}'] == 3
    assert "3 entries after" in log and "before any worker read them" in log
    gap = [f for _, f in redis_client.xrange(DEAD) if f[b"error_code"] == b"lost"]
    assert len(gap) == 1 and gap[0][b"count"] == b"3"

    kept = {("trim", f"a{i}") for i in range(4)} | {("trim", f"b{i}") for i in range(3, 8)}
    outcome = compact_and_check(out, kept)
    for i in range(4):
        row = outcome.by_key[("trim", f"a{i}")]
        assert row["finish_reason"] == "error" and row["error_code"] == "lost", row
    assert all(outcome.by_key[("trim", f"b{i}")]["output_tokens"] == 30 for i in range(3, 8))
    record("stream trimmed below its backlog (dead worker's pending + undelivered)", submitted=12,
           rows_before=outcome.rows_before, rows_after=outcome.rows_after,
           lost=3, lost_with_error_row=4, duplicated=outcome.duplicates_removed, worker_crashes=0,
           note="4 pending entries -> `lost` error rows; 3 undelivered -> metric, log line, one dead letter")


def test_entries_trimmed_while_running_are_finished_from_memory(redis_url, redis_client, tmp_path):
    running = requests("trim-live", 4, 200, prefix="run")
    expected = submit(redis_url, running)
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--metrics-port", "0",
              log_level="info")
    try:
        port = a.metrics_port()
        wait_until(lambda: len(pending_ids(redis_client, "A")) == 4, timeout=60, what="A to run four")
        submit(redis_url, requests("trim-live", 3, 200, prefix="queued"))
        assert redis_client.xtrim(STREAM, maxlen=0, approximate=False) == 7
        wait_until(lambda: len(rows(out / "results")) >= 4 and not pending_by_consumer(redis_client),
                   timeout=90, what="A to finish the trimmed requests from memory")

        def loss_reported():  # at a claim tick
            metrics = a.metrics(port)
            return metrics if metrics.get('mqinfer_stream_entries_lost_total{state="undelivered"}', 0) >= 3 else None

        metrics = wait_until(loss_reported, timeout=30, what="the undelivered loss to be reported")
    finally:
        a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.log()
    assert metrics["mqinfer_stream_entries_trimmed_in_flight_total"] == 4
    assert metrics['mqinfer_stream_entries_lost_total{state="undelivered"}'] == 3
    assert "finishing it from memory" in a.log()
    outcome = compact_and_check(out, expected)
    assert all(r["output_tokens"] == 200 and r["finish_reason"] == "length" for r in outcome.by_key.values())
    record("stream trimmed to 0 while a live worker runs its entries", submitted=7,
           rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=3,
           duplicated=outcome.duplicates_removed, worker_crashes=0,
           note="4 running entries finished from memory; 3 undelivered counted and reported")


def test_entries_delivered_again_while_running_are_not_run_twice(redis_url, redis_client, tmp_path):
    """A server restarted from an append-only file that lost its last second, or a group rewound
    with XGROUP SETID, delivers entries again that a live worker is running."""
    expected = submit(redis_url, requests("rewind", 3, 200))
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    wait_until(lambda: len(pending_ids(redis_client, "A")) == 3, timeout=60, what="A to run three")
    redis_client.xgroup_setid(STREAM, keys.GROUP, "0")
    assert a.wait() == 0, a.log()
    assert len(rows(out / "results")) == 3  # each ran once
    outcome = compact_and_check(out, expected, redis_client)
    assert outcome.duplicates_removed == 0
    record("a group rewound while its entries run", submitted=3, rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=0, worker_crashes=0)
