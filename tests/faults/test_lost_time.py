"""A worker killed with SIGKILL mid-batch, then several workers racing to claim it: its unwritten
time is billed as one ``lost`` row, whichever of them wins, and the reports' totals still equal the
rows. (The default run's short version, one claimer, is the kill -9 mid-decode case of
``test_worker_crashes.py``; the claim race itself is pinned without processes in
``tests/workers/test_uptime.py``.)"""

from __future__ import annotations

import time

import pytest

from mqinfer.ops.report import cost_report
from tests.faults.faultkit import (
    check_lost_time, compact_and_check, killed, pending_ids, requests, spawn, submit, wait_claimable,
)
from tests.helpers import rows

pytestmark = pytest.mark.slow

PRICE = 36.0
CLAIM_IDLE_MS = 1000
# A worker beats with each keepalive turn: every min(claim idle / 3, 1 s).
BEAT_S = min(CLAIM_IDLE_MS / 3000.0, 1.0)


def _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, *, n: int, max_tokens: int, kill_at: int,
                               claimers: tuple[str, ...]) -> list[dict]:
    expected = submit(redis_url, requests("lost-time", n, max_tokens))
    out = tmp_path / "out"
    common = ("--claim-idle-ms", str(CLAIM_IDLE_MS), "--price-per-device-hour", str(PRICE))
    # Two at a time, a row flushed as soon as it is written: the first ones finish and are
    # written, the next two are mid-decode when the process dies.
    a = spawn(redis_url, out, "A", "--max-num-seqs", "2", "--max-batch", "2", "--flush-rows", "1", *common,
              faults=f"worker.after_step=kill@{kill_at}")
    a.wait()
    died = time.time()
    assert killed(a), a.log()
    assert pending_ids(redis_client, "A"), "it died holding no entries: not mid-batch"
    wait_claimable(redis_client, CLAIM_IDLE_MS)
    procs = [spawn(redis_url, out, name, "--idle-exit-s", "1.5", *common) for name in claimers]
    for p in procs:
        assert p.wait() == 0, p.log()
    row = check_lost_time(out, "A", died, BEAT_S)  # once, whichever worker claimed it
    assert row["price_per_device_hour"] == PRICE
    # The claimers redid A's requests: one row each after compaction, the lost row kept once.
    compact_and_check(out, expected, redis_client)
    after = rows(out / "costs")
    assert [c["worker"] for c in after if c["kind"] == "lost"] == ["A"]
    t = cost_report(out, by=["tenant"], basis="allocation").totals
    every_row = sum(c["device_s"] for c in after)
    assert t.device_s_by_kind["lost"] == pytest.approx(row["device_s"])
    assert t.device_s == pytest.approx(every_row)
    assert t.billed.device_s + t.allocated.device_s + t.unallocated.device_s + t.duplicate.device_s \
        == pytest.approx(every_row)
    assert t.overhead.device_s == pytest.approx(sum(t.device_s_by_kind[k] for k in ("startup", "idle", "lost")))
    return after


def test_kill_9_mid_batch_is_billed_as_lost_once_by_two_claimers(redis_url, redis_client, tmp_path):
    _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, n=4, max_tokens=24, kill_at=34,
                               claimers=("B", "C"))


def test_kill_9_mid_batch_of_a_longer_run_is_billed_as_lost_once_by_three_claimers(redis_url, redis_client,
                                                                                   tmp_path):
    costs = _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, n=16, max_tokens=64, kill_at=300,
                                       claimers=("B", "C", "D"))
    assert sum(1 for c in costs if c["worker"] == "A" and c["kind"] == "request") >= 4
