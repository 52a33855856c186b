"""A real three-node Redis Cluster from the packaged server binary: sharded request streams, the
client across slots, a worker serving from the cluster, and (``-m slow``) whole jobs across the
cluster through a node restart."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pyarrow.parquet as pq
import pytest
import redis

from mqinfer.schemas import keys
from mqinfer.client import Client, ReplyWriter, cancel_key, cancel_member
from mqinfer.schemas.connection import connect_redis
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.cluster import LocalCluster
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import decode_entry
from mqinfer.ops.jobs import job_info
from mqinfer.server import EmbeddedServer
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, start_worker, stop_processes, wait_exit, wait_until, write_jsonl


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=3).start()
    yield c
    c.stop()


def test_shard_names_and_the_stable_hash():
    assert shard_streams("requests", 1) == ["requests"]
    assert shard_streams("s", 3) == ["s-0", "s-1", "s-2"]
    with pytest.raises(ValueError, match="shards"):
        shard_streams("s", 0)
    assert shard_index("abc", None, 1) == 0
    spread = [shard_index(f"r{i}", "job", 4) for i in range(400)]
    assert spread == [shard_index(f"r{i}", "job", 4) for i in range(400)]
    assert min(spread.count(k) for k in range(4)) > 60
    with pytest.raises(ValueError, match="cluster seed"):
        connect_redis("unix:///tmp/x.sock", cluster=True)


def test_default_shards_live_on_different_nodes(cluster):
    nodes = {cluster.node_for_key(keys.request_stream(s)) for s in shard_streams("requests", 3)}
    assert nodes == {0, 1, 2}
    # A stream's dead letters, done sets and cancel set share its slot (acks need no cross-slot MULTI).
    slot = redis.cluster.key_slot
    for s in shard_streams("requests", 3):
        stream_slot = slot(keys.request_stream(s).encode())
        for key in (keys.dead_letter_stream(s), keys.job_done_set(s, "j"), cancel_key(s)):
            assert slot(key.encode()) == stream_slot


def test_client_submits_across_slots_and_reads_replies(cluster):
    with Client(cluster.url, cluster=True, stream="cl", shards=3) as client:
        client.submit_many([{"id": f"c{i}", "prompt": "x"} for i in range(60)])
        direct = cluster.client()
        counts = [direct.xlen(k) for k in client.stream_keys]
        assert sum(counts) == 60 and min(counts) > 5
        for shard, key in enumerate(client.stream_keys):
            for _, fields in direct.xrange(key):
                req = decode_entry(fields)
                assert shard_index(req.id, None, 3) == shard and req.reply_to == client.reply_to
        writer = ReplyWriter("w")
        writer.delta(client.reply_to, "c7", None, [104], "h", 0, 1)
        writer.final(client.reply_to, ResultRow(id="c7", model="tiny", finish_reason="length", finished_at=1.0,
                                                worker="w", text="h", output_token_ids=[104], output_tokens=1))
        writer.send(direct)
        assert [e.type for e in client.stream("c7", timeout=10)] == ["delta", "final"]
        client.cancel("c9")
        shard = shard_index("c9", None, 3)
        assert direct.zscore(cancel_key(f"cl-{shard}"), cancel_member("c9", None)) is not None
        direct.close()


def test_a_worker_on_the_cluster_computes_acks_and_bills_every_request(cluster, tmp_path):
    """The short version of the jobs below: one worker on one stream of the cluster, no restart."""
    n = 6
    with Client(cluster.url, cluster=True, stream="one") as client:
        client.submit_many([{"id": f"o{i}", "prompt_token_ids": [256] + [65 + i] * 3, "max_tokens": 8,
                             "ignore_eos": True, "temperature": 0.0} for i in range(n)], job_id="j1")
    out = tmp_path / "out"
    worker = start_worker(cluster.url, out, "--redis-cluster", "--stream", "one", "--num-threads", "1",
                          "--num-kv-blocks", "256", "--flush-interval-s", "0.1", "--idle-exit-s", "1.5")
    code, err = wait_exit(worker, timeout=120)
    assert code == 0, err[-4000:]
    results = rows(out / "results")
    assert sorted(r["id"] for r in results) == sorted(f"o{i}" for i in range(n))
    assert all(r["output_tokens"] == 8 and r["finish_reason"] == "length" for r in results)
    billed = [c["id"] for c in rows(out / "costs") if c["kind"] == "request"]
    assert sorted(billed) == sorted(f"o{i}" for i in range(n))
    direct = cluster.client()
    stream = keys.request_stream("one")
    assert direct.xlen(stream) == 0 and direct.xpending(stream, keys.GROUP)["pending"] == 0
    assert direct.scard(keys.job_done_set("one", "j1")) == n
    direct.close()


def test_lanes_on_the_cluster_each_in_its_own_slot_and_all_served(cluster, tmp_path):
    """Lanes of three tenants and the plain stream: each lane's keys share the lane's slot (its
    ack is one transaction there), the worker reads them all, and every request has one row."""
    from mqinfer.schemas import lanes as scheme

    tenants = ["default", "red", "green", "blue"]
    with Client(cluster.url, cluster=True, stream="ln") as client:
        client.submit_many([{"id": f"{t}{i}", "prompt_token_ids": [256, 65 + i], "max_tokens": 4, "tenant": t,
                             "ignore_eos": True, "temperature": 0.0} for t in tenants for i in range(3)],
                           job_id="jl", reply=False)
    direct = cluster.client()
    names = scheme.registered(direct, "ln")
    assert len(names) == 3
    slot = redis.cluster.key_slot
    for name in names:
        lane_stream = scheme.lane_stream("ln", name)
        stream_slot = slot(keys.request_stream(lane_stream).encode())
        for key in (keys.inflight_hash(lane_stream), keys.idempotency_key(lane_stream, "jl", "x")):
            assert slot(key.encode()) == stream_slot
    out = tmp_path / "out"
    worker = start_worker(cluster.url, out, "--redis-cluster", "--stream", "ln", "--num-threads", "1",
                          "--num-kv-blocks", "256", "--flush-interval-s", "0.1", "--idle-exit-s", "2")
    code, err = wait_exit(worker, timeout=120)
    assert code == 0, err[-4000:]
    assert sorted(r["id"] for r in rows(out / "results")) == sorted(f"{t}{i}" for t in tenants for i in range(3))
    for key in scheme.stream_keys(direct, "ln"):
        assert direct.xlen(key) == 0 and direct.xpending(key, keys.GROUP)["pending"] == 0
    assert direct.scard(keys.job_done_set("ln", "jl")) == 12
    direct.close()


@pytest.mark.slow
def test_a_job_runs_across_the_cluster_through_a_node_restart(cluster, tmp_path):
    n = 36
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"j{i}", "prompt_token_ids": [256] + [65 + i % 26] * 4, "max_tokens": 32, "ignore_eos": True,
         "temperature": 0.0} for i in range(n)])
    out = tmp_path / "out"
    proc = zygote.popen(
        mqinfer_cmd("run", str(src), "--out", str(out), "--redis", cluster.url, "--redis-cluster",
                "--stream", "job", "--shards", "3", "--workers", "3", "--num-threads", "1",
                "--max-num-seqs", "4", "--flush-interval-s", "0.1", "--claim-idle-ms", "2000"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    outputs: dict[str, str] = {}
    reader = threading.Thread(target=lambda: outputs.update(zip(("out", "err"), proc.communicate())))
    reader.start()
    try:
        wait_until(lambda: len(rows(out / "results")) >= 6 or proc.poll() is not None, timeout=180,
                   what="the job under way")
        assert proc.poll() is None, "the job ended before the restart"
        victim = cluster.node_for_key(keys.request_stream("job-1"))
        cluster.restart_node(victim, down_s=1.0)
        restarted_at = time.monotonic()
        reader.join(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join()
    assert proc.returncode == 0, outputs.get("err", "")[-4000:]
    assert f"{n} of {n} requests have rows: {n} length\n" in outputs["out"]
    results = rows(out / "results")  # compacted by `run`: one row per request
    assert sorted(r["id"] for r in results) == sorted(f"j{i}" for i in range(n))
    assert all(r["output_tokens"] == 32 for r in results)
    assert len({r["worker"] for r in results}) == 3  # every shard had its worker
    assert time.monotonic() - restarted_at < 240
    direct = cluster.client()
    for s in shard_streams("job", 3):
        assert direct.xlen(keys.request_stream(s)) == 0
    direct.close()


@pytest.mark.slow
def test_a_bulk_job_with_its_queue_on_a_plain_server_runs_across_the_cluster_through_a_node_restart(
        cluster, tmp_path):
    """`mqinfer jobs` beside a cluster: rq and the job state on a plain server (--jobs-redis), the
    requests on three shards of the cluster, one inference worker per shard, a node restarted mid-job."""
    n = 30
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"b{i}", "prompt_token_ids": [256] + [66 + i % 20] * 3, "max_tokens": 24, "ignore_eos": True,
         "temperature": 0.0} for i in range(n)])
    jobs_server = EmbeddedServer(tmp_path / "jobs-redis", appendonly=False).start()
    planes = ["--jobs-redis", jobs_server.url, "--redis", cluster.url, "--redis-cluster"]
    env = dict(os.environ, MQINFER_LOG_LEVEL="warning", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []

    def spawn(args, log):
        with open(tmp_path / log, "ab") as f:
            procs.append(zygote.popen(mqinfer_cmd(*args), env=env, stdin=subprocess.DEVNULL, stdout=f,
                                      stderr=subprocess.STDOUT))

    jobs = jobs_server.client()
    try:
        for i in range(3):
            spawn(["worker", "--redis", cluster.url, "--redis-cluster", "--stream", f"bulk-{i}",
                   "--out", str(tmp_path / f"w{i}"), "--num-threads", "1", "--max-num-seqs", "4",
                   "--num-kv-blocks", "256", "--flush-interval-s", "0.1", "--claim-idle-ms", "2000"], f"w{i}.log")
        spawn(["jobs", "worker", *planes, "--sweep-interval-s", "0.5"], "rq.log")
        submitted = zygote.run(mqinfer_cmd("jobs", "submit", str(src), "--out", str(tmp_path / "out"), *planes,
                                           "--stream", "bulk", "--shards", "3", "--max-in-flight", "12",
                                           "--json"), capture_output=True, text=True, timeout=60, env=env)
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]
        wait_until(lambda: job_info(jobs, job_id)["counts"]["completed"] >= 5, timeout=180, interval=0.2,
                   what="the job under way")
        victim = cluster.node_for_key(keys.request_stream("bulk-1"))
        cluster.restart_node(victim, down_s=1.0)
        def ended():
            info = job_info(jobs, job_id)
            return info if info["status"] in ("completed", "failed") else None

        info = wait_until(ended, timeout=300, interval=0.3, what="the job to end")
        assert info["status"] == "completed", (info, (tmp_path / "rq.log").read_text()[-3000:])
        assert info["counts"]["completed"] == n
        out = pq.read_table(tmp_path / "out" / "output.parquet").to_pylist()
        assert [r["id"] for r in out] == [f"b{i}" for i in range(n)]
        assert all(r["output_tokens"] == 24 and r["finish_reason"] == "length" for r in out)
        assert len({r["worker"] for r in out}) == 3  # every shard's worker computed some of it
        # Nothing of the job's orchestration on the cluster but its streams and the status mirror.
        direct = cluster.client()
        assert direct.hget(keys.job_key(job_id), "status") == b"completed"
        assert not direct.exists(keys.job_results_stream(job_id))
        for s in shard_streams("bulk", 3):
            assert direct.xlen(keys.request_stream(s)) == 0
        direct.close()
        assert jobs.exists(keys.job_key(job_id)) and not jobs.exists(keys.request_stream("bulk-0"))
    finally:
        stop_processes(*procs)
        jobs.close()
        jobs_server.stop()
