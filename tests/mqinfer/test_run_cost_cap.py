"""`mqinfer run --max-cost-usd`: a capped job spends at most its cap plus the requests in flight when
it reached it, the rest end with budget_exceeded rows, the summary says so, and running again
with a higher cap carries on. Real runs of the built-in tiny model; the cap is an eighth of what
the same job cost uncapped on this machine a moment before."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mqinfer.schemas import keys
from mqinfer.workers.queue.job_caps import JobCaps, set_cap
from tests import zygote
from tests.helpers import FakeClock, clean_env, rows, write_jsonl

PRICE = 3600.0  # one USD per device-second
# One worker, at most 2 requests running and 2 waiting in its engine: what can be in flight.
LAYOUT = ("--workers", "1", "--max-num-seqs", "2", "--max-batch", "1")
IN_FLIGHT = 2 + 2
N = 16


def _env() -> dict:
    return clean_env("OMP_NUM_THREADS")


def _run(src, out, *flags) -> subprocess.CompletedProcess:
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(out),
                       "--price-per-device-hour", str(PRICE), *LAYOUT, *flags],
                      env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _request_costs(out) -> dict[str, float]:
    return {c["id"]: c["cost_usd"] for c in rows(out / "costs") if c["kind"] == "request"}


def test_a_capped_run_stops_at_its_cap_and_a_second_run_carries_on(tmp_path):
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + (i + k) % 200 for k in range(48)], "max_tokens": 24,
              "temperature": 0, "ignore_eos": True} for i in range(N)]
    src = write_jsonl(tmp_path / "in.jsonl", items)
    _run(src, tmp_path / "free", "--job-id", "capped")
    cap = sum(_request_costs(tmp_path / "free").values()) / 8

    out = tmp_path / "out"
    proc = _run(src, out, "--job-id", "capped", "--max-cost-usd", repr(cap))
    results = {r["id"]: r for r in rows(out / "results")}
    assert len(results) == N  # every request has its row: none lost
    stopped = {rid for rid, r in results.items() if r["error_code"] == "budget_exceeded"}
    ran = {rid for rid, r in results.items() if r["finish_reason"] != "error"}
    assert stopped and ran and stopped | ran == set(results)
    assert all("cost cap" in results[rid]["error"] and "--max-cost-usd" in results[rid]["error"] for rid in stopped)
    costs = _request_costs(out)
    assert all(costs[rid] == 0.0 for rid in stopped)
    # When the spend reached the cap, at most the requests then in the engine were still running:
    # they finish, and nothing starts after them.
    finished = sorted((results[rid]["finished_at"].timestamp(), costs[rid]) for rid in ran)
    total, reached_at = 0.0, None
    for at, usd in finished:
        total += usd
        if reached_at is None and total >= cap:
            reached_at = at
    # (A cap reached only by the estimate of the requests in the engine stops the job earlier.)
    if reached_at is not None:
        assert len([at for at, _ in finished if at > reached_at]) <= IN_FLIGHT
    assert f"cost cap: {len(stopped)} requests did not run (budget_exceeded)" in proc.stdout
    assert "--max-cost-usd" in proc.stdout

    # Again, with a cap high enough: the stopped requests run now, the others are kept.
    again = _run(src, out, "--job-id", "capped", "--max-cost-usd", repr(cap * 100))
    results2 = {r["id"]: r for r in rows(out / "results")}
    assert len(results2) == N and all(r["finish_reason"] == "length" for r in results2.values())
    for rid in ran:
        assert results2[rid]["finished_at"] == results[rid]["finished_at"]
    assert f"{len(stopped)} requests a cost cap stopped earlier run now" in again.stderr
    assert "cost cap:" not in again.stdout
    assert len([c for c in rows(out / "costs") if c["kind"] == "request"]) == N


def test_job_caps_count_acked_spend_local_spend_and_read_again_near_the_cap(redis_client):
    clock = FakeClock(1000.0)
    caps = JobCaps(redis_client, clock=clock, refresh_s=60.0)
    local = {"j": 0.0}
    assert caps.exceeded("j", local.get) is None and not caps.capped("j")  # no cap: never refused
    set_cap(redis_client, "j", 1.0, spent_usd=0.5)
    assert caps.exceeded("j", local.get) is None  # the "no cap" read is still fresh
    clock.advance(60.0)
    assert caps.exceeded("j", local.get) is None and caps.capped("j")
    local["j"] = 0.5  # this worker's rows not acked, and requests in its engine
    assert "reached its cost cap" in caps.exceeded("j", local.get)
    local["j"] = 0.35
    # Near the cap (80% of it) the spend is read at every check: another worker's acked rows count
    # at once.
    assert caps.exceeded("j", local.get) is None
    redis_client.hincrbyfloat(keys.job_cost("j"), "spent_usd", 0.3)
    assert caps.exceeded("j", local.get) is not None
    # Acked rows raise the spend of capped jobs only, in the pipeline given.
    pipe = redis_client.pipeline(transaction=True)
    charged = caps.queue_charges(pipe, [("j", 0.25), ("j", 0.0), ("other", 5.0)])
    pipe.execute()
    caps.charged(charged)
    assert charged == ["j"]
    assert float(redis_client.hget(keys.job_cost("j"), "spent_usd")) == pytest.approx(1.05)
    assert redis_client.exists(keys.job_cost("other")) == 0
    # A higher cap lets the job carry on.
    set_cap(redis_client, "j", 5.0)
    caps.charged(["j"])
    local["j"] = 0.0
    assert caps.exceeded("j", local.get) is None


def test_job_caps_go_on_with_the_last_reading_while_redis_is_away(redis_client):
    import redis

    clock = FakeClock(1000.0)
    set_cap(redis_client, "k", 1.0, spent_usd=2.0)
    caps = JobCaps(redis_client, clock=clock, refresh_s=1.0)
    assert caps.exceeded("k", lambda _job: 0.0) is not None
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # Nothing listens there; one try, no retries.
    away = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    caps.redis = away
    clock.advance(5.0)
    assert caps.exceeded("k", lambda _job: 0.0) is not None  # the last reading: still over
    assert JobCaps(away, clock=clock).exceeded("never-read", lambda _job: 0.0) is None
