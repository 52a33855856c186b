"""Per-tenant rate limits (``--tenant-limits``): the token bucket script on the embedded server, the
option's parsing, a worker that holds a limited tenant's requests while others flow past them, and
two worker processes sharing one tenant's limit."""

from __future__ import annotations

import threading
import time

import pytest

from mqinfer.schemas import keys
from mqinfer.schemas.replies import cancel_key, cancel_member
from mqinfer.workers.queue.buckets import TokenBuckets
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.tenant_limits import TenantLimit, format_tenant_limits, parse_tenant_limits, request_tokens
from tests.helpers import FakeClock, blocked_in, rows, start_worker, stop_processes, wait_until
from tests.workers.harness import WorkerHarness, pending, request, submit


# -- the bucket script --------------------------------------------------------------------------

def _s(seconds: float):
    """A wait the script answers (in whole microseconds, rounded up)."""
    return pytest.approx(seconds, abs=2e-6)


def _buckets(client, clock, **limits) -> TokenBuckets:
    return TokenBuckets(client, {t: spec for t, spec in limits.items()}, clock=clock)


def test_a_bucket_holds_one_second_of_tokens_and_refills_at_the_rate(redis_client):
    clock = FakeClock(5000.0)
    b = _buckets(redis_client, clock, a=TenantLimit(100))
    # A fresh bucket is full: one second of tokens, taken in order until the next does not fit.
    assert b.take("a", [30, 30, 30, 30]) == (3, _s(0.2))  # 10 left, 20 more needed at 100/s
    clock.advance(0.1)
    assert b.take("a", [30]) == (0, _s(0.1))
    clock.advance(0.1)
    assert b.take("a", [30]) == (1, 0.0)
    # Refill stops at the burst: a long idle time does not save more than one second of tokens.
    clock.advance(60)
    assert b.take("a", [50, 50, 1]) == (2, _s(0.01))
    # The bucket's key lives until the bucket would be full again, plus a second.
    assert 1000 < redis_client.pttl(keys.rate_limit_bucket("a")) <= 2000


def test_requests_per_second_limit_and_a_request_larger_than_the_burst(redis_client):
    clock = FakeClock(5000.0)
    b = _buckets(redis_client, clock, r=TenantLimit(1000, 2), big=TenantLimit(8))
    assert b.take("r", [1, 1, 1]) == (2, _s(0.5))  # two requests a second, burst 2
    clock.advance(0.5)
    assert b.take("r", [1, 1]) == (1, _s(0.5))
    # 20 tokens against a bucket of 8: taken once the bucket is full, leaving it 12 in debt, which
    # the refill pays back before the next request (20 tokens per 2.5 s = 8/s).
    assert b.take("big", [20, 20]) == (1, _s(2.5))
    clock.advance(2.25)
    assert b.take("big", [20]) == (0, _s(0.25))
    clock.advance(0.25)
    assert b.take("big", [20]) == (1, 0.0)
    assert b.take("big", [20]) == (0, _s(2.5))
    assert b.take("big", []) == (0, 0.0)  # asks nothing, takes nothing


def test_concurrent_takes_from_two_clients_never_exceed_the_limit(redis_server, redis_url):
    """Two clients taking as fast as they can from one bucket, on the server's clock: together
    they get one burst plus the rate over the time they took, however their calls interleave."""
    rate, cost, run_s = 500.0, 7, 1.5
    taken = [0, 0]
    clients = [redis_server.client() for _ in range(2)]
    start = time.time()

    def hammer(i: int) -> None:
        b = TokenBuckets(clients[i], {"t": TenantLimit(rate)})
        while time.time() - start < run_s:
            n, _ = b.take("t", [cost] * 5)
            taken[i] += n * cost

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start
    for c in clients:
        c.close()
    assert all(taken), taken  # both clients got tokens
    # Burst + rate x time, and not much less: the bucket was emptied as fast as it refilled.
    assert sum(taken) <= rate + rate * elapsed
    assert sum(taken) >= rate + rate * (run_s - 0.3) - cost * 10


# -- --tenant-limits ------------------------------------------------------------------------------

def test_tenant_limits_parse_and_round_trip():
    limits = parse_tenant_limits("gold=200:2, batch = 50,team=a=1.5")
    assert limits == {"gold": TenantLimit(200, 2), "batch": TenantLimit(50), "team=a": TenantLimit(1.5)}
    assert format_tenant_limits(limits) == "gold=200:2,batch=50,team=a=1.5"
    assert parse_tenant_limits(format_tenant_limits(limits)) == limits
    assert parse_tenant_limits("") == {} and parse_tenant_limits(None) == {}
    assert TenantLimit(200, 2).describe() == "200 tokens/s and 2 requests/s"
    # A request's tokens: its prompt and the output it may generate within the context length.
    assert request_tokens(10, 16, 2048) == 26 and request_tokens(2000, 100, 2048) == 2048


@pytest.mark.parametrize("text, message", [
    ("a=", r"the tokens per second of tenant 'a' must be a number, got ''"),
    ("a=-1", r"the tokens per second of tenant 'a' must be a finite number > 0, got '-1'"),
    ("a=0", r"must be a finite number > 0, got '0'"),
    ("a=x", r"the tokens per second of tenant 'a' must be a number, got 'x'"),
    ("a=inf", r"must be a finite number > 0, got 'inf'"),
    ("a=10:0", r"the requests per second of tenant 'a' must be a finite number > 0, got '0'"),
    ("a=10:", r"the requests per second of tenant 'a' must be a number, got ''"),
    ("a=10,a=20", r"tenant 'a' is given twice"),
    ("a", r"entry 'a' is not tenant=tokens_per_s\[:requests_per_s\]"),
    ("=5", r"entry '=5' is not tenant="),
    ("a=1,,b=2", r"entry 2 is empty"),
])
def test_bad_tenant_limits_are_refused_naming_the_entry(text, message):
    with pytest.raises(ValueError, match="tenant limits: .*" + message):
        parse_tenant_limits(text)


# -- one worker (in process, on a clock the test moves) ---------------------------------------------

@pytest.fixture
def limited_worker(redis_url, tmp_path):
    # `slow`: 40 tokens/s; each request below takes 4 prompt + 4 output = 8 tokens, so a burst of 5
    # requests, then one every 0.2 s of the worker's clock. `roomy` is limited too, far above its use.
    h = WorkerHarness(redis_url, tmp_path / "out", max_batch=4, tenant_limits="slow=40,roomy=1000",
                      engine=EngineConfig(num_threads=1, max_num_seqs=4)).start()
    yield h
    h.worker.redis.close()


def test_a_limited_tenant_waits_while_others_flow_past_and_a_deadline_ends_it_rate_limited(
        limited_worker, redis_client):
    h = limited_worker
    now = h.clock()
    slow = [submit(redis_client, request(f"s{i}", tenant="slow")) for i in range(10)]
    doomed = submit(redis_client, request("late", tenant="slow", deadline=now + 0.5))
    fast = [submit(redis_client, request(f"f{i}", tenant="roomy" if i % 2 else "free")) for i in range(6)]
    assert len(slow) == 10 and len(fast) == 6
    seen_in_engine_while_throttled = []

    def turn_and_watch():
        for entry_id in list(h.worker.throttle.entries()) if h.worker.throttle else []:
            if h.running(entry_id.entry_id):
                seen_in_engine_while_throttled.append(entry_id.entry_id)
        return len(h.results()) == 17

    # Each turn is 10 ms on the worker's clock (and the buckets'), so the clock says who waited.
    h.until(turn_and_watch, max_turns=600, advance_s=0.01, what="every row")
    assert seen_in_engine_while_throttled == []  # a throttled request never entered the engine
    by_id = {r["id"]: r for r in h.results()}
    assert len(by_id) == 17  # nothing lost, nothing twice
    late = by_id.pop("late")
    assert (late["finish_reason"], late["error_code"]) == ("error", "rate_limited")
    assert "over its rate limit (40 tokens/s" in late["error"] and "$.deadline" in late["error"]
    late_cost = [c for c in h.costs() if c["id"] == "late"]
    assert len(late_cost) == 1 and late_cost[0]["kind"] == "request" and late_cost[0]["cost_usd"] == 0
    assert all(r["finish_reason"] == "length" for r in by_id.values())
    starts = sorted(by_id[f"s{i}"]["started_at"].timestamp() for i in range(10))
    # The first five (one second of tokens) start at once, then one per 0.2 s: 10 x 8 tokens need
    # at least (80 - 40) / 40 = 1 s from the first start.
    assert starts[-1] - starts[0] >= 1.0 - 0.02
    assert starts[4] - starts[0] < 0.1
    # The other tenants' requests, limited or not, submitted after all the slow ones, were not held
    # behind them.
    fast_done = max(by_id[f"f{i}"]["finished_at"].timestamp() for i in range(6))
    assert fast_done < starts[6]
    text = h.metrics.registry.get_sample_value
    assert text("mqinfer_tenant_rate_limit", {"tenant": "slow", "kind": "tokens_per_second"}) == 40
    assert text("mqinfer_rate_limited_tokens_total", {"tenant": "slow"}) == 8 * 6  # s5..s9 and late
    assert text("mqinfer_rate_limited_seconds_total", {"tenant": "slow"}) > 1.0
    assert text("mqinfer_num_requests_rate_limited", {"tenant": "slow"}) == 0


def test_a_draining_worker_hands_back_what_waits_on_the_limit(limited_worker, redis_client):
    h = limited_worker
    entries = [submit(redis_client, request(f"s{i}", tenant="slow")) for i in range(9)]
    h.until(lambda: len(h.results()) == 5, max_turns=300, what="the burst's rows")
    held = [held.entry_id for held in h.worker.throttle.entries()]
    assert sorted(held) == sorted(entries[5:])
    assert h.metrics.registry.get_sample_value("mqinfer_num_requests_rate_limited", {"tenant": "slow"}) == 4
    h.stop()
    assert sorted(r["id"] for r in h.results()) == [f"s{i}" for i in range(5)]
    handed_back = pending(redis_client)
    assert set(handed_back) == set(entries[5:])
    assert all(p["consumer"] == "mqinfer-handback" and p["delivered"] == 0 for p in handed_back.values())


def test_a_cancelled_request_leaves_the_throttle_with_a_cancelled_row(limited_worker, redis_client):
    h = limited_worker
    entries = [submit(redis_client, request(f"s{i}", tenant="slow")) for i in range(10)]
    h.until(lambda: len(h.results()) == 5, max_turns=300, what="the burst's rows")
    assert len(h.worker.throttle) == 5
    # What Client.cancel leaves: the request's member in the stream's cancel set, scored now.
    redis_client.zadd(cancel_key("requests"), {cancel_member("s9", None): time.time()})
    # The keepalive checks the cancels of what the worker holds; 0.4 s refill two requests' tokens.
    h.turn(advance_s=0.4)
    assert sorted(held.entry_id for held in h.worker.throttle.entries()) == sorted(entries[7:9])
    h.until(lambda: len(h.results()) == 10, max_turns=300, advance_s=0.01, what="every row")
    by_id = {r["id"]: r for r in h.results()}
    assert by_id["s9"]["finish_reason"] == "cancelled" and by_id["s9"]["started_at"] is None
    assert all(by_id[f"s{i}"]["finish_reason"] == "length" for i in range(9))


def test_a_cancelled_job_ends_its_requests_waiting_on_a_limit(redis_url, redis_client, tmp_path):
    h = WorkerHarness(redis_url, tmp_path / "out", tenant_limits="slow=8").start()  # one request a second
    try:
        redis_client.hset(keys.job_key("j"), "status", "running")
        for i in range(6):
            submit(redis_client, request(f"s{i}", tenant="slow", job_id="j"))
        h.until(lambda: len(h.results()) == 1, max_turns=300, what="the first row")
        assert len(h.worker.throttle) == 5
        redis_client.hset(keys.job_key("j"), "status", "cancelling")
        h.turn(advance_s=1.1)  # the job's status is read again; one more request's tokens refilled
        assert len(h.worker.throttle) == 0
        h.until(lambda: len(h.results()) == 6, max_turns=100, advance_s=0.01, what="every row")
        reasons = sorted(r["finish_reason"] for r in h.results())
        assert reasons == ["cancelled"] * 5 + ["length"]
    finally:
        h.worker.redis.close()


def test_a_worker_holds_a_bounded_number_of_requests_waiting_on_limits(redis_url, redis_client, tmp_path):
    """Past ``throttled_bound`` held requests a worker stops reading: the rest of a limited
    tenant's flood waits in the stream (where another worker may take it), not in memory."""
    h = WorkerHarness(redis_url, tmp_path / "out", max_batch=1, tenant_limits="slow=8",
                      engine=EngineConfig(num_threads=1, max_num_seqs=1)).start()
    try:
        bound = h.worker.ingest.throttled_bound
        assert bound == 4 * max(1, 2 * 1)
        for i in range(bound + 6):
            submit(redis_client, request(f"s{i}", tenant="slow"))
        most = 0
        for _ in range(3 * bound):
            h.turn()
            most = max(most, len(h.worker.throttle))
        assert most == bound
        group = next(g for g in redis_client.xinfo_groups(keys.request_stream()) if g["name"] == b"workers")
        assert group["lag"] == 5  # one request ran (the bucket's first 8 tokens), 5 were never read
    finally:
        h.worker.redis.close()


# -- two workers share a tenant's limit ------------------------------------------------------------

def _shared_limit_run(redis_url, redis_client, tmp_path, *, rate: float, n: int):
    """``n`` requests of 20 tokens (4 prompt + 16 output) of tenant `t`, limited to ``rate``
    tokens/s, read by two worker processes; returns (their result rows, the span from the first
    start to the last, in seconds)."""
    out = tmp_path / "out"
    limit = ["--tenant-limits", f"t={rate:g}", "--num-threads", "1", "--max-batch", "8", "--idle-exit-s", "30"]
    workers = [start_worker(redis_url, out, "--consumer", f"w{i}", *limit) for i in range(2)]
    try:
        # Both workers ready (each joined the group and waits, blocked in XREADGROUP) before the
        # flood, so that both take part.
        wait_until(lambda: len(redis_client.xinfo_consumers(keys.request_stream(), keys.GROUP)) == 2
                   if redis_client.exists(keys.request_stream()) else False, timeout=60, what="two workers")
        wait_until(lambda: blocked_in(redis_client, "xreadgroup") == 2, timeout=60, interval=0.01,
                   what="both workers waiting for requests")
        for i in range(n):
            submit(redis_client, request(f"r{i}", max_tokens=16, tenant="t"))
        wait_until(lambda: len(rows(out / "results")) >= n, timeout=60 + 2 * n * 20 / rate, interval=0.2,
                   what="every row")
    finally:
        stop_processes(*workers)
    results = rows(out / "results")
    starts = sorted(r["started_at"].timestamp() for r in results)
    return results, starts[-1] - starts[0]


def test_two_workers_hold_a_shared_limit(redis_url, redis_client, tmp_path):
    rate, n, cost = 200.0, 50, 20
    results, span = _shared_limit_run(redis_url, redis_client, tmp_path, rate=rate, n=n)
    assert sorted(r["id"] for r in results) == sorted(f"r{i}" for i in range(n))
    assert {r["worker"] for r in results} == {"w0", "w1"}, "both workers took part"
    # 1000 tokens at 200/s after a burst of 200: 4 s at least; a start-time measurement is allowed
    # one request's cost of slack. Each worker alone would have been allowed the full rate.
    assert n * cost <= rate + rate * span + cost, f"{n * cost / span:.0f} tokens/s over {span:.2f}s"
    assert span < 2 * (n * cost - rate) / rate, f"throttled far below the limit: {span:.2f}s"


@pytest.mark.slow
def test_two_workers_hold_a_shared_limit_within_5_percent_over_a_minute(redis_url, redis_client, tmp_path):
    rate, n, cost = 200.0, 610, 20
    results, span = _shared_limit_run(redis_url, redis_client, tmp_path, rate=rate, n=n)
    assert len({r["id"] for r in results}) == n and {r["worker"] for r in results} == {"w0", "w1"}
    achieved = (n * cost - rate) / span  # after the first second's burst
    assert abs(achieved - rate) <= 0.05 * rate, f"{achieved:.1f} tokens/s against {rate:g}"
