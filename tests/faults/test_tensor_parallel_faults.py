"""A tensor-parallel worker (two gloo ranks on CPU) losing a rank: the whole worker stops with a
non-zero exit and acks nothing it has not written; another worker claims its entries, and after
compaction every request has exactly one row."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.faults.faultkit import (
    compact_and_check, pending_by_consumer, pending_ids, record, requests, spawn, submit, wait_claimable,
)
from tests.helpers import rows, wait_until

TP2 = ("--device", "cpu", "--tensor-parallel-size", "2", "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-rows", "1")


def _finish_with_another_worker(redis_url, redis_client, out, expected, case, **figures):
    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert pending_by_consumer(redis_client) == {}
    outcome = compact_and_check(out, expected, redis_client)
    assert all(r["output_tokens"] == 30 for r in outcome.by_key.values())
    record(case, submitted=len(expected), rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=0,
           duplicated=outcome.duplicates_removed, **figures)
    return outcome


def test_a_rank_killed_mid_step_stops_the_worker_and_loses_nothing(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("tp-rank-killed", 8, 30))
    out = tmp_path / "out"
    # Four at a time: the first four finish (about 32 steps) and are written and acked; at the
    # other rank's step 45 the next four are mid-decode when it dies.
    a = spawn(redis_url, out, "A", *TP2, faults="tp.rank_step=kill@45")
    code = a.wait()
    log = a.log()
    assert code == 4, log
    assert "tensor-parallel rank" in log and "without acking" in log
    assert len(pending_ids(redis_client, "A")) == 4  # what it held stays pending, for another worker
    assert len(rows(out / "results")) == 4
    outcome = _finish_with_another_worker(redis_url, redis_client, out, expected, "tensor-parallel rank killed",
                                          worker_crashes=1, injected_kills=1)
    assert sorted(r["attempt"] for r in outcome.by_key.values()).count(2) == 4
    assert outcome.rows_before == 8 and outcome.duplicates_removed == 0


@pytest.mark.slow
def test_the_worker_killed_takes_its_other_rank_with_it(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("tp-leader-killed", 8, 30))
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", *TP2, log_level="info")
    wait_until(lambda: len(rows(out / "results")) >= 2, timeout=90, what="A's first rows")
    # The worker logs each rank's pid as it starts it (the rank is its child, or the warm
    # template's where it was forked there).
    followers = [int(pid) for pid in re.findall(r"started tensor-parallel rank \d+ \(pid (\d+)\)", a.log())]
    assert followers and all(_alive(p) for p in followers), a.log()
    a.signal(signal.SIGKILL)
    a.wait()
    wait_until(lambda: not any(_alive(p) for p in followers), timeout=30, what="the other rank to die with it")
    _finish_with_another_worker(redis_url, redis_client, out, expected, "tensor-parallel worker killed",
                                worker_crashes=0, injected_kills=1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
