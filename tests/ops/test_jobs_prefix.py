"""Bulk jobs fed in prefix order and routed by prefix: the order requests enter the stream, the
shard each goes to, and that lost-entry detection, resumption and the output are unchanged by
either. The rq tasks run in this process; the test answers for the workers, except in the one
case with real inference workers."""

from __future__ import annotations

import json
import os
import time

import pytest

from mqinfer.ops import job_run
from mqinfer.ops.job_store import JobStore
from mqinfer.ops.jobs import job_info, submit_job
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.keys import shard_index, shard_streams
from tests import zygote
from tests.helpers import mqinfer_cmd, shared_prefix_requests, stop_processes, write_jsonl
from tests.ops.test_jobs_pipeline import output, start_inference
from tests.ops.test_jobs_two_servers import _answer, _delete_entry, _drive, _entries, _requests_in, _step

SYSTEMS = ["You are a careful assistant. ", "Answer in French. ", "Be terse. "]


def _interleaved(n: int, prefix: str = "r") -> list[dict]:
    """Requests whose prompts start with one of three system prompts, taking turns."""
    return [{"id": f"{prefix}{i}", "prompt": f"{SYSTEMS[i % 3]}Question {i}?", "max_tokens": 2} for i in range(n)]


def _stream_order(client, stream: str) -> list[str]:
    """Ids of the requests in the stream (the job's lane of it), in the order they were added."""
    return [req.id for stream_key in lane_scheme.stream_keys(client, stream)
            for _, req in _requests_in(client, stream_key)]


def _feed_all(client, job_id: str, count: int, timeout: float = 30.0) -> None:
    """Run tasks (nobody answers) until ``count`` requests were fed."""
    deadline = time.monotonic() + timeout
    while job_info(client, job_id)["counts"]["fed"] < count:
        assert time.monotonic() < deadline, f"fed only {job_info(client, job_id)['counts']}"
        _step(client, client, job_id)


def _by_prompt(items: list[dict]) -> list[str]:
    """Ids in prefix-tree order: prompts sorted by their bytes, ties in input order."""
    return [d["id"] for d in sorted(items, key=lambda d: d["prompt"].encode())]


# -- order -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_a_jobs_prefix_groups_keep_to_the_workers_cache_scope(redis_client, tmp_path, scope):
    """Two tenants send the same prompts: under the default scope each tenant's requests come
    together (they cannot share with the other's), under global each prompt's requests do."""
    items = [dict(d, id=f"{tenant}{i}", tenant=tenant) for i, d in enumerate(_interleaved(6))
             for tenant in ("b", "a")]
    src = write_jsonl(tmp_path / "in.jsonl", items)
    res = submit_job(redis_client, src, tmp_path / "out", stream="scoped", order="prefix", max_in_flight=100,
                     prefix_cache_scope=scope)
    assert redis_client.hget(keys.job_key(res.job_id), "prefix_cache_scope") == scope.encode()
    _feed_all(redis_client, res.job_id, len(items))
    sent = _stream_order(redis_client, "scoped")
    by_prompt = [rid[1:] for rid in _by_prompt([d for d in items if d["tenant"] == "b"])]  # "1", "4", "2", ...
    assert by_prompt == ["1", "4", "2", "5", "0", "3"]
    if scope == "tenant":
        assert sent == [f"a{i}" for i in by_prompt] + [f"b{i}" for i in by_prompt]
    else:  # the same prompt's requests together, in input order
        assert sent == [f"{t}{i}" for i in by_prompt for t in ("b", "a")]


def test_a_bad_prefix_cache_scope_is_refused_at_submit(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", _interleaved(2))
    with pytest.raises(ValueError, match="--prefix-cache-scope must be one of tenant, global, got 'everyone'"):
        submit_job(redis_client, src, tmp_path / "out", stream="bad", prefix_cache_scope="everyone")


@pytest.mark.parametrize("order", ["prefix", "input"])
def test_requests_enter_the_stream_in_prefix_order_and_the_output_stays_in_input_order(
        redis_client, tmp_path, order):
    items = _interleaved(12)
    lines = [*items[:5], "{not json", *items[5:9], {"id": "r3", "prompt": "Be terse. again"}, *items[9:]]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    res = submit_job(redis_client, src, tmp_path / "out", stream="ord", order=order, max_in_flight=100)
    assert redis_client.hget(keys.job_key(res.job_id), "order") == order.encode()
    _feed_all(redis_client, res.job_id, len(items))

    sent = _stream_order(redis_client, "ord")
    assert sorted(sent) == sorted(d["id"] for d in items)  # the invalid line and the repeated id are not sent
    if order == "prefix":
        assert sent == _by_prompt(items) != [d["id"] for d in items]
        systems = [next(s for s in SYSTEMS if d["prompt"].startswith(s))
                   for d in sorted(items, key=lambda d: sent.index(d["id"]))]
        # Each system prompt's requests one after another: the system prompt changes twice.
        assert sum(a != b for a, b in zip(systems, systems[1:])) == len(SYSTEMS) - 1
    else:
        assert sent == [d["id"] for d in items]

    info = _drive(redis_client, redis_client, res.job_id, "ord", 1, until=("completed",))
    assert info["counts"]["completed"] == 12 and info["counts"]["failed"] == 2
    got = output(tmp_path / "out")
    assert [r["id"] for r in got] == [*[d["id"] for d in items[:5]], "line:6", *[d["id"] for d in items[5:9]],
                                      "r3", *[d["id"] for d in items[9:]]]
    assert [r["finish_reason"] for r in got].count("error") == 2 and got[10]["error_code"] == "invalid_request"


def test_prefix_order_is_kept_per_part_across_tasks_that_each_feed_a_little(redis_client, tmp_path, monkeypatch):
    """Parts of five lines, two requests out at a time: every task is a new one that resumes from
    the feed cursor; the requests enter the stream in each part's prefix order, each once."""
    monkeypatch.setattr(job_run, "INDEX_PART_LINES", 5)
    items = _interleaved(14, "p")
    src = write_jsonl(tmp_path / "in.jsonl", items)
    res = submit_job(redis_client, src, tmp_path / "out", stream="parts", max_in_flight=2, chunk_size=2)
    sent: list[str] = []
    deadline = time.monotonic() + 60
    while JobStore(redis_client, res.job_id).status() != "completed":
        assert time.monotonic() < deadline, f"job stuck in {JobStore(redis_client, res.job_id).status()}"
        _step(redis_client, redis_client, res.job_id)
        entries = _entries(redis_client, "parts", 1)
        assert len(entries) <= 2  # never more than max_in_flight out
        sent += _stream_order(redis_client, "parts")
        _answer(redis_client, "parts", 1, res.job_id, entries)
    expected = _by_prompt(items[0:5]) + _by_prompt(items[5:10]) + _by_prompt(items[10:14])
    assert expected != [d["id"] for d in items]
    assert sent == expected
    assert int(redis_client.hget(keys.job_key(res.job_id), "val_parts")) == 3
    assert [r["id"] for r in output(tmp_path / "out")] == [d["id"] for d in items]


# -- route -----------------------------------------------------------------------------------
def _groups(items: list[dict]) -> list[list[str]]:
    return [[d["id"] for d in items[g::2]] for g in range(2)]


@pytest.mark.parametrize("route", ["prefix", "id"])
def test_requests_sharing_a_long_prefix_go_to_one_shard(redis_client, tmp_path, route):
    items = shared_prefix_requests(per_group=16)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    res = submit_job(redis_client, src, tmp_path / "out", stream="rt", shards=2, route=route, max_in_flight=100)
    assert redis_client.hget(keys.job_key(res.job_id), "route") == route.encode()
    _feed_all(redis_client, res.job_id, len(items))
    sent = _entries(redis_client, "rt", 2)
    assert set(sent) == {d["id"] for d in items}
    by_id = {rid: shard_index(rid, res.job_id, 2) for rid in sent}
    group_a, group_b = _groups(items)
    # By a hash of the ids, the two groups do not each keep to one shard (all but certain).
    assert len({by_id[r] for r in group_a}) > 1 or len({by_id[r] for r in group_b}) > 1
    if route == "prefix":
        shard_a, shard_b = {sent[r][0] for r in group_a}, {sent[r][0] for r in group_b}
        assert len(shard_a) == len(shard_b) == 1 and shard_a != shard_b  # together, and balanced
    else:
        assert {rid: shard for rid, (shard, _, _) in sent.items()} == by_id
    in_flight = JobStore(redis_client, res.job_id).inflight()
    assert {rid: record.shard for rid, record in in_flight.items()} == {rid: s[0] for rid, s in sent.items()}


def test_a_routed_prefix_job_computes_what_an_input_ordered_id_routed_job_does(redis_server, tmp_path):
    """Real inference workers, one per shard stream."""
    client = redis_server.client()
    client.flushall()
    items = shared_prefix_requests(per_group=6, max_tokens=3)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    workers = [start_inference(redis_server.url, tmp_path / f"w{i}", "--stream", name, "--max-num-seqs", "4")
               for i, name in enumerate(shard_streams("pw", 2))]
    try:
        routed = submit_job(client, src, tmp_path / "routed", stream="pw", shards=2, max_in_flight=64).job_id
        plain = submit_job(client, src, tmp_path / "plain", stream="pw", shards=2, order="input", route="id",
                           max_in_flight=64).job_id
        deadline = time.monotonic() + 120
        while {JobStore(client, j).status() for j in (routed, plain)} != {"completed"}:
            assert time.monotonic() < deadline, [job_info(client, j)["counts"] for j in (routed, plain)]
            for job_id in (routed, plain):
                if JobStore(client, job_id).status() != "completed":
                    _step(client, client, job_id, budget_s=0.3)
    finally:
        stop_processes(*workers)
        client.close()
    got, want = output(tmp_path / "routed"), output(tmp_path / "plain")
    assert [r["id"] for r in got] == [d["id"] for d in items]  # input order
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 3 for r in got)
    assert [(r["id"], r["output_token_ids"]) for r in got] == [(r["id"], r["output_token_ids"]) for r in want]
    worker_of = {r["id"]: r["worker"] for r in got}
    group_a, group_b = _groups(items)
    # Each prefix was computed by one shard's worker, the two prefixes by different ones.
    assert len({worker_of[r] for r in group_a}) == len({worker_of[r] for r in group_b}) == 1
    assert worker_of[group_a[0]] != worker_of[group_b[0]]


# -- lost entries and resumption with routed shards -----------------------------------------
def test_lost_entries_are_looked_for_on_the_shard_each_request_was_routed_to(redis_client, tmp_path):
    items = shared_prefix_requests(per_group=8)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    res = submit_job(redis_client, src, tmp_path / "out", stream="lr", shards=2, max_in_flight=100,
                     lanes="tenant,job")
    # Entry ids are unique within a stream only: two shards fed in one step number their entries
    # alike, so an entry looked for in the wrong stream could be found there. The job's lane of
    # shard 1 numbers its entries from far ahead instead, so that each entry id names one entry of
    # the job (and none is in the plain streams, which hold only the lanes' notices).
    lane = lane_scheme.lane_name("tenant,job", "default", res.job_id)
    ahead = keys.request_stream(lane_scheme.lane_stream("lr-1", lane))
    redis_client.xdel(ahead, redis_client.xadd(ahead, {"x": "1"}, id=f"{int(time.time() * 1000) + 10**9}-0"))
    job_key = keys.job_key(res.job_id)
    _feed_all(redis_client, res.job_id, len(items))
    sent = _entries(redis_client, "lr", 2)
    assert {record.lane for record in JobStore(redis_client, res.job_id).inflight().values()} == {lane}
    moved = sorted(rid for rid, (shard, _, _) in sent.items() if shard != shard_index(rid, res.job_id, 2))
    stayed = sorted(set(sent) - set(moved))
    assert len(moved) >= 2 and len(stayed) >= 2  # all but certain with 16 requests

    def reconcile() -> None:
        redis_client.hset(job_key, "reconciled_at", "1")  # the interval has passed
        _step(redis_client, redis_client, res.job_id)

    # Nothing is lost: every entry is found in the stream it went to, nothing is sent again.
    reconcile()
    assert int(redis_client.hget(job_key, "refed") or 0) == 0
    assert _entries(redis_client, "lr", 2) == sent

    # Two routed elsewhere than their id's shard were acked (in that shard's done set, entry
    # deleted) and their rows are still on the way: done, not lost.
    acked = {rid: sent[rid] for rid in moved[:2]}
    for rid, (shard, entry_id, _) in acked.items():
        name = shard_streams("lr", 2)[shard]
        redis_client.sadd(keys.job_done_set(name, res.job_id), rid)
        _delete_entry(redis_client, name, entry_id, rid)
    reconcile()
    assert int(redis_client.hget(job_key, "refed") or 0) == 0
    assert not set(acked) & set(_entries(redis_client, "lr", 2))

    # Two entries vanished without a row (a trimmed stream): sent again, to the same shard.
    trimmed = [moved[2], stayed[0]] if len(moved) > 2 else stayed[:2]
    for rid in trimmed:
        shard, entry_id, _ = sent[rid]
        _delete_entry(redis_client, shard_streams("lr", 2)[shard], entry_id, rid)
    reconcile()
    assert int(redis_client.hget(job_key, "refed")) == 2
    again = _entries(redis_client, "lr", 2)
    for rid in trimmed:
        assert again[rid][0] == sent[rid][0] and again[rid][1] != sent[rid][1]

    # The late rows of the acked two, then everything else: one row each, in input order.
    _answer(redis_client, "lr", 2, res.job_id, {rid: (shard, "0-1", req) for rid, (shard, _, req) in acked.items()})
    info = _drive(redis_client, redis_client, res.job_id, "lr", 2, until=("completed",))
    assert info["counts"]["completed"] == len(items) and info["counts"]["fed"] == len(items)
    assert int(redis_client.hget(job_key, "dup_rows") or 0) == 0
    assert [r["id"] for r in output(tmp_path / "out")] == [d["id"] for d in items]


def test_cli_submit_takes_order_and_route(redis_url, redis_client, tmp_path):
    common = dict(capture_output=True, text=True, timeout=60)
    shown = zygote.run(mqinfer_cmd("jobs", "submit", "--help"), **common)
    assert shown.returncode == 0, shown.stderr
    assert "--order {prefix,input}" in shown.stdout and "--route {prefix,id}" in shown.stdout
    assert f"part of {job_run.INDEX_PART_LINES} input lines" in " ".join(shown.stdout.split())
    src = write_jsonl(tmp_path / "in.jsonl", _interleaved(3))
    done = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "o"), "--redis", redis_url,
                                  "--shards", "2", "--order", "input", "--route", "id", "--json"), **common)
    assert done.returncode == 0, done.stderr
    job = redis_client.hgetall(keys.job_key(json.loads(done.stdout)["job_id"]))
    assert (job[b"order"], job[b"route"], job[b"shards"]) == (b"input", b"id", b"2")
    assert job[b"prefix_cache_scope"] == b"tenant"  # the workers' default
    scoped = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "o3"), "--redis",
                                    redis_url, "--json"), **common,
                        env=dict(os.environ, MQINFER_PREFIX_CACHE_SCOPE="global"))
    assert scoped.returncode == 0, scoped.stderr
    job = redis_client.hgetall(keys.job_key(json.loads(scoped.stdout)["job_id"]))
    assert job[b"prefix_cache_scope"] == b"global"
    bad = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "o2"), "--redis", redis_url,
                                 "--order", "random"), **common)
    assert bad.returncode == 2 and "--order" in bad.stderr
