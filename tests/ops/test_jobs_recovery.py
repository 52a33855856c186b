"""Bulk jobs survive crashes: kill the rq worker and the inference worker mid-job, or lose the
server's data, then start again; every input line gets exactly one output row and what already had
a row is not computed again.

The cases with the server losing its data or killed are long (``-m slow``); the default run has the
kill of both workers here, a lost server's data with the tasks run in this process, and the Redis
kill -9 and restart from its append-only file in tests/faults/test_redis_faults.py."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mqinfer.ops.job_store import JobStore
from mqinfer.ops.jobs import job_info, submit_job
from mqinfer.server import EmbeddedServer
from tests.helpers import kill_tree, rows, shared_prefix_requests, stop_processes, wait_until, write_jsonl
from tests.ops.test_jobs_pipeline import (
    jobs_cli, native, output, start_inference, start_rq, wait_final,
)
from tests.ops.test_jobs_two_servers import _answer, _entries, _step


def _spooled_ids(out: Path) -> set[str]:
    parts = list((out / ".mqinfer-job" / "rows").glob("part-*.parquet"))
    return {i for p in parts for i in pq.read_table(p, columns=["id"])["id"].to_pylist()}


def test_kill_rq_worker_and_inference_worker_mid_job_then_resume(redis_url, redis_client, tmp_path):
    n = 24
    src = write_jsonl(tmp_path / "in.jsonl", native(n, "k", max_tokens=12, ignore_eos=True))
    procs = [start_inference(redis_url, tmp_path / "w1", "--max-num-seqs", "4"),
             start_rq(redis_url, tmp_path / "rq1.log")]
    try:
        job_id = submit_job(redis_client, src, tmp_path / "out", max_in_flight=6, lease_s=2.0).job_id
        wait_until(lambda: job_info(redis_client, job_id)["counts"]["completed"] >= 6, timeout=120,
                   what="some collected rows")
        store = JobStore(redis_client, job_id)
        wait_until(lambda: redis_client.exists(store.lock_key), timeout=30, what="a task running")
        kill_tree(procs[1])  # the rq worker and its work horse, mid-task: the task is lost
        procs[0].kill()
        procs[0].wait()
        before = _spooled_ids(tmp_path / "out")
        assert len(before) >= 6
        assert job_info(redis_client, job_id)["status"] == "in_progress"
        procs += [start_inference(redis_url, tmp_path / "w2"), start_rq(redis_url, tmp_path / "rq2.log")]
        info = wait_final(redis_client, job_id, timeout=150)
    finally:
        stop_processes(*procs)
    assert info["status"] == "completed"
    got = output(tmp_path / "out")
    assert [r["id"] for r in got] == [f"k{i}" for i in range(n)]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 12 for r in got)
    assert info["counts"]["fed"] == n and info["counts"]["skipped"] == 0
    assert JobStore(redis_client, job_id).load().get("refed", 0) == 0
    recomputed = {r["id"] for r in rows(tmp_path / "w2" / "results")}
    assert not recomputed & before  # what had a row was not computed again
    assert "task chain had stopped; started a new one" in (tmp_path / "rq2.log").read_text()


@pytest.mark.parametrize("shards", [1, 2])
def test_a_lost_servers_job_resumes_from_its_spool_with_the_tasks_in_process(redis_client, tmp_path, shards):
    """The short version of the next case: the rq tasks run here, the test answers for the workers.
    With two shards the requests are routed by their prefixes, in prefix order: the rows kept are
    noted done in their ids' shards, and still skipped."""
    n = 12
    items = native(n, "q") if shards == 1 else shared_prefix_requests(n // 2)
    ids = [d["id"] for d in items]
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"

    def step(job_id: str) -> set[str]:
        sent = _entries(redis_client, "lost", shards)
        _answer(redis_client, "lost", shards, job_id, sent)
        _step(redis_client, redis_client, job_id)
        return set(sent)

    job_id = submit_job(redis_client, src, out, stream="lost", shards=shards, max_in_flight=4).job_id
    deadline = time.monotonic() + 60
    while len(_spooled_ids(out)) < 4:
        assert time.monotonic() < deadline, "no rows reached the spool"
        step(job_id)
    kept = _spooled_ids(out)
    assert len(kept) < n
    redis_client.flushall()  # the server lost everything: job hash, streams, queue

    again = submit_job(redis_client, src, out, stream="lost", shards=shards, max_in_flight=4)
    assert (again.job_id, again.resumed, again.adopted_rows) == (job_id, True, len(kept))
    sent_again = set()
    while job_info(redis_client, job_id)["status"] != "completed":
        assert time.monotonic() < deadline, f"job stuck in {job_info(redis_client, job_id)['status']}"
        sent_again |= step(job_id)
    info = job_info(redis_client, job_id)
    assert [r["id"] for r in output(out)] == ids
    assert info["counts"]["skipped"] == len(kept) and info["counts"]["fed"] == n - len(kept)
    assert sent_again == set(ids) - kept  # what had a row was not sent again


@pytest.mark.slow
def test_server_that_lost_its_data_resumes_from_the_spool(redis_url, redis_client, tmp_path):
    n = 16
    src = write_jsonl(tmp_path / "in.jsonl", native(n, "d", max_tokens=8, ignore_eos=True))
    out = tmp_path / "out"
    procs = [start_inference(redis_url, tmp_path / "w1", "--max-num-seqs", "4"),
             start_rq(redis_url, tmp_path / "rq1.log")]
    try:
        job_id = submit_job(redis_client, src, out, max_in_flight=4).job_id
        wait_until(lambda: len(_spooled_ids(out)) >= 5, timeout=120, what="rows in the spool")
        kill_tree(procs[1])
        procs[0].kill()
        procs[0].wait()
        kept = _spooled_ids(out)
        redis_client.flushall()  # the server lost everything: job hash, streams, queue

        again = jobs_cli("submit", str(src), "--out", str(out), "--redis", redis_url, "--max-in-flight", "4")
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip() == job_id
        assert f"{len(kept)} rows already in" in again.stderr
        procs += [start_inference(redis_url, tmp_path / "w2"), start_rq(redis_url, tmp_path / "rq2.log")]
        info = wait_final(redis_client, job_id, timeout=150)
    finally:
        stop_processes(*procs)
    assert info["status"] == "completed"
    got = output(out)
    assert [r["id"] for r in got] == [f"d{i}" for i in range(n)]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 8 for r in got)
    assert info["counts"]["skipped"] == len(kept) and info["counts"]["fed"] == n - len(kept)
    assert not {r["id"] for r in rows(tmp_path / "w2" / "results")} & kept


@pytest.mark.slow
def test_server_killed_and_restarted_from_its_append_only_file(tmp_path):
    n = 16
    server = EmbeddedServer(tmp_path / "redis", appendonly=True).start()
    port, password = server.port, server.password
    client = server.client()
    src = write_jsonl(tmp_path / "in.jsonl", native(n, "s", max_tokens=8, ignore_eos=True))
    out = tmp_path / "out"
    procs = [start_inference(server.url, tmp_path / "w1", "--max-num-seqs", "4"),
             start_rq(server.url, tmp_path / "rq1.log")]
    try:
        job_id = submit_job(client, src, out, max_in_flight=4, lease_s=2.0).job_id
        wait_until(lambda: job_info(client, job_id)["counts"]["completed"] >= 4, timeout=120, what="some rows")
        server.process.kill()  # no shutdown, no final fsync
        server.process.wait()
        server.process = None
        # The outage lasts on purpose, so that the workers and rq meet a server that is gone.
        time.sleep(1.0)
        server = EmbeddedServer(tmp_path / "redis", port=port, password=password, appendonly=True).start()
        client = server.client()
        assert job_info(client, job_id)["counts"]["completed"] >= 4  # the job survived in the file
        # Whatever died with the server starts again.
        for i, proc in enumerate(list(procs)):
            if proc.poll() is not None:
                procs.append(start_inference(server.url, tmp_path / f"w{i + 2}") if i == 0
                             else start_rq(server.url, tmp_path / f"rq{i + 2}.log"))
        info = wait_final(client, job_id, timeout=150)
    finally:
        stop_processes(*procs)
        server.stop()
    assert info["status"] == "completed"
    got = output(out)
    assert [r["id"] for r in got] == [f"s{i}" for i in range(n)]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 8 for r in got)
