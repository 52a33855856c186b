"""The worker's parts through an in-process worker driven iteration by iteration (harness.py):
claims after idle, keepalive, handback on drain, max deliveries, acks only after durable rows,
duplicates, the exit summary and the progress counts. Crashes, signals and the command line are
tested with real processes elsewhere (tests/faults, test_worker_startup.py)."""

from __future__ import annotations

import json
import logging

import pytest

from mqinfer.ops.budgets import BudgetGuard, Budgets
from mqinfer.run_progress import Progress, count_done, count_generated
from mqinfer.schemas import faults, keys
from mqinfer.workers.queue.acks import SinkError
from mqinfer.workers.devices import usable_cores
from tests.helpers import wait_until
from tests.workers.harness import GROUP, STREAM, WorkerHarness, pending, read_as, request, set_idle, submit


@pytest.fixture
def harness(redis_url, tmp_path):
    made = []

    def make(**config) -> WorkerHarness:
        h = WorkerHarness(redis_url, tmp_path / "out", **config).start()
        made.append(h)
        return h

    yield make
    for h in made:
        h.worker.redis.close()


def _final_row(client, reply_to: str) -> dict:
    finals = [f for _, f in client.xrange(reply_to) if f[b"type"] == b"final"]
    assert len(finals) == 1, finals
    return json.loads(finals[0][b"row"])


# -- ingest and ownership ------------------------------------------------------------------------
def test_a_dead_workers_entry_is_claimed_only_once_idle_past_the_claim_time(harness, redis_client):
    h = harness()
    entry = submit(redis_client, request("r1"))
    assert read_as(redis_client, "ghost") == [entry]
    h.turn()  # a claim tick, but the entry was idle for milliseconds (claim idle time 1 s)
    assert pending(redis_client)[entry]["consumer"] == "ghost" and entry not in h.worker.ownership
    set_idle(redis_client, "ghost", entry, 5_000)
    h.turn(advance_s=0.1)  # idle enough now, but claim ticks are claim_idle / 2 apart
    assert pending(redis_client)[entry]["consumer"] == "ghost"
    h.turn(advance_s=0.4)
    assert pending(redis_client)[entry]["consumer"] == h.consumer
    assert pending(redis_client)[entry]["delivered"] == 2
    h.until(h.results, what="r1's row")
    [row] = h.results()
    assert (row["id"], row["attempt"], row["worker"], row["finish_reason"]) == ("r1", 2, h.consumer, "length")
    assert pending(redis_client) == {} and redis_client.xlen(STREAM) == 0
    assert h.metrics.registry.get_sample_value("mqinfer_redeliveries_total") == 1


def test_a_backlog_is_shared_with_a_worker_still_starting(harness, redis_client):
    # "peer" has joined the group and is loading its model: the harness worker, ready first,
    # takes its half of the backlog and leaves the rest, instead of taking one more every turn.
    from mqinfer.workers.queue.ingest import ensure_group

    ensure_group(redis_client, STREAM, GROUP)
    redis_client.xgroup_createconsumer(STREAM, GROUP, "peer")
    entries = [submit(redis_client, request(f"r{i}", max_tokens=50)) for i in range(16)]
    h = harness()
    h.turn()
    assert len(h.worker.ownership) == 8
    h.turn(3)
    assert len(h.worker.ownership) == 8 and redis_client.xinfo_groups(STREAM)[0]["lag"] == 8
    # Once the peer has been given entries it is an ordinary worker: one whose engine has room
    # takes at least one more per turn, so that no backlog waits on a worker that may be full.
    assert read_as(redis_client, "peer", count=1) == [entries[8]]
    h.turn()
    assert len(h.worker.ownership) == 9


def test_a_starting_worker_is_announced_and_kept_live_while_it_loads(redis_client):
    import time

    from mqinfer.workers.queue.ingest import LIVE_CONSUMER_MS, announced, ensure_group

    ensure_group(redis_client, STREAM, GROUP)

    def idle_ms() -> int:
        [c] = [c for c in redis_client.xinfo_consumers(STREAM, GROUP) if c["name"] == b"loading"]
        assert c["inactive"] == -1 and c["pending"] == 0  # touched, never given or claimed anything
        return c["idle"]

    with announced(redis_client, STREAM, GROUP, "loading", every_s=0.05):
        time.sleep(0.5)  # time passes on purpose while it loads; the touches keep it fresh
        assert idle_ms() < 300
    # No more touches once loaded: its idle time grows.
    wait_until(lambda: idle_ms() >= 300, timeout=10, what="the consumer's idle time to grow")
    assert idle_ms() < LIVE_CONSUMER_MS


def test_keepalive_keeps_a_running_entry_fresh_without_counting_a_delivery(harness, redis_client):
    h = harness()
    entry = submit(redis_client, request("long", max_tokens=200))
    h.until(lambda: h.running(entry), what="the request running")
    set_idle(redis_client, h.consumer, entry, 60_000)
    h.turn()  # keepalives are claim_idle / 3 apart: not yet
    assert pending(redis_client)[entry]["idle"] >= 60_000
    h.turn(advance_s=0.4)
    p = pending(redis_client)[entry]
    assert p["consumer"] == h.consumer and p["idle"] < 1_000 and p["delivered"] == 1
    _, taken, _ = redis_client.xautoclaim(STREAM, GROUP, "thief", 1_000, count=10)
    assert taken == [] and h.running(entry)


def test_drain_hands_back_unfinished_work_for_another_worker_at_once(harness, redis_client):
    h = harness(drain_timeout_s=0)
    entry = submit(redis_client, request("long", max_tokens=40))
    h.until(lambda: h.running(entry), what="the request running")
    h.turn(3, advance_s=0.01)  # device time that no row of this worker will carry
    h.stop()
    p = pending(redis_client)[entry]
    assert p["consumer"] == "mqinfer-handback" and p["delivered"] == 0 and p["idle"] > 1_000
    assert h.consumer not in {c["name"].decode() for c in redis_client.xinfo_consumers(STREAM, GROUP)}
    assert h.results() == []
    [wasted] = [c for c in h.costs() if c["kind"] == "duplicate"]
    # The harness's worker runs one model thread: it bills that thread's share of this machine's cores.
    share = min(1.0, 1 / usable_cores())
    assert h.worker.meter.device_share == pytest.approx(share) and wasted["device_share"] == pytest.approx(share)
    assert wasted["id"] == "long" and wasted["device_s"] == pytest.approx(0.03 * share) and wasted["cost_usd"] > 0

    h2 = harness(consumer="harness-2")
    h2.turn()  # taken at its first claim tick: the handback made it idle past the claim time
    assert pending(redis_client)[entry]["consumer"] == "harness-2"
    h2.until(h2.results, what="the row of the handed-back request")
    [row] = h2.results()
    assert (row["id"], row["attempt"], row["worker"], row["output_tokens"]) == ("long", 1, "harness-2", 40)


def test_an_entry_over_max_deliveries_that_ran_alone_before_ends_with_an_error_row(harness, redis_client):
    h = harness(max_deliveries=3)
    over = submit(redis_client, request("over"))
    beside = submit(redis_client, request("beside"))
    capped = submit(redis_client, request("capped"))
    last = submit(redis_client, request("last-chance"))
    read_as(redis_client, "ghost")
    # "over" ran alone on its last try and its worker died: it is the one that kills workers.
    redis_client.set(keys.ran_alone("requests", over), "ghost")
    set_idle(redis_client, "ghost", over, 5_000, delivered=3)
    # "beside" was only held next to such a request each time: it gets a try of its own, alone.
    set_idle(redis_client, "ghost", beside, 5_000, delivered=3)
    # Whatever happened, twice --max-deliveries ends it.
    set_idle(redis_client, "ghost", capped, 5_000, delivered=6)
    set_idle(redis_client, "ghost", last, 5_000, delivered=2)
    h.until(lambda: len(h.results()) == 4, what="every row")
    by_id = {r["id"]: r for r in h.results()}
    for rid, attempt in (("over", 4), ("capped", 7)):
        assert by_id[rid]["finish_reason"] == "error" and by_id[rid]["error_code"] == "max_deliveries_exceeded"
        assert by_id[rid]["attempt"] == attempt and by_id[rid]["output_tokens"] == 0
    assert "the worker running it alone died" in by_id["over"]["error"]
    assert by_id["beside"]["finish_reason"] == "length" and by_id["beside"]["attempt"] == 4
    assert by_id["last-chance"]["finish_reason"] == "length" and by_id["last-chance"]["attempt"] == 3
    # The two that ran got their try marked before it started.
    assert redis_client.get(keys.ran_alone("requests", beside)) == h.consumer.encode()
    assert redis_client.get(keys.ran_alone("requests", last)) == h.consumer.encode()
    assert pending(redis_client) == {} and redis_client.xlen(STREAM) == 0


def test_a_last_try_runs_alone_in_the_engine(harness, redis_client):
    h = harness(max_deliveries=3)
    first = [submit(redis_client, request(f"early-{i}", max_tokens=200)) for i in range(2)]
    h.until(lambda: all(h.running(e) for e in first), what="two requests running")
    solo = submit(redis_client, request("solo", max_tokens=12))
    read_as(redis_client, "ghost")
    set_idle(redis_client, "ghost", solo, 5_000, delivered=2)  # its next delivery is its last
    h.until(lambda: solo in h.worker.ownership, advance_s=0.05, what="the last try taken over")
    assert all(h.running(e) for e in first)
    later = [submit(redis_client, request(f"late-{i}", max_tokens=12)) for i in range(2)]
    together = []

    def step_once():
        running = [e for e in [*first, solo, *later] if h.running(e)]
        together.append(running)
        return len(h.results()) == 5

    h.until(step_once, advance_s=0.05, what="every row")
    with_solo = [r for r in together if solo in r]
    assert with_solo and all(r == [solo] for r in with_solo), together
    # It waited for the two already running, and the two that came after it waited for it.
    first_alone = together.index([solo])
    assert not any(e in r for r in together[first_alone:] for e in first)
    assert not any(e in r for r in together[:first_alone] for e in later)
    assert {r["id"]: r["attempt"] for r in h.results()}["solo"] == 3


def test_a_duplicate_is_computed_once_and_each_copy_answered_on_its_reply_stream(harness, redis_client):
    h = harness()
    first = request("q", reply_to="mqinfer:reply:a")
    submit(redis_client, first)
    h.until(h.results, what="the first copy's row")
    submit(redis_client, {**first, "reply_to": "mqinfer:reply:b", "priority": 3})  # a retry: the same request
    submit(redis_client, {**first, "max_tokens": 5, "reply_to": "mqinfer:reply:c"})  # another request, same id
    h.turn(2)
    [row] = h.results()
    assert _final_row(redis_client, "mqinfer:reply:a")["output_token_ids"] == row["output_token_ids"]
    again = _final_row(redis_client, "mqinfer:reply:b")
    assert again["output_token_ids"] == row["output_token_ids"] and again["worker"] == h.consumer
    refused = _final_row(redis_client, "mqinfer:reply:c")
    assert refused["error_code"] == "duplicate_id" and "different content" in refused["error"]
    [(_, dead)] = redis_client.xrange(keys.dead_letter_stream("requests"))
    assert dead[b"error_code"] == b"duplicate_id"
    assert pending(redis_client) == {} and redis_client.xlen(STREAM) == 0


# -- acks ----------------------------------------------------------------------------------------
def test_an_entry_is_acked_only_once_its_row_is_durable(harness, redis_client):
    h = harness(flush_rows=1_000)
    short = submit(redis_client, request("short", max_tokens=2, job_id="j1"))
    long = submit(redis_client, request("long", max_tokens=60, job_id="j1"))
    done_set = keys.job_done_set("requests", "j1")
    h.until(lambda: short in h.worker.acks.holds(), what="short's row buffered")
    # Finished while the long one runs: its row waits for the flush interval, and so does its ack.
    h.turn()
    assert h.results() == [] and short in pending(redis_client) and redis_client.scard(done_set) == 0
    h.turn(advance_s=0.6)
    assert [r["id"] for r in h.results()] == ["short"]
    assert short not in pending(redis_client) and redis_client.xrange(STREAM, short, short) == []
    assert long in pending(redis_client) and redis_client.smembers(done_set) == {b"short"}


def test_rows_that_cannot_be_written_are_not_acked(harness, redis_client, monkeypatch):
    monkeypatch.setattr(faults, "_plan", {"sink.results.before_rename": ("enospc", 1)})
    monkeypatch.setattr(faults, "_hits", {})
    h = harness()
    entry = submit(redis_client, request("r1"))
    with pytest.raises(SinkError):
        for _ in range(50):
            h.turn()
    assert h.results() == []
    assert pending(redis_client)[entry]["consumer"] == h.consumer and redis_client.xlen(STREAM) == 1
    assert redis_client.get(keys.idempotency_key("requests", None, "r1")).endswith(b" run")


def test_a_handed_in_budget_guard_refuses_a_spent_tenant(harness, redis_client):
    with pytest.raises(ValueError, match="budget guard"):
        harness(budgets="budgets.toml", enforce_budgets=True)
    guard = BudgetGuard(Budgets(tenants={"broke": 0.0}), redis_client, "requests")
    h = harness(budgets="budgets.toml", enforce_budgets=True, budget_guard=guard)
    submit(redis_client, request("no", tenant="broke"))
    submit(redis_client, request("yes", tenant="rich"))
    h.until(lambda: len(h.results()) == 2, advance_s=0.01, what="both rows")  # device time costs money
    by_id = {r["id"]: r for r in h.results()}
    assert by_id["no"]["error_code"] == "budget_exceeded" and by_id["yes"]["finish_reason"] == "length"
    assert float(redis_client.hget("mqinfer:{requests}:spend", "rich")) > 0  # charged at its ack


# -- what a stopping worker leaves ---------------------------------------------------------------
def test_a_stopped_worker_leaves_its_exit_summary_beside_its_rows(harness, redis_client, caplog):
    h = harness(consumer="summary/1")
    for i in range(3):
        submit(redis_client, request(f"s{i}"))
    submit(redis_client, request("bad", prompt_token_ids=[256, 10**6]))  # an error row, not computed
    h.until(lambda: len(h.results()) == 4, what="every row")
    with caplog.at_level(logging.INFO, logger="mqinfer.worker"):
        h.stop()
    folder = h.out / ".mqinfer" / "workers"
    assert [p.name for p in folder.iterdir()] == ["summary_1.json"]  # no temp file left
    doc = json.loads((folder / "summary_1.json").read_text())
    assert doc["consumer"] == "summary/1" and doc["exit_code"] == 0
    assert doc["requests_finished"] == 3 and doc["result_rows"] == 4
    assert doc["busy_s"] > 0 and doc["phases_s"]["forward"] > 0
    assert doc["other_s"] == pytest.approx(doc["busy_s"] - sum(doc["phases_s"].values()), abs=1e-3)
    assert doc["uptime_s"] == pytest.approx(h.clock.now - h.worker.meter.start, abs=1e-3)
    [line] = [r.getMessage() for r in caplog.records if "stopped; busy time " in r.getMessage()]
    logged = json.loads(line.split("busy time ", 1)[1])
    assert logged == {k: doc[k] for k in ("busy_s", "phases_s", "other_s", "outside_forward_share")}


# -- progress ------------------------------------------------------------------------------------
def _generated(client, job_id: str) -> int:
    raw = client.hget(keys.generated_tokens("requests"), job_id)
    return 0 if raw is None else int(raw)


def test_generated_tokens_are_counted_per_job_while_requests_run(harness, redis_client):
    h = harness()
    submit(redis_client, request("g1", max_tokens=30, job_id="job-a"))
    submit(redis_client, request("g2", max_tokens=20, job_id="job-a"))
    submit(redis_client, request("g3", max_tokens=10, job_id="job-b"))
    h.turn()
    first = _generated(redis_client, "job-a")
    assert first > 0 and _generated(redis_client, "job-b") > 0  # the first counts go at once
    h.turn(2)
    assert _generated(redis_client, "job-a") == first  # then at most every 0.5 s without reply messages
    h.turn(advance_s=0.6)
    assert _generated(redis_client, "job-a") > first
    assert redis_client.scard(keys.job_done_set("requests", "job-a")) == 0  # nothing finished yet
    h.until(lambda: len(h.results()) == 3, what="every row")
    h.stop()
    results = h.results()
    for job_id in ("job-a", "job-b"):
        assert _generated(redis_client, job_id) == sum(r["output_tokens"] for r in results if r["job_id"] == job_id)
    assert 0 < redis_client.ttl(keys.generated_tokens("requests")) <= 7 * 24 * 3600


def test_generated_tokens_ride_with_each_steps_reply_messages(harness, redis_client):
    h = harness()
    submit(redis_client, request("r", max_tokens=30, job_id="job-r", reply_to="mqinfer:reply:r"))
    h.turn()
    counts = [_generated(redis_client, "job-r")]
    for _ in range(3):  # the clock stands still: only the reply messages' pipeline carries them
        h.turn()
        counts.append(_generated(redis_client, "job-r"))
    assert counts[0] > 0 and counts == sorted(set(counts))  # grew at every step
    deltas = [f for _, f in redis_client.xrange("mqinfer:reply:r") if f[b"type"] == b"delta"]
    assert sum(len(json.loads(f[b"token_ids"])) for f in deltas) == counts[-1]


def test_run_progress_shows_tokens_before_the_first_request_finishes(harness, redis_client):
    h = harness()
    submit(redis_client, request("p1", max_tokens=40, job_id="run-x"))
    submit(redis_client, request("p2", max_tokens=40, job_id="run-x"))
    h.turn(3, advance_s=0.6)
    done = count_done(redis_client, [keys.job_done_set("requests", "run-x")], 0)
    tokens = count_generated(redis_client, [keys.generated_tokens("requests")], "run-x", 0)
    assert done == 0 and tokens >= 4
    assert Progress(2).line(done, tokens, 3.2) == f"0/2 requests (  0.0%), {tokens} tokens generated, elapsed 3s"
    assert Progress(4).line(1, 50, 10.0) == "1/4 requests ( 25.0%), 50 tokens generated, elapsed 10s, eta 30s"
