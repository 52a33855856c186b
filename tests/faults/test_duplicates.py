"""Duplicates from producers: the same (job_id, id) in two stream entries is computed once; a copy
with different content is refused; a resubmission of a request whose entry was lost takes over."""

from __future__ import annotations

import json
import signal

import msgspec

from tests.faults.faultkit import (
    DEAD,
    STREAM,
    compact_and_check,
    killed,
    pending_by_consumer,
    pending_ids,
    record,
    result_keys,
    spawn,
    submit,
    wait_claimable,
)
from tests.helpers import rows, wait_until


def _add(client, obj: dict, fmt: str) -> str:
    if fmt == "json":
        fields = {"json": json.dumps(obj), "v": "1"}
    else:
        fields = {"r": msgspec.msgpack.encode(obj), "v": "1"}
    entry_id = client.xadd(STREAM, fields)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _req(rid: str, job_id: str | None, max_tokens: int = 12, metadata: dict | None = None) -> dict:
    obj = {"id": rid, "prompt_token_ids": [256, 70, 71, 72], "max_tokens": max_tokens, "ignore_eos": True,
           "temperature": 0.0, "metadata": metadata or {"a": "1", "b": "2"}}
    if job_id is not None:
        obj["job_id"] = job_id
    return obj


def test_same_request_twice_is_computed_once_and_different_content_is_refused(redis_url, redis_client, tmp_path):
    redis_client.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    # The same request as JSON and as msgpack, its metadata keys in another order: one request.
    _add(redis_client, _req("dup", "j"), "json")
    _add(redis_client, _req("dup", "j", metadata={"b": "2", "a": "1"}), "msgpack")
    # Same id, other content: the second copy is an error, the first one's row stands.
    _add(redis_client, _req("conf", "j", max_tokens=12), "msgpack")
    conflict_entry = _add(redis_client, _req("conf", "j", max_tokens=13), "msgpack")
    # The same id in another job, or without a job, is another request.
    _add(redis_client, _req("dup", "k"), "msgpack")
    _add(redis_client, _req("dup", None), "msgpack")
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", "--metrics-port", "0", log_level="info")
    try:
        port = a.metrics_port()
        wait_until(lambda: len(rows(out / "results")) >= 4 and not pending_by_consumer(redis_client),
                   timeout=60, what="the first copies' rows")
        # A third copy after the first one's row is written: still computed once.
        _add(redis_client, _req("dup", "j"), "json")
        _add(redis_client, _req("marker", "j"), "json")
        wait_until(lambda: ("j", "marker") in result_keys(out) and not pending_by_consumer(redis_client),
                   timeout=60, what="the marker's row")
        metrics = a.metrics(port)
    finally:
        a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.log()

    before = result_keys(out)
    assert sorted(before, key=str) == sorted([("j", "dup"), ("j", "conf"), ("k", "dup"), (None, "dup"),
                                              ("j", "marker")], key=str)  # no second row, even before compaction
    assert metrics['mqinfer_duplicate_requests_total{outcome="same"}'] == 2
    assert metrics['mqinfer_duplicate_requests_total{outcome="conflict"}'] == 1
    dead = redis_client.xrange(DEAD)
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"error_code"] == b"duplicate_id" and fields[b"entry_id"].decode() == conflict_entry
    assert b"different content" in fields[b"error"] and b"orig_r" in fields
    outcome = compact_and_check(out, set(before))
    assert outcome.by_key[("j", "conf")]["output_tokens"] == 12  # the first content won
    assert outcome.duplicates_removed == 0
    record("producer duplicates: same (job_id, id) x3, a conflicting copy", submitted=8,
           rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=0, duplicated=0,
           worker_crashes=0, note="2 same-content copies acked without computing; 1 conflict dead-lettered")


def test_resubmitting_a_request_whose_entry_was_trimmed_takes_over(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, [_req("again", "t", max_tokens=30)])
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", faults="worker.after_step=kill@2")
    a.wait()
    assert killed(a)
    assert len(pending_ids(redis_client, "A")) == 1
    redis_client.xtrim(STREAM, maxlen=0, approximate=False)  # its content is gone
    submit(redis_url, [_req("again", "t", max_tokens=30)])  # the producer sends it again
    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5", log_level="info")
    assert b.wait() == 0, b.log()
    assert "takes over from" in b.log()
    outcome = compact_and_check(out, expected)
    row = outcome.by_key[("t", "again")]
    assert row["finish_reason"] == "length" and row["output_tokens"] == 30  # not the `lost` error row
    record("a request lost to a trim, sent again", submitted=1, rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0)
