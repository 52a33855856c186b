"""Bulk jobs without inference workers: input chunks, fenced state, output composition, validation
outcomes driven by running the rq task in this process, and the no-torch rule of the tasks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqinfer.schemas import keys
from mqinfer.ops.job_input import InputPosition, InputUnusable, read_chunk
from mqinfer.ops.job_output import compose_output, openai_record
from mqinfer.ops.job_spool import Spool
from mqinfer.ops.job_store import CollectedRow, FeedItem, JobStore, LockLost, StatusChanged
from mqinfer.ops.job_tasks import run_task
from mqinfer.ops.jobs import SWEEP_LOCK, JobConflict, cancel_job, job_info, parse_deadline, submit_job, sweep
from mqinfer.schemas.files import iter_input
from mqinfer.schemas.lanes import lane_name, lane_stream
from mqinfer.schemas.request import Request, encode_request
from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow, rows_to_table
from tests.helpers import wait_until, write_jsonl


# -- deadlines -------------------------------------------------------------------------------
def test_parse_deadline_forms():
    assert parse_deadline("+90", now=1000.0) == 1090.0
    assert parse_deadline("1900000000") == 1900000000.0
    assert parse_deadline("2030-01-01T00:00:00Z") == 1893456000.0
    assert parse_deadline("2030-01-01T00:00:00") == 1893456000.0  # naive is UTC
    assert parse_deadline("2030-01-01T01:00:00+01:00") == 1893456000.0
    assert parse_deadline(None) is None
    with pytest.raises(ValueError, match="--deadline 'soon'"):
        parse_deadline("soon")
    with pytest.raises(ValueError, match="not a usable time"):
        parse_deadline("-5")


# -- resumable input chunks ------------------------------------------------------------------
def _signature(items):
    return [(i.line, i.request.id if i.request else None, i.error.code if i.error else None,
             i.error.request_id if i.error else None) for i in items]


def _read_all(path, chunk: int):
    items, pos, rounds = [], InputPosition(), 0
    while True:
        got, pos, at_end = read_chunk(path, InputPosition.decode(pos.encode()), chunk)
        assert len(got) <= chunk
        items += got
        rounds += 1
        if at_end:
            return items, rounds
        assert rounds < 10_000


_LINE = st.one_of(
    st.builds(lambda i: json.dumps({"id": f"r{i}", "prompt": "p"}), st.integers(0, 50)),
    st.builds(lambda i: json.dumps({"id": f"b{i}", "prompt": "p", "max_tokens": 0}), st.integers(0, 50)),
    st.just("{not json"),
    st.just(""),
    st.just("   "),
    st.just(json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=25), chunk=st.integers(1, 7), bom=st.booleans(), newline_at_end=st.booleans())
def test_jsonl_chunks_equal_one_pass(tmp_path, lines, chunk, bom, newline_at_end):
    path = tmp_path / "in.jsonl"
    data = "\n".join(lines) + ("\n" if newline_at_end else "")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data.encode())
    items, _ = _read_all(path, chunk)
    assert _signature(items) == _signature(list(iter_input(path)))


def test_parquet_chunks_cross_row_groups(tmp_path):
    path = tmp_path / "in.parquet"
    rows = [{"id": f"r{i}", "prompt": "p", "max_tokens": 0 if i % 4 == 3 else 2} for i in range(11)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    expected = _signature(list(iter_input(path)))
    assert [s[1] or s[3] for s in expected] == [f"r{i}" for i in range(11)]
    for chunk in (1, 2, 3, 4, 5, 11, 50):
        items, rounds = _read_all(path, chunk)
        assert _signature(items) == expected, chunk
        assert rounds >= 11 // chunk


def test_unusable_inputs(tmp_path):
    with pytest.raises(InputUnusable, match="does not exist"):
        read_chunk(tmp_path / "missing.jsonl", InputPosition(), 10)
    with pytest.raises(InputUnusable, match="unknown input format"):
        read_chunk(tmp_path / "x.csv", InputPosition(), 10)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"definitely not parquet")
    with pytest.raises(InputUnusable, match="not a readable Parquet file"):
        read_chunk(bad, InputPosition(), 10)


# -- fenced state ----------------------------------------------------------------------------
def _registered(client, job_id="job-x", chain="c1"):
    store = JobStore(client, job_id)
    store.register({"id": job_id, "status": "in_progress", "chain": chain, "created_at": time.time(),
                    "max_in_flight": 4, "chunk_size": 4})
    return store


def test_lock_is_exclusive_and_writes_are_fenced(redis_client):
    store = _registered(redis_client)
    assert store.acquire("other-chain", "t0", 5) == "stale"
    assert store.acquire("c1", "t1", 5) == "ok"
    assert store.acquire("c1", "t2", 5) == "busy"
    assert store.update("t1", {"note": "x"}, incr={"fed": 2}) == "in_progress"
    with pytest.raises(StatusChanged) as info:
        store.update("t1", {"note": "y"}, expect_status="validating")
    assert info.value.status == "in_progress"
    with pytest.raises(LockLost):
        store.update("t2", {"note": "z"})
    store.release("t2")  # not the holder: no effect
    assert store.acquire("c1", "t3", 5) == "busy"
    redis_client.pexpire(store.lock_key, 1)
    wait_until(lambda: not redis_client.exists(store.lock_key), timeout=5, interval=0.001, what="the lease to run out")
    with pytest.raises(LockLost):  # the lease ran out: the old holder can change nothing
        store.update("t1", {"note": "late"})
    job = store.load()
    assert job["note"] == "x" and job["fed"] == 2


def test_feed_and_collect_commits_count_each_request_once(redis_client):
    store = _registered(redis_client)
    assert store.acquire("c1", "t", 5) == "ok"
    stream, lane_key = keys.request_stream("unit"), keys.request_stream("unit:lane:j-x")
    items = [FeedItem(f"r{i}", f"0:{i}", encode_request(Request(id=f"r{i}", prompt="p")),
                      lane="j-x" if i == 2 else None) for i in range(3)]
    assert store.commit_feed("t", ["unit"], items, feed_part=0, feed_offset=3, skipped=1) == 3
    assert redis_client.xlen(stream) == 2 and redis_client.xlen(lane_key) == 1
    in_flight = store.inflight()
    assert set(in_flight) == {"r0", "r1", "r2"}
    assert in_flight["r1"][1:] == ("0:1", 0, None) and in_flight["r2"][1:] == ("0:2", 0, "j-x")
    assert redis_client.xrange(stream, in_flight["r1"][0], in_flight["r1"][0])[0][1][b"r"] == items[1].payload
    assert redis_client.xrange(lane_key, in_flight["r2"][0], in_flight["r2"][0])[0][1][b"r"] == items[2].payload
    # Records written before shards, or before lanes, were recorded: the id's shard, the plain stream.
    redis_client.hset(store.inflight_key, mapping={"old": "1-0 0:5", "older": "2-0 0:6 1"})
    assert store.inflight()["old"] == ("1-0", "0:5", None, None)
    assert store.inflight()["older"] == ("2-0", "0:6", 1, None)
    redis_client.hdel(store.inflight_key, "old", "older")

    redis_client.xadd(store.results_key, {"id": "r0", "row": "{}"})
    last = redis_client.xadd(store.results_key, {"id": "r0", "row": "{}"})
    rows = [CollectedRow("r0", "completed", 5, 7, 0.25), CollectedRow("r0", "completed", 5, 7, 0.25),
            CollectedRow("r2", "failed", 0, 0, None)]
    assert store.commit_collect("t", last.decode(), "part-a", rows) == 2
    job = store.load()
    assert (job["completed"], job["failed"], job["dup_rows"], job["collected"]) == (1, 1, 1, 2)
    assert (job["prompt_tokens"], job["output_tokens"], float(job["cost_usd"]), job["cost_rows"]) == (5, 7, 0.25, 1)
    assert (job["fed"], job["skipped"], job["feed_offset"]) == (3, 1, 3)
    assert set(store.inflight()) == {"r1"}
    assert store.part_names() == ["part-a"]
    assert redis_client.xlen(store.results_key) == 1  # trimmed up to the cursor
    redis_client.delete(store.lock_key)
    with pytest.raises(LockLost):
        store.commit_feed("t", ["unit"], items[:1], feed_part=0, feed_offset=4)
    assert redis_client.xlen(stream) == 2  # nothing was added without the lock


# -- output composition ----------------------------------------------------------------------
def _row(rid, reason="length", text="out", tokens=3, job="job-o", code=None):
    return ResultRow(job_id=job, id=rid, model="tiny", finish_reason=reason, error_code=code,
                     error="boom" if reason == "error" else None, prompt_tokens=2, output_tokens=tokens,
                     output_token_ids=list(range(tokens)), text=text, finished_at=1_700_000_000.0, worker="w")


def test_compose_output_orders_dedupes_and_fills_gaps(tmp_path):
    spool = Spool(tmp_path)
    req = {i: Request(id=f"r{i}", prompt="p", job_id="job-o", tenant="t1", api="chat" if i else "completions")
           for i in range(5)}
    spool.write_index_part(0, {
        "line": [1, 2, 3], "id": ["r0", "line:2", "r1"],
        "request": [encode_request(req[0]), None, encode_request(req[1])], "api": ["completions", None, "chat"],
        "error_code": [None, "invalid_json", None], "error": [None, "bad json", None]})
    native = Request(id="n1", prompt="p", job_id="job-o")
    spool.write_index_part(1, {
        "line": [5, 6, 7, 8], "id": ["r2", "r0", "r3", "n1"],
        "request": [encode_request(req[2]), encode_request(req[0]), encode_request(req[3]), encode_request(native)],
        "api": ["chat", "chat", "chat", None], "error_code": [None] * 4, "error": [None] * 4})
    spool.write_duplicates(pa.table({"line": [6], "id": ["r0"], "first_line": [1]}))
    # r1 failed first and succeeded on a retry; r2 came twice; r3 never came.
    spool.write_rows_part("p1.parquet", rows_to_table([_row("r1", "error", code="internal_error"), _row("r2")],
                                                      RESULT_SCHEMA))
    spool.write_rows_part("p2.parquet", rows_to_table([_row("r0", "stop"), _row("r1", text="second"),
                                                       _row("r2", text="later copy"), _row("n1")], RESULT_SCHEMA))
    summary = compose_output(spool, job_id="job-o", index_parts=2, row_parts=["p1.parquet", "p2.parquet"],
                             ending="cancelled", openai=True, now=1_700_000_100.0)
    out = pq.read_table(tmp_path / "output.parquet")
    assert out.schema.equals(RESULT_SCHEMA)
    got = [(r["id"], r["finish_reason"], r["text"]) for r in out.to_pylist()]
    assert got == [("r0", "stop", "out"), ("line:2", "error", None), ("r1", "length", "second"),
                   ("r2", "length", "out"), ("r0", "error", None), ("r3", "cancelled", None), ("n1", "length", "out")]
    rows = out.to_pylist()
    assert rows[1]["error"] == "line 2: bad json" and rows[1]["error_code"] == "invalid_json"
    assert "repeats line 1" in rows[4]["error"]
    assert rows[5]["tenant"] == "t1" and rows[5]["job_id"] == "job-o"
    assert (summary.rows, summary.completed, summary.failed, summary.cancelled) == (7, 4, 2, 1)

    ok = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    bad = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in ok] == ["r0", "r1", "r2"]  # the native line n1 is not an OpenAI answer
    assert ok[0]["response"]["body"]["object"] == "text_completion"
    assert ok[0]["response"]["body"]["choices"][0] == {"index": 0, "text": "out", "logprobs": None,
                                                       "finish_reason": "stop"}
    assert ok[1]["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "second"}
    assert ok[1]["response"]["body"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert [(b["custom_id"], b["error"]["code"]) for b in bad] == [
        (None, "invalid_json"), ("r0", "invalid_request"), ("r3", "batch_cancelled")]
    assert len({o["id"] for o in ok + bad}) == 6


def test_openai_record_logprobs_name_token_ids():
    row = {"line": 4, "id": "c", "api": "chat", "finish_reason": "length", "text": "hi", "model": "tiny",
           "prompt_tokens": 1, "output_tokens": 1, "finished_at": job_output_datetime(),
           "logprobs": [{"token_id": 7, "logprob": -0.5, "top_token_ids": [7, 9], "top_logprobs": [-0.5, -1.5]}],
           "error_code": None, "error": None}
    ok, record = openai_record("job", row)
    assert ok
    content = record["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "7", "logprob": -0.5, "bytes": None,
                        "top_logprobs": [{"token": "7", "logprob": -0.5, "bytes": None},
                                         {"token": "9", "logprob": -1.5, "bytes": None}]}]
    ok, record = openai_record("job", {**row, "api": "completions"})
    assert record["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"] == [{"7": -0.5, "9": -1.5}]
    ok, record = openai_record("job", {**row, "finish_reason": "expired"})
    assert not ok and record["error"]["code"] == "batch_expired" and record["response"] is None


def job_output_datetime():
    import datetime as dt

    return dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


# -- validation, driven in this process ------------------------------------------------------
def _drive(client, job_id, until=("failed", "in_progress", "cancelled", "completed"), timeout=30.0):
    store = JobStore(client, job_id)
    deadline = time.monotonic() + timeout
    while store.status() not in until:
        assert time.monotonic() < deadline, f"job stuck in {store.status()}"
        run_task(client, job_id, client.hget(store.hash_key, "chain").decode(), budget_s=0.3)
    return job_info(client, job_id)


def test_validation_outcomes(redis_client, tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    info = _drive(redis_client, submit_job(redis_client, empty, tmp_path / "o1").job_id)
    assert info["status"] == "failed" and "holds no requests" in info["error"]

    junk = write_jsonl(tmp_path / "junk.jsonl", ["{", {"id": "a"}])
    info = _drive(redis_client, submit_job(redis_client, junk, tmp_path / "o2").job_id)
    assert info["status"] == "failed" and "none of the 2 lines" in info["error"]
    assert [e["line"] for e in info["errors"]] == [1, 2]

    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "prompt": "x"},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}])
    info = _drive(redis_client, submit_job(redis_client, mixed, tmp_path / "o3", stream="unitmixed").job_id)
    assert info["status"] == "in_progress" and info["format"] == "mixed" and info["counts"]["total"] == 2

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 nope")
    info = _drive(redis_client, submit_job(redis_client, broken, tmp_path / "o4").job_id)
    assert info["status"] == "failed" and "not a readable Parquet file" in info["error"]

    with pytest.raises(FileNotFoundError):
        submit_job(redis_client, tmp_path / "nope.jsonl", tmp_path / "o5")
    with pytest.raises(ValueError, match="--max-in-flight"):
        submit_job(redis_client, mixed, tmp_path / "o6", max_in_flight=0)
    with pytest.raises(ValueError, match="in the past"):
        submit_job(redis_client, mixed, tmp_path / "o7", deadline=time.time() - 60)


def test_validation_then_feeding_respects_the_in_flight_bound(redis_client, tmp_path):
    lines = [{"id": f"r{i}", "prompt": "x", "deadline": 4_000_000_000.0 if i == 0 else None}
             for i in range(30)]
    lines = [{k: v for k, v in line.items() if v is not None} for line in lines] + ["{bad"]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    res = submit_job(redis_client, src, tmp_path / "out", stream="unitfeed", max_in_flight=7, chunk_size=3,
                     deadline=3_000_000_000.0, lanes="tenant,job")
    info = _drive(redis_client, res.job_id, until=("in_progress",))
    assert info["counts"]["total"] == 31 and info["counts"]["invalid"] == 1
    store = JobStore(redis_client, res.job_id)
    for _ in range(3):
        run_task(redis_client, res.job_id, redis_client.hget(store.hash_key, "chain").decode(), budget_s=0.2)
    # Fed into the job's own lane of the stream.
    stream = keys.request_stream(lane_stream("unitfeed", lane_name("tenant,job", "default", res.job_id)))
    assert redis_client.xlen(keys.request_stream("unitfeed")) == 1  # the lane's notice, no request
    entries = redis_client.xrange(stream)
    assert len(entries) == 7 == store.inflight_count()  # never more than max_in_flight out
    sent = [msgspec.msgpack.decode(fields[b"r"], type=Request) for _, fields in entries]
    assert [r.id for r in sent] == [f"r{i}" for i in range(7)]
    assert all(r.job_id == res.job_id for r in sent)
    assert sent[0].deadline == 3_000_000_000.0 and sent[1].deadline == 3_000_000_000.0  # the earlier one wins
    assert redis_client.xinfo_groups(stream)[0]["name"] == keys.GROUP.encode()
    # A second task of a stale chain does nothing.
    assert "no longer" in run_task(redis_client, res.job_id, "not-the-chain")
    assert len(redis_client.xrange(stream)) == 7

    assert cancel_job(redis_client, res.job_id) == "cancelling"
    assert cancel_job(redis_client, res.job_id) == "cancelling"
    with pytest.raises(JobConflict, match="already holds job"):
        submit_job(redis_client, src, tmp_path / "out")


def test_cancel_before_validation_ends_with_nothing_run(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    res = submit_job(redis_client, src, tmp_path / "out")
    assert cancel_job(redis_client, res.job_id) == "cancelling"
    info = _drive(redis_client, res.job_id)
    assert info["status"] == "cancelled" and "nothing ran" in info["error"]
    assert not (tmp_path / "out" / "output.parquet").exists()
    assert redis_client.sismember("mqinfer:jobs:active", res.job_id) == 0


# -- no torch in job tasks -------------------------------------------------------------------
def test_tasks_run_without_importing_torch(redis_url, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(5)] + ["{"])
    script = f"""
import sys
from rq import SimpleWorker
from rq.serializers import JSONSerializer
from mqinfer.schemas.connection import connect
from mqinfer.ops import job_tasks
from mqinfer.ops.jobs import JobsWorker, submit_job, job_info
job_tasks.TASK_BUDGET_S = 0.5  # the job has no inference worker: do not wait for rows
client = connect({redis_url!r})
job = submit_job(client, {str(src)!r}, {str(tmp_path / 'out')!r}, stream="notorch").job_id
class InProcessWorker(SimpleWorker):  # its command channel listened to as `mqinfer jobs worker` does
    subscribe = JobsWorker.subscribe
InProcessWorker(["mqinfer-jobs"], connection=client, serializer=JSONSerializer).work(burst=True, max_jobs=2)
info = job_info(client, job)
assert info["status"] == "in_progress" and info["counts"]["fed"] == 5, info
print("torch imported:", "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch imported: False" in done.stdout  # rq logs to stdout too


# -- broken chains: errors, backoff, the sweeper ---------------------------------------------
def test_failing_tasks_back_off_are_restarted_by_the_sweeper_and_finally_fail_the_job(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(3)])
    out = tmp_path / "out"
    job_id = submit_job(redis_client, src, out, stream="unitsweep", max_in_flight=1).job_id
    _drive(redis_client, job_id, until=("in_progress",))
    store = JobStore(redis_client, job_id)
    # A row arrives, but the spool cannot take it: every collect step now fails.
    row = _row("r0", job=job_id)
    redis_client.xadd(store.results_key, {"id": "r0", "row": msgspec.json.encode(row)})
    Spool(out).rows_dir.write_text("in the way")
    queue_key = "rq:queue:mqinfer-jobs"
    redis_client.delete(queue_key)

    chain = redis_client.hget(store.hash_key, "chain").decode()
    with pytest.raises(OSError):
        run_task(redis_client, job_id, chain, budget_s=0.2)
    job = store.load()
    assert job["task_errors"] == 1 and "rows" in job["last_task_error"]
    assert float(job["beat"]) > time.time() + 1  # backoff: not restarted at once
    assert not redis_client.exists(store.lock_key)  # the failed task let go of the job
    assert sweep(redis_client, grace_s=0.0, lock_ms=1) == []
    redis_client.hset(store.hash_key, "beat", time.time() - 10)
    wait_until(lambda: not redis_client.exists(SWEEP_LOCK), timeout=5, interval=0.001, what="the sweep lock to expire")
    assert sweep(redis_client, grace_s=5.0, lock_ms=1) == [job_id]
    new_chain = redis_client.hget(store.hash_key, "chain").decode()
    assert new_chain != chain and redis_client.llen(queue_key) == 1
    assert "no longer" in run_task(redis_client, job_id, chain)  # the old chain is retired
    wait_until(lambda: not redis_client.exists(SWEEP_LOCK), timeout=5, interval=0.001, what="the sweep lock to expire")
    assert sweep(redis_client, grace_s=0.0, lock_ms=1) == []  # its new task waits in the queue

    for _ in range(4):
        with pytest.raises(OSError):
            run_task(redis_client, job_id, new_chain, budget_s=0.2)
    info = job_info(redis_client, job_id)
    assert info["status"] == "failed"
    assert info["error"].startswith("orchestration failed 5 times in a row; last: ")
    assert redis_client.sismember("mqinfer:jobs:active", job_id) == 0


def test_a_bulk_job_refuses_several_choices_with_an_error_row_naming_n():
    from mqinfer.ops.job_validation import refuse_choices
    from mqinfer.schemas.files import InputItem
    from mqinfer.schemas.request import request_from_obj

    one = InputItem(1, request_from_obj({"id": "a", "prompt": "x"}), None)
    assert refuse_choices(one) is one
    many = refuse_choices(InputItem(2, request_from_obj({"id": "b", "prompt": "x", "n": 3}), None))
    assert many.request is None and many.error.code == "unsupported_parameter"
    assert many.error.request_id == "b" and "$.n" in many.error.message and many.line == 2


def test_an_idle_jobs_worker_stops_at_once(redis_server, redis_url):
    """SIGTERM makes rq unsubscribe from the worker's command channel and wait for the thread that
    listens on it; that thread must notice within its short poll, not sit out rq's minute (about
    one stop in five did). Each cycle here is such a stop."""
    from mqinfer.ops.jobs import JobsWorker

    for _ in range(4):
        worker = JobsWorker(redis_server.client(), sweep_interval_s=0.5)
        worker.subscribe()
        wait_until(lambda: worker.pubsub.subscribed, timeout=10, what="the command channel subscription")
        started = time.monotonic()
        worker.unsubscribe()
        assert time.monotonic() - started < 5
        assert not worker.pubsub_thread.is_alive()
        worker.connection.close()
