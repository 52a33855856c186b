"""Lanes through a real worker: no head-of-line blocking at the queue, weights honoured at the
queue (entries read), and every request ending with one row when its worker dies holding entries
of several lanes.

The in-process harness (real engine with the tiny model, the embedded server, a clock the test
moves) makes the order deterministic; the crash test runs real worker processes."""

from __future__ import annotations

import os
import signal

import pytest
import redis.exceptions

from mqinfer.client import Client, Producer
from mqinfer.ops.compact import compact
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as scheme
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.queue.lanes import lane_of
from tests.helpers import rows, start_worker, wait_exit, wait_until
from tests.workers.harness import WorkerHarness, request


def _harness(redis_url, out, tenant_weights=None, **config):
    # Four requests run at once, at most four read at a time: a waiting queue of 8 while full.
    engine = EngineConfig(num_threads=1, max_num_seqs=4, tenant_weights=tenant_weights)
    return WorkerHarness(redis_url, out, max_batch=4, engine=engine, **config).start()


@pytest.mark.parametrize("lanes", ["tenant", "none"])
def test_a_light_tenant_behind_a_backlog_is_not_held_back_by_it(redis_url, tmp_path, lanes):
    """300 requests of a bulk tenant, then 15 of an interactive one. With lanes, the interactive
    ones are read at once and all finish before a quarter of the backlog; in the one stream
    (``none``) they wait behind it, and the same check fails - the case the lanes exist for."""
    producer = Producer(redis_url, lanes=lanes)
    producer.submit_many([request(f"b{i}", max_tokens=4, tenant="bulk") for i in range(300)])
    producer.submit_many([request(f"i{i}", max_tokens=4, tenant="interactive") for i in range(15)])
    worker = _harness(redis_url, tmp_path / "out", lanes=lanes)
    try:
        def light_done():
            finished = [r for r in worker.results() if r["id"].startswith("i")]
            return len(finished) == 15

        worker.until(lambda: light_done() or len(worker.results()) >= 150, max_turns=3000, advance_s=0.01,
                     what="the interactive requests, or half the backlog")
        bulk_done = sum(1 for r in worker.results() if r["id"].startswith("b"))
        if lanes == "tenant":
            assert light_done() and bulk_done < 300 / 4, bulk_done
        else:
            assert not light_done() and bulk_done >= 300 / 4
    finally:
        worker.worker.redis.close()


def test_a_lane_arriving_while_the_waiting_queue_is_full_is_read_and_run_at_once(redis_url, tmp_path):
    """The worker runs four bulk requests and holds its waiting bound (eight) of the rest when an
    interactive tenant's six requests arrive: they are read a few at a time without waiting for
    the bulk tenant's waiting requests to drain, take running slots back from the bulk tenant, and
    all finish before the first bulk request (40 tokens) does."""
    producer = Producer(redis_url)
    producer.submit_many([request(f"b{i}", max_tokens=40, tenant="bulk") for i in range(100)])
    worker = _harness(redis_url, tmp_path / "out")
    try:
        scheduler = worker.worker.engine.scheduler
        worker.until(lambda: scheduler.num_running == 4 and scheduler.num_waiting >= 8, what="a full engine")
        assert worker.worker.ingest._room()[0] == 0
        producer.submit_many([request(f"i{i}", max_tokens=4, tenant="interactive") for i in range(6)])

        def interactive_done():
            return sum(r["id"].startswith("i") for r in worker.results()) == 6

        worker.until(interactive_done, max_turns=200, advance_s=0.02, what="the interactive requests")
        assert not any(r["id"].startswith("b") for r in worker.results())
        assert scheduler.num_preemptions_total >= 1
    finally:
        worker.worker.redis.close()


def test_weights_hold_at_the_queue_across_lanes(redis_url, tmp_path):
    """Two tenants both backlogged with weights 2:1 get 2:1 of the entries read (the same shape of
    request, so 2:1 of the tokens too), within 5%."""
    producer = Producer(redis_url)
    producer.submit_many([request(f"a{i}", max_tokens=4, tenant="alpha") for i in range(200)])
    producer.submit_many([request(f"b{i}", max_tokens=4, tenant="beta") for i in range(200)])
    worker = _harness(redis_url, tmp_path / "out", tenant_weights="alpha=2,beta=1")
    try:
        lanes = worker.worker.ingest.lanes
        alpha = lanes.get(scheme.lane_name("tenant", "alpha", None))
        beta = lanes.get(scheme.lane_name("tenant", "beta", None))

        def read_total():
            return alpha is not None and beta is not None and alpha.read_entries + beta.read_entries >= 150

        worker.until(lambda: (alpha := lanes.get(scheme.lane_name("tenant", "alpha", None))) is not None,
                     what="the lanes seen")
        alpha = lanes.get(scheme.lane_name("tenant", "alpha", None))
        beta = lanes.get(scheme.lane_name("tenant", "beta", None))
        worker.until(read_total, max_turns=3000, advance_s=0.01, what="150 entries read")
        ratio = alpha.read_entries / beta.read_entries
        assert abs(ratio / 2.0 - 1.0) <= 0.05, (alpha.read_entries, beta.read_entries)
        # And in the rows: what finished so far follows the same split.
        done = worker.results()
        a, b = sum(r["tenant"] == "alpha" for r in done), sum(r["tenant"] == "beta" for r in done)
        assert 1.6 <= a / max(1, b) <= 2.4, (a, b)
    finally:
        worker.worker.redis.close()


def test_a_new_lane_is_read_by_a_worker_blocked_on_the_others(redis_url, redis_client, tmp_path):
    """A worker blocked in XREADGROUP on the lanes it knows is woken by a new lane's notice on the
    plain stream, and serves the new lane's request."""
    out = tmp_path / "out"
    proc = start_worker(redis_url, out, "--num-threads", "1", "--idle-exit-s", "20", "--flush-interval-s", "0.1",
                        "--consumer", "W")
    try:
        stream = keys.request_stream("requests")
        wait_until(lambda: any(c["name"] in (b"W", "W") and c["pending"] == 0
                               for c in _consumers(redis_client, stream)), timeout=90, what="the worker reading")
        with Client(redis_url) as client:
            client.submit({**request("n1", max_tokens=3), "tenant": "newcomer"})
            row = client.result("n1", timeout=60)
        assert row.finish_reason == "length" and row.tenant == "newcomer"
        lane = scheme.lane_name("tenant", "newcomer", None)
        assert lane in scheme.registered(redis_client, "requests")
        # The notice was taken and acked: nothing is left on the plain stream.
        wait_until(lambda: redis_client.xlen(stream) == 0, timeout=10, what="the notice acked")
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = wait_exit(proc, timeout=60)
    assert code == 0, err[-3000:]


def _consumers(client, stream):
    try:
        return client.xinfo_consumers(stream, keys.GROUP)
    except redis.exceptions.ResponseError:  # no stream or group yet
        return []


def test_a_worker_killed_holding_entries_of_several_lanes_loses_nothing(redis_url, redis_client, tmp_path):
    """Worker A is killed (SIGKILL) while it holds entries of three lanes and the plain stream;
    worker B claims them, and every request ends with exactly one row after compaction."""
    out = tmp_path / "out"
    tenants = ["default", "t1", "t2", "t3"]
    ids = [f"{t}-{i}" for t in tenants for i in range(6)]
    Producer(redis_url).submit_many([request(f"{t}-{i}", max_tokens=64, tenant=t) for t in tenants for i in range(6)])
    a = start_worker(redis_url, out, "--num-threads", "1", "--consumer", "A", "--claim-idle-ms", "500",
                     "--max-num-seqs", "8")
    lane_keys = scheme.stream_keys(redis_client, "requests")
    assert len(lane_keys) == 4

    def a_holds_several_lanes():
        held = 0
        for key in lane_keys:
            if redis_client.xpending_range(key, keys.GROUP, "-", "+", 10, consumername="A"):
                held += 1
        return held >= 3

    try:
        wait_until(a_holds_several_lanes, timeout=120, what="A holding entries of several lanes")
    finally:
        os.kill(a.pid, signal.SIGKILL)
        a.communicate()
    b = start_worker(redis_url, out, "--num-threads", "1", "--consumer", "B", "--claim-idle-ms", "500",
                     "--idle-exit-s", "3", "--flush-interval-s", "0.1")
    code, err = wait_exit(b, timeout=240)
    assert code == 0, err[-3000:]
    compact(out)
    results = rows(out / "results")
    assert sorted(r["id"] for r in results) == sorted(ids)
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 64 for r in results)
    for key in lane_keys:
        assert redis_client.xlen(key) == 0 and redis_client.xpending(key, keys.GROUP)["pending"] == 0


def test_a_drain_hands_back_what_waits_in_every_lane(redis_url, redis_client, tmp_path):
    """Requests read from several lanes into the engine's waiting queue have never run: a draining
    worker hands each back in its own lane, claimable at once without counting a delivery."""
    producer = Producer(redis_url)
    producer.submit_many([request(f"{t}{i}", max_tokens=20, tenant=t) for i in range(5) for t in ("x", "y", "default")])
    worker = _harness(redis_url, tmp_path / "out")
    worker.until(lambda: worker.worker.engine.scheduler.num_waiting >= 4, what="requests waiting in the engine")
    held = set(worker.worker.ownership.inflight)
    assert {lane_of(qid) for qid in held} >= {scheme.lane_name("tenant", "x", None),
                                            scheme.lane_name("tenant", "y", None)}
    worker.stop()
    finished = {r["id"] for r in worker.results()}
    handed_back = 0
    for key in scheme.stream_keys(redis_client, "requests"):
        for p in redis_client.xpending_range(key, keys.GROUP, "-", "+", 100):
            assert p["consumer"] == b"mqinfer-handback" and p["times_delivered"] == 0
            handed_back += 1
    assert handed_back == len(held) - len(finished) and handed_back >= 4


def test_an_entry_trimmed_from_a_lane_while_pending_ends_with_a_lost_row(redis_url, redis_client, tmp_path):
    """A dead worker's pending entry trimmed from its lane: its request is named in the lane's
    in-flight hash, and ends with a ``lost`` error row from the worker that claims the gap."""
    lane = scheme.lane_name("tenant", "acme", None)
    lane_stream = scheme.lane_stream("requests", lane)
    key = keys.request_stream(lane_stream)
    Producer(redis_url).submit(request("gone", tenant="acme"))
    entry = redis_client.xreadgroup(keys.GROUP, "dead-worker", {key: ">"})[0][1][0][0].decode()
    redis_client.hset(keys.inflight_hash(lane_stream), entry, '[null, "gone", "acme", "default"]')
    redis_client.xclaim(key, keys.GROUP, "dead-worker", 0, [entry], idle=60_000, justid=True)
    redis_client.xdel(key, entry)  # what XTRIM does to it
    worker = _harness(redis_url, tmp_path / "out")
    worker.until(lambda: worker.results(), max_turns=200, advance_s=0.6, what="the lost row")
    (row,) = worker.results()
    assert (row["id"], row["tenant"], row["finish_reason"], row["error_code"]) == ("gone", "acme", "error", "lost")
    assert redis_client.xpending(key, keys.GROUP)["pending"] == 0
    assert not redis_client.hexists(keys.inflight_hash(lane_stream), entry)


def test_a_request_sent_twice_into_its_lane_is_computed_once(redis_url, redis_client, tmp_path):
    """Idempotency holds per lane: a request's copies go to the same lane (its tenant's), and the
    lane's records see the second copy."""
    producer = Producer(redis_url)
    producer.submit(request("twice", tenant="acme"))
    producer.submit(request("twice", tenant="acme"))
    producer.submit(request("other", tenant="acme"))
    worker = _harness(redis_url, tmp_path / "out")
    worker.until(lambda: len(worker.results()) == 2 and not worker.worker.acks.pending, max_turns=300,
                 advance_s=0.1, what="two rows")
    worker.turn(20, advance_s=0.1)
    assert sorted(r["id"] for r in worker.results()) == ["other", "twice"]
    key = keys.request_stream(scheme.lane_stream("requests", scheme.lane_name("tenant", "acme", None)))
    assert redis_client.xlen(key) == 0 and redis_client.xpending(key, keys.GROUP)["pending"] == 0


def test_a_removed_lane_is_dropped_by_the_worker_not_made_again(redis_url, redis_client, tmp_path):
    """A lane removed while a worker reads it (empty, unregistered, its stream deleted) is not
    recreated by the worker's next read: nothing would ever remove that stream again."""
    producer = Producer(redis_url)
    producer.submit(request("a0", tenant="gone"))
    worker = _harness(redis_url, tmp_path / "out")
    lane = scheme.lane_name("tenant", "gone", None)
    worker.until(lambda: len(worker.results()) == 1 and not worker.worker.acks.pending, max_turns=300,
                 advance_s=0.1, what="the lane's request done")
    assert scheme.remove_lane(redis_client, "requests", lane)
    worker.turn(10, advance_s=0.3)
    key = keys.request_stream(scheme.lane_stream("requests", lane))
    assert not redis_client.exists(key)
    assert worker.worker.ingest.lanes.get(lane) is None
    # A producer that writes to it again registers it again, and the worker reads it.
    Producer(redis_url).submit(request("a1", tenant="gone"))
    worker.until(lambda: len(worker.results()) == 2, max_turns=300, advance_s=0.1, what="the lane back")
