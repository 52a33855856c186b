"""A pipeline-parallel worker (gloo stages on CPU) losing a stage mid-step: the whole worker stops
with a non-zero exit and acks nothing it has not written; another worker claims its entries, and
after compaction every request has exactly one row."""

from __future__ import annotations

import pytest

from tests.faults.faultkit import (
    compact_and_check, pending_by_consumer, pending_ids, record, requests, spawn, submit, wait_claimable,
)
from tests.helpers import rows

COMMON = ("--device", "cpu", "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-rows", "1")


def _finish_with_another_worker(redis_url, redis_client, out, expected, case):
    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert pending_by_consumer(redis_client) == {}
    outcome = compact_and_check(out, expected, redis_client)
    assert all(r["output_tokens"] == 30 for r in outcome.by_key.values())
    assert sorted(r["attempt"] for r in outcome.by_key.values()).count(2) == 4
    assert outcome.rows_before == 8 and outcome.duplicates_removed == 0
    record(case, submitted=len(expected), rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=0,
           duplicated=outcome.duplicates_removed, worker_crashes=1, injected_kills=1)


def _kill_a_stage(redis_url, redis_client, tmp_path, job: str, stages: int, killed: int, *extra: str) -> str:
    """Run worker A with ``stages`` stages, kill stage ``killed`` mid-step once the first four
    requests are written; returns A's log."""
    expected = submit(redis_url, requests(job, 8, 30))
    out = tmp_path / "out"
    # Four at a time: the first four finish (about 30 steps) and are written and acked; at the
    # stage's step 45 the next four are mid-decode, its first micro-batch sent on, when it dies.
    a = spawn(redis_url, out, "A", *COMMON, "--pipeline-parallel-size", str(stages), *extra,
              faults=f"pp.stage_step.{killed}=kill@45")
    code = a.wait()
    log = a.log()
    assert code == 4, log
    assert "pipeline" in log and "without acking" in log
    assert len(pending_ids(redis_client, "A")) == 4  # what it held stays pending, for another worker
    assert len(rows(out / "results")) == 4
    _finish_with_another_worker(redis_url, redis_client, out, expected, f"pipeline stage {killed} of {stages} killed")
    return log


def test_a_middle_stage_killed_mid_step_stops_the_worker_and_loses_nothing(redis_url, redis_client, tmp_path):
    # Stage 1 of 3 dies: stage 2 waits for it in vain, fails and exits, and rank 0 (stage 0), waiting
    # for the last stage's logits, stops the worker. (Three stages are the fewest with a middle one,
    # each a process of its own.)
    log = _kill_a_stage(redis_url, redis_client, tmp_path, "pp-middle-killed", 3, 1)
    assert "pipeline rank 1 (stage 1 of 3) exited with code -9" in log


@pytest.mark.slow
def test_the_last_stage_of_a_tensor_parallel_pipeline_killed_loses_nothing(redis_url, redis_client, tmp_path):
    # T = 2 x P = 2: both ranks of stage 1 (the last, which sends the logits) die together.
    log = _kill_a_stage(redis_url, redis_client, tmp_path, "pp-last-killed", 2, 1, "--tensor-parallel-size", "2")
    assert "(stage 1 of 2) exited with code -9" in log
