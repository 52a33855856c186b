"""Bulk jobs in lanes: each job's requests wait in a stream of their own (``--lanes``), the job's
lanes go when it ends, and a job submitted behind a large one is fed and read at once.

Real `mqinfer jobs worker` (rq) and `mqinfer worker --model tiny` processes on the embedded server
where workers matter; the rq task run in this process (the test answering for the workers) where
they do not."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from mqinfer import jobs_cli as cli
from mqinfer.ops import job_run
from mqinfer.ops.job_lanes import DEFAULT_JOB_LANES
from mqinfer.ops.job_store import JobStore
from mqinfer.ops.job_tasks import run_task
from mqinfer.ops.jobs import cancel_job, job_info, submit_job
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as lane_scheme
from tests.helpers import mqinfer_cmd, stop_processes, wait_until, write_jsonl
from tests.ops.test_jobs_pipeline import jobs_cli, native, output, start, start_inference, start_rq, wait_final
from tests.ops.test_jobs_two_servers import _answer, _chain, _entries, _requests_in


def _lane_key(stream: str, lane: str) -> str:
    return keys.request_stream(lane_scheme.lane_stream(stream, lane))


# -- with real workers -----------------------------------------------------------------------
@dataclass
class Env:
    url: str
    client: object
    base: Path


@pytest.fixture(scope="module")
def env(redis_server, tmp_path_factory):
    client = redis_server.client()
    client.flushall()
    base = tmp_path_factory.mktemp("lanes")
    (base / "wout").mkdir()
    # An inference worker with every setting at its default, and one rq worker: one
    # `mqinfer jobs worker` serves every job's tasks in turn.
    worker = start(mqinfer_cmd("worker", "--redis", redis_server.url, "--out", str(base / "wout")), base / "w.log")
    rq = start_rq(redis_server.url, base / "rq.log")
    yield Env(redis_server.url, client, base)
    # An rq worker sometimes waits out its pubsub thread's 60-second poll when stopped; its jobs
    # are over by then, so it is not waited for long.
    stop_processes(rq, worker, timeout=5)
    client.close()


def test_a_job_with_lanes_job_waits_in_its_lane_and_its_lane_goes_when_it_ends(env):
    n = 12
    src = write_jsonl(env.base / "a.jsonl", native(n, "a", max_tokens=4))
    done = jobs_cli("submit", str(src), "--out", str(env.base / "a"), "--redis", env.url, "--stream", "lanesa",
                    "--lanes", "job", "--json")
    assert done.returncode == 0, done.stderr
    job_id = json.loads(done.stdout)["job_id"]
    lane = lane_scheme.lane_name("job", "default", job_id)
    lane_key = _lane_key("lanesa", lane)
    # No inference worker reads stream `lanesa` yet: every request waits in the job's lane.
    wait_until(lambda: env.client.xlen(lane_key) == n, timeout=60, what="the job's requests in its lane")
    assert sorted(req.id for _, req in _requests_in(env.client, lane_key)) == sorted(f"a{i}" for i in range(n))
    assert lane_scheme.registered(env.client, "lanesa") == [lane]
    plain = keys.request_stream("lanesa")
    assert [fields for _, fields in env.client.xrange(plain)] == [{b"lane": lane.encode()}]  # the notice
    assert {record.lane for record in JobStore(env.client, job_id).inflight().values()} == {lane}
    assert job_info(env.client, job_id)["lanes"] == "job"

    worker = start_inference(env.url, env.base / "wa", "--stream", "lanesa")
    try:
        info = wait_final(env.client, job_id, timeout=120)
    finally:
        stop_processes(worker)
    assert info["status"] == "completed" and info["counts"]["completed"] == n
    got = output(env.base / "a")
    assert [r["id"] for r in got] == [f"a{i}" for i in range(n)]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 4 for r in got)
    # The job's lane went with it: out of the registry, its stream emptied. (A worker blocked on the
    # lane when it is deleted may make the empty stream again before it reads the registry anew.)
    assert lane_scheme.registered(env.client, "lanesa") == []
    assert env.client.xlen(lane_key) == 0
    assert not env.client.exists(JobStore(env.client, job_id).lanes_key)


def test_an_8_line_job_submitted_behind_a_100_line_job_finishes_first(env):
    """An 8-line job submitted while a 100-line job runs, through the one rq worker and the one
    inference worker, each with its default settings (`jobs submit`'s lanes: a lane per job). All
    100 requests run at once (they fit the engine's default 256 sequences), so a request of the
    small job as long as theirs, started a moment later, would end a moment later: its requests
    are shorter, as an interactive job's beside a bulk one. It ends first only if it is fed at
    once, not once the rq worker is done waiting on the large job's rows."""
    stream_key = keys.request_stream("requests")
    wait_until(lambda: env.client.exists(stream_key) and env.client.xinfo_consumers(stream_key, keys.GROUP),
               timeout=120, what="the inference worker to read the stream")
    big_src = write_jsonl(env.base / "big.jsonl", native(100, "big", max_tokens=96, ignore_eos=True))
    small_src = write_jsonl(env.base / "small.jsonl", native(8, "small", max_tokens=16, ignore_eos=True))
    big = submit_job(env.client, big_src, env.base / "big", lanes=DEFAULT_JOB_LANES).job_id
    wait_until(lambda: job_info(env.client, big)["counts"]["fed"] == 100, timeout=60, what="the large job fed")
    small = submit_job(env.client, small_src, env.base / "small", lanes=DEFAULT_JOB_LANES).job_id

    info_small, info_big = wait_final(env.client, small, timeout=120), wait_final(env.client, big, timeout=120)
    assert info_small["status"] == info_big["status"] == "completed"
    assert info_small["ended_at"] < info_big["ended_at"], (info_small["ended_at"], info_big["ended_at"])
    small_rows, big_rows = output(env.base / "small"), output(env.base / "big")
    assert len(small_rows) == 8 and len(big_rows) == 100
    assert all(r["finish_reason"] == "length" for r in small_rows + big_rows)
    # Fed at once: the small job's requests entered their lane before any of the large job's ended.
    assert max(r["enqueued_at"] for r in small_rows) < min(r["finished_at"] for r in big_rows)
    for job_id in (big, small):
        assert lane_scheme.lane_name("tenant,job", "default", job_id) not in lane_scheme.registered(
            env.client, "requests")


# -- the rq task in this process -------------------------------------------------------------
# The jobs below are submitted to a queue of their own: the module's `mqinfer jobs worker` (the
# `env` fixture's, running until the module ends) serves the default queue, and would take their
# next tasks and advance them beside this process, holding a job's lock while it waits for rows.
QUEUE = "lanes-in-process"


def _submit(client, src, out, stream: str, lanes: str, **kw) -> str:
    return submit_job(client, src, out, stream=stream, lanes=lanes, queue_name=QUEUE, **kw).job_id


def _step(client, job_id: str) -> None:
    """One task of the job, run here; no one else advances it."""
    done = run_task(client, job_id, _chain(client, job_id), queue_name=QUEUE, budget_s=0.2)
    assert "another task is advancing it" not in done, done


def _run(client, job_id: str, stream: str, until: tuple[str, ...] = ("completed",), answer: bool = True,
         steps: int = 200) -> dict:
    for _ in range(steps):
        if JobStore(client, job_id).status() in until:
            return job_info(client, job_id)
        _step(client, job_id)
        if answer:
            _answer(client, stream, 1, job_id, _entries(client, stream, 1))
    raise AssertionError(f"job {job_id} stuck in {JobStore(client, job_id).status()}")


def test_a_job_registered_without_lanes_fields_feeds_the_plain_stream(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", native(5, "o"))
    job_id = _submit(redis_client, src, tmp_path / "out", "old", "tenant,job")
    redis_client.hdel(keys.job_key(job_id), "lanes", "max_lanes")  # as registered before lanes
    _run(redis_client, job_id, "old", until=("in_progress",), answer=False)
    _step(redis_client, job_id)
    assert sorted(req.id for _, req in _requests_in(redis_client, keys.request_stream("old"))) == [
        f"o{i}" for i in range(5)]
    assert lane_scheme.registered(redis_client, "old") == []
    assert {record.lane for record in JobStore(redis_client, job_id).inflight().values()} == {None}
    info = _run(redis_client, job_id, "old")
    assert info["counts"]["completed"] == 5 and info["lanes"] == "none"
    assert [r["id"] for r in output(tmp_path / "out")] == [f"o{i}" for i in range(5)]


def test_a_cancelled_jobs_lane_that_still_holds_requests_stays(redis_client, tmp_path, monkeypatch):
    monkeypatch.setattr(job_run, "END_GRACE_S", 0.0)  # no worker will end its requests
    src = write_jsonl(tmp_path / "in.jsonl", native(4, "c"))
    job_id = _submit(redis_client, src, tmp_path / "out", "cstay", "job")
    _run(redis_client, job_id, "cstay", until=("in_progress",), answer=False)
    _step(redis_client, job_id)
    lane = lane_scheme.lane_name("job", "default", job_id)
    assert redis_client.xlen(_lane_key("cstay", lane)) == 4
    assert cancel_job(redis_client, job_id) == "cancelling"
    info = _run(redis_client, job_id, "cstay", until=("cancelled",), answer=False)
    assert info["counts"]["cancelled"] == 4
    # Unread requests keep the lane (the workers end them as cancelled and remove it once idle).
    assert lane_scheme.registered(redis_client, "cstay") == [lane]
    assert redis_client.xlen(_lane_key("cstay", lane)) == 4


def test_past_max_lanes_a_job_uses_a_shared_lane_which_stays_when_it_ends(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", native(3, "s"))
    job_id = _submit(redis_client, src, tmp_path / "out", "full", "job", max_lanes=1)
    _run(redis_client, job_id, "full", until=("in_progress",), answer=False)
    _step(redis_client, job_id)
    shared = lane_scheme.shared_lane(lane_scheme.lane_name("job", "default", job_id), 1)
    assert {record.lane for record in JobStore(redis_client, job_id).inflight().values()} == {shared}
    assert redis_client.xlen(_lane_key("full", shared)) == 3
    assert _run(redis_client, job_id, "full")["counts"]["completed"] == 3
    assert lane_scheme.registered(redis_client, "full") == [shared]  # not the job's own: it stays


# -- the command line ------------------------------------------------------------------------
def _submitted_lanes(client, *argv: str) -> tuple[bytes, bytes]:
    parser = cli.argparse.ArgumentParser()
    cli._add_subcommands(parser)
    assert cli.run(parser.parse_args(["submit", *argv])) == 0
    job_id = client.zrevrange("mqinfer:jobs", 0, 0)[0].decode()
    return tuple(client.hmget(keys.job_key(job_id), "lanes", "max_lanes"))


def test_jobs_submit_takes_lanes_from_flags_environment_and_config(redis_url, redis_client, tmp_path, monkeypatch,
                                                                    capsys):
    src = write_jsonl(tmp_path / "in.jsonl", native(1, "x"))
    for name in ("MQINFER_LANES", "MQINFER_MAX_LANES", "MQINFER_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def submit(out: str, *extra: str) -> tuple[bytes, bytes]:
        return _submitted_lanes(redis_client, str(src), "--out", str(tmp_path / out), "--redis", redis_url, *extra)

    assert submit("d") == (b"tenant,job", b"64")  # a lane per job by default
    assert submit("f", "--lanes", "job,tenant", "--max-lanes", "9") == (b"tenant,job", b"9")
    config = tmp_path / "mq.toml"
    config.write_text('[jobs]\nlanes = "none"\nmax-lanes = 7\n')
    assert submit("c", "--config", str(config)) == (b"none", b"7")
    monkeypatch.setenv("MQINFER_LANES", "job")
    monkeypatch.setenv("MQINFER_MAX_LANES", "5")
    assert submit("e", "--config", str(config)) == (b"job", b"5")  # environment over the config file
    capsys.readouterr()
    parser = cli.argparse.ArgumentParser()
    cli._add_subcommands(parser)
    bad = parser.parse_args(["submit", str(src), "--out", str(tmp_path / "b"), "--redis", redis_url,
                             "--lanes", "per-request"])
    assert cli.run(bad) == 2 and "--lanes" in capsys.readouterr().err
    bad = parser.parse_args(["submit", str(src), "--out", str(tmp_path / "b"), "--redis", redis_url,
                             "--max-lanes", "0"])
    assert cli.run(bad) == 2 and "--max-lanes" in capsys.readouterr().err
