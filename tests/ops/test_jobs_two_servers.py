"""Bulk jobs with a separate jobs server (``--jobs-redis``): job state and the rq queue on one
server, request streams (sharded) and result streams on another, driven in this process by
running the rq task directly, including a crash between the two halves of a feed."""

from __future__ import annotations

import time

import msgspec
import pyarrow.parquet as pq
import pytest
import redis

from mqinfer.schemas import keys
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.ops.job_store import JobStore
from mqinfer.ops.job_tasks import run_task
from mqinfer.ops.jobs import cancel_job, job_info, submit_job
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import ResultRow
from mqinfer.server import EmbeddedServer
from tests import zygote
from tests.helpers import mqinfer_cmd, shared_prefix_requests, write_jsonl


@pytest.fixture(scope="module")
def data_server(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("data-redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def planes(redis_client, data_server):
    data = data_server.client()
    data.flushall()
    yield redis_client, data
    data.close()


def _chain(jobs, job_id: str) -> str:
    return jobs.hget(keys.job_key(job_id), "chain").decode()


def _step(jobs, data, job_id: str, budget_s: float = 0.2) -> None:
    run_task(jobs, job_id, _chain(jobs, job_id), budget_s=budget_s, data=data)


def _stream_keys(data, stream: str, shards: int) -> list[str]:
    """The keys of every shard's plain stream and of its registered lanes."""
    return [key for name in shard_streams(stream, shards) for key in lane_scheme.stream_keys(data, name)]


def _requests_in(data, stream_key: str) -> list[tuple[str, Request]]:
    """(entry id, request) of the requests in one stream (a lane's notice is not one)."""
    return [(entry_id.decode(), msgspec.msgpack.decode(fields[b"r"], type=Request))
            for entry_id, fields in data.xrange(stream_key) if b"r" in fields]


def _entries(data, stream: str, shards: int) -> dict[str, tuple[int, str, Request]]:
    """Request id -> (shard, entry id, request) of every request in the data server's shard streams,
    in the plain stream or in a lane of it."""
    out = {}
    for shard, name in enumerate(shard_streams(stream, shards)):
        for stream_key in lane_scheme.stream_keys(data, name):
            for entry_id, req in _requests_in(data, stream_key):
                out[req.id] = (shard, entry_id, req)
    return out


def _delete_entry(data, shard_stream: str, entry_id: str, rid: str) -> None:
    """Delete request ``rid``'s entry ``entry_id`` from the stream of ``shard_stream`` that holds it
    (the plain stream or a lane: entry ids are unique only within one stream)."""
    for stream_key in lane_scheme.stream_keys(data, shard_stream):
        if any(eid == entry_id and req.id == rid for eid, req in _requests_in(data, stream_key)):
            data.xdel(stream_key, entry_id)


def _answer(data, stream: str, shards: int, job_id: str, entries) -> None:
    """Do what an inference worker does when it acks: done set of the shard, row on the result stream."""
    for rid, (shard, entry_id, req) in entries.items():
        name = shard_streams(stream, shards)[shard]
        row = ResultRow(job_id=job_id, id=rid, model="tiny", finish_reason="length", prompt_tokens=2,
                        output_tokens=3, output_token_ids=[1, 2, 3], text="abc", finished_at=time.time(),
                        worker="w")
        data.sadd(keys.job_done_set(name, job_id), rid)
        _delete_entry(data, name, entry_id, rid)
        data.xadd(keys.job_results_stream(job_id), {"id": rid, "row": msgspec.json.encode(row), "cost_usd": "0.5"})


def _drive(jobs, data, job_id, stream, shards, until, timeout=60.0):
    deadline = time.monotonic() + timeout
    while JobStore(jobs, job_id).status() not in until:
        assert time.monotonic() < deadline, f"job stuck in {JobStore(jobs, job_id).status()}"
        _step(jobs, data, job_id)
        _answer(data, stream, shards, job_id, _entries(data, stream, shards))
    return job_info(jobs, job_id)


def test_a_job_runs_with_its_state_on_one_server_and_its_streams_sharded_on_another(planes, tmp_path):
    jobs, data = planes
    n = 40
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(n)])
    res = submit_job(jobs, src, tmp_path / "out", stream="two", shards=3, max_in_flight=16, chunk_size=8, data=data,
                     lanes="tenant,job")
    job_key = keys.job_key(res.job_id)
    assert jobs.hget(job_key, "data") == b"separate" and jobs.hget(job_key, "shards") == b"3"
    assert data.hgetall(job_key) == {b"status": b"validating", b"mirror": b"1"}  # what the workers read

    # Validate, then feed once: the requests go to the data server, each to the job's lane of its
    # shard's stream; nothing on the jobs server but the job's own state.
    for _ in range(10):
        _step(jobs, data, res.job_id)
        if _entries(data, "two", 3):
            break
    sent = _entries(data, "two", 3)
    assert 0 < len(sent) <= 16
    for rid, (shard, _, req) in sent.items():
        assert shard == shard_index(rid, res.job_id, 3) and req.job_id == res.job_id
    lane = lane_scheme.lane_name("tenant,job", "default", res.job_id)
    stream_keys = _stream_keys(data, "two", 3)
    # Every shard's stream, and the job's lane of each shard that got a request in this first feed
    # (which shards those are depends on the job id's hash).
    used = {shard for shard, _, _ in sent.values()}
    assert stream_keys == [key for i, s in enumerate(shard_streams("two", 3))
                           for key in (keys.request_stream(s),
                                       *([keys.request_stream(lane_scheme.lane_stream(s, lane))] if i in used else []))]
    assert not any(jobs.exists(key) for key in stream_keys)
    assert not any(jobs.exists(lane_scheme.registry_key(s)) for s in shard_streams("two", 3))
    in_flight = JobStore(jobs, res.job_id).inflight()
    assert set(in_flight) == set(sent)
    assert all(in_flight[rid][0] == entry_id for rid, (_, entry_id, _) in sent.items())  # ids recorded
    assert {record.lane for record in in_flight.values()} == {lane}
    assert {g["name"] for key in stream_keys for g in data.xinfo_groups(key)} == {keys.GROUP.encode()}

    info = _drive(jobs, data, res.job_id, "two", 3, until=("completed",))
    # The job's lanes went with it.
    assert not any(lane_scheme.registered(data, s) for s in shard_streams("two", 3))
    assert not any(data.exists(key) for key in stream_keys[1::2])
    assert info["counts"]["completed"] == n and info["counts"]["in_flight"] == 0
    assert info["cost_usd"] == pytest.approx(0.5 * n)
    out = pq.read_table(tmp_path / "out" / "output.parquet").to_pylist()
    assert [r["id"] for r in out] == [f"r{i}" for i in range(n)]  # input order
    # The end of the job: its mirror says so (and expires), its result stream is gone.
    assert data.hget(job_key, "status") == b"completed" and 0 < data.ttl(job_key)
    assert not data.exists(keys.job_results_stream(res.job_id))
    assert not jobs.exists(keys.job_results_stream(res.job_id))


class _DataLostAfterThePlan:
    """The data server, except that the first pipeline of XADDs (a feed's entries) never reaches it."""

    def __init__(self, real) -> None:
        self.real = real
        self.failed = False

    def pipeline(self, *args, **kwargs):
        pipe = self.real.pipeline(*args, **kwargs)
        execute = pipe.execute

        def lost_if_feeding(*a, **k):
            if not self.failed and any(str(cmd[0]).upper() == "XADD" for cmd, _ in pipe.command_stack):
                self.failed = True
                raise redis.exceptions.ConnectionError("injected: the data server went away mid-feed")
            return execute(*a, **k)

        pipe.execute = lost_if_feeding
        return pipe

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_feed_cut_between_the_two_servers_is_sent_again_by_the_reconcile(planes, tmp_path, shards):
    """With two shards, routed by prefix: requests of two prefixes, each of which goes to one shard,
    are sent again to the shard noted when they were planned, not to their ids' shard."""
    jobs, data = planes
    n = 8
    items = [{"id": f"r{i}", "prompt": "x"} for i in range(n)] if shards == 1 else shared_prefix_requests(n // 2)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    res = submit_job(jobs, src, tmp_path / "out", stream="cut", shards=shards, max_in_flight=n, data=data,
                     lanes="job")
    store = JobStore(jobs, res.job_id)
    flaky = _DataLostAfterThePlan(data)
    with pytest.raises(redis.exceptions.ConnectionError, match="injected"):  # validates, then feeds
        run_task(jobs, res.job_id, _chain(jobs, res.job_id), budget_s=5.0, data=flaky)
    assert store.status() == "in_progress"
    # Noted in flight with no entry id, and nothing in the stream: the feed cursor moved past them.
    in_flight = store.inflight()
    assert sorted(in_flight) == sorted(d["id"] for d in items) and {v[0] for v in in_flight.values()} == {"-"}
    assert not _entries(data, "cut", shards)
    assert "ConnectionError" in job_info(jobs, res.job_id)["last_task_error"]
    planned = {rid: record.shard for rid, record in in_flight.items()}
    # Each noted with the job's lane of its shard's stream, registered before the cut.
    assert {record.lane for record in in_flight.values()} == {lane_scheme.lane_name("job", "default", res.job_id)}
    if shards > 1:  # each prefix on its shard, where a hash of these ids would not put them
        assert len({planned[d["id"]] for d in items[0::2]}) == len({planned[d["id"]] for d in items[1::2]}) == 1
        assert planned != {rid: shard_index(rid, res.job_id, shards) for rid in planned}

    _step(jobs, data, res.job_id)  # within the reconcile interval: nothing is sent yet
    assert not _entries(data, "cut", shards)
    jobs.hset(keys.job_key(res.job_id), "reconciled_at", "1")  # the interval has passed
    _step(jobs, data, res.job_id)
    sent = _entries(data, "cut", shards)
    assert sorted(sent) == sorted(d["id"] for d in items)
    assert {rid: shard for rid, (shard, _, _) in sent.items()} == planned
    assert jobs.hget(keys.job_key(res.job_id), "refed") == str(n).encode()
    assert {v[0] for v in store.inflight().values()} == {entry_id for _, entry_id, _ in sent.values()}
    info = _drive(jobs, data, res.job_id, "cut", shards, until=("completed",))
    assert info["counts"]["completed"] == n


def test_cancel_reaches_the_workers_through_the_mirror(planes, tmp_path):
    jobs, data = planes
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(4)])
    res = submit_job(jobs, src, tmp_path / "out", stream="cx", data=data)
    job_key = keys.job_key(res.job_id)
    # `jobs cancel` with only the jobs server: the job's next task tells the workers.
    assert cancel_job(jobs, res.job_id) == "cancelling"
    assert data.hget(job_key, "status") == b"validating"
    _step(jobs, data, res.job_id)
    assert jobs.hget(job_key, "status") == b"cancelled"
    assert data.hget(job_key, "status") == b"cancelled"
    # With the data server given, the workers see `cancelling` at once.
    res2 = submit_job(jobs, src, tmp_path / "out2", stream="cx", data=data)
    assert cancel_job(jobs, res2.job_id, data=data) == "cancelling"
    assert data.hget(keys.job_key(res2.job_id), "status") == b"cancelling"


def test_a_worker_without_the_data_server_refuses_a_two_server_job(planes, tmp_path):
    jobs, data = planes
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    res = submit_job(jobs, src, tmp_path / "out", stream="nod", data=data)
    with pytest.raises(RuntimeError, match="--jobs-redis"):
        run_task(jobs, res.job_id, _chain(jobs, res.job_id))


def test_cli_needs_a_plain_jobs_server_beside_a_cluster(redis_url, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    common = dict(capture_output=True, text=True, timeout=60)
    proc = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "o"), "--redis", redis_url,
                                  "--redis-cluster"), **common)
    assert proc.returncode == 2 and "rq cannot run on a Redis Cluster" in proc.stderr
    proc = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "o"),
                                  "--jobs-redis", redis_url), **common)
    assert proc.returncode == 2 and "--redis is required" in proc.stderr
    proc = zygote.run(mqinfer_cmd("jobs", "list"), **common)
    assert proc.returncode == 2 and "--jobs-redis (or --redis)" in proc.stderr
    proc = zygote.run(mqinfer_cmd("jobs", "submit", "--help"), **common)
    assert proc.returncode == 0 and "--jobs-redis" in proc.stdout and "--shards" in proc.stdout


class _Unreachable:
    """A data server that is down (a restart, a failover): every call fails to connect."""

    def __getattr__(self, name):
        def down(*_a, **_k):
            raise redis.exceptions.ConnectionError("injected: connection refused")
        return down


def test_an_unreachable_data_server_is_waited_out_not_failed(planes, tmp_path):
    jobs, data = planes
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(3)])
    res = submit_job(jobs, src, tmp_path / "out", stream="down", data=data)
    _step(jobs, data, res.job_id, budget_s=0.05)  # validates (the spool, no data server needed)
    for _ in range(7):  # more than the failures that end a job for any other reason
        with pytest.raises(redis.exceptions.ConnectionError):
            run_task(jobs, res.job_id, _chain(jobs, res.job_id), budget_s=0.2, data=_Unreachable())
    info = job_info(jobs, res.job_id)
    assert info["status"] == "in_progress" and "connection refused" in info["last_task_error"]
    assert _drive(jobs, data, res.job_id, "down", 1, until=("completed",))["counts"]["completed"] == 3
