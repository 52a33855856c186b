"""A worker killed with SIGKILL mid-batch: the worker that finds it dead bills the time it used and
never wrote as one ``lost`` row under its name, so that its rows cover its uptime up to its last
heartbeat; two claimers write that row once; the reports' totals still equal the rows."""

from __future__ import annotations

import time

import pytest

from mqinfer.ops.report import cost_report
from tests.faults.faultkit import compact_and_check, killed, pending_ids, requests, spawn, submit
from tests.helpers import rows

PRICE = 36.0
CLAIM_IDLE_MS = 1000
# A worker beats with each keepalive turn: every min(claim idle / 3, 1 s).
BEAT_S = min(CLAIM_IDLE_MS / 3000.0, 1.0)


def _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, *, n: int, max_tokens: int, kill_at: int,
                               claimers: tuple[str, ...]):
    expected = submit(redis_url, requests("lost-time", n, max_tokens))
    out = tmp_path / "out"
    common = ("--claim-idle-ms", str(CLAIM_IDLE_MS), "--price-per-device-hour", str(PRICE))
    # Two at a time, a row flushed as soon as it is written: the first two finish and are written,
    # the next two are mid-decode when the process dies.
    a = spawn(redis_url, out, "A", "--max-num-seqs", "2", "--max-batch", "2", "--flush-rows", "1", *common,
              faults=f"worker.after_step=kill@{kill_at}")
    a.wait()
    died = time.time()
    assert killed(a), a.log()
    assert pending_ids(redis_client, "A"), "it died holding no entries: not mid-batch"
    procs = [spawn(redis_url, out, name, "--idle-exit-s", "1.5", *common) for name in claimers]
    for p in procs:
        assert p.wait() == 0, p.log()
    costs = rows(out / "costs")
    lost = [c for c in costs if c["kind"] == "lost"]
    assert [c["worker"] for c in lost] == ["A"], lost  # once, whichever worker claimed it
    (row,) = lost
    assert row["job_id"] is None and row["tenant"] is None and row["device_s"] > 0
    assert row["cost_usd"] == pytest.approx(row["device_s"] * PRICE / 3600)
    # A's rows and its lost row cover its uptime: from the start of its startup row to its last
    # heartbeat (the lost row's finished_at), which is within a heartbeat of its death.
    mine = [c for c in costs if c["worker"] == "A"]
    (startup,) = [c for c in mine if c["kind"] == "startup"]
    began = startup["finished_at"].timestamp() - startup["device_s"]
    last_beat = row["finished_at"].timestamp()
    assert sum(c["device_s"] for c in mine) == pytest.approx(last_beat - began, abs=1e-3)
    assert 0 <= died - last_beat <= BEAT_S + 0.5, (died, last_beat)
    # The claimers redid A's requests: one row each after compaction, the lost row kept once.
    compact_and_check(out, expected, redis_client)
    after = rows(out / "costs")
    assert [c["worker"] for c in after if c["kind"] == "lost"] == ["A"]
    report = cost_report(out, by=["tenant"], basis="allocation")
    t = report.totals
    every_row = sum(c["device_s"] for c in after)
    assert t.device_s_by_kind["lost"] == pytest.approx(row["device_s"])
    assert t.device_s == pytest.approx(every_row)
    assert t.billed.device_s + t.allocated.device_s + t.unallocated.device_s + t.duplicate.device_s \
        == pytest.approx(every_row)
    assert t.overhead.device_s == pytest.approx(sum(t.device_s_by_kind[k] for k in ("startup", "idle", "lost")))
    return costs


def test_kill_9_mid_batch_is_billed_as_lost_once_by_two_claimers(redis_url, redis_client, tmp_path):
    _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, n=4, max_tokens=24, kill_at=34,
                               claimers=("B", "C"))


@pytest.mark.slow
def test_kill_9_mid_batch_of_a_longer_run_is_billed_as_lost_once(redis_url, redis_client, tmp_path):
    costs = _kill_mid_batch_then_claim(redis_url, redis_client, tmp_path, n=16, max_tokens=64, kill_at=300,
                                       claimers=("B", "C", "D"))
    assert sum(1 for c in costs if c["worker"] == "A" and c["kind"] == "request") >= 4
