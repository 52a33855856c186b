"""Workers killed or failing at named points: nothing lost, duplicates only until compaction.

Each case runs real `mqinfer worker` processes against the embedded server, arms one fault point
(``MQINFER_FAULTS``) or sends a real signal, lets a second worker take over, then compacts and
checks that every submitted request has exactly one row and one billed cost row.
"""

from __future__ import annotations

import shutil
import time

import pytest

from mqinfer.ops.report import cost_report

from tests.faults.faultkit import (
    check_lost_time,
    compact,
    compact_and_check,
    killed,
    pending_by_consumer,
    pending_ids,
    record,
    requests,
    result_keys,
    spawn,
    submit,
    temp_files,
    wait_claimable,
)
from tests.helpers import rows


def test_kill_9_mid_decode_then_another_worker_reclaims(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("mid-decode", 8, 40))
    out = tmp_path / "out"
    # Four at a time (it reads the other four into its waiting queue): the first four finish
    # (about 42 steps) and are acked (a row is flushed as soon as it is written); at step 60 the
    # next four are mid-decode when the process dies.
    a = spawn(redis_url, out, "A", "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-rows", "1",
              faults="worker.after_step=kill@60")
    a.wait()
    died = time.time()
    assert killed(a), a.log()
    held = pending_ids(redis_client, "A")
    assert len(held) == 4, held  # it died holding the four it was decoding
    written_by_a = len(rows(out / "results"))
    assert written_by_a == 4

    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert pending_by_consumer(redis_client) == {}

    outcome = compact_and_check(out, expected, redis_client)
    attempts = {k: r["attempt"] for k, r in outcome.by_key.items()}
    assert sorted(attempts.values()).count(2) == 4  # the re-claimed ones count a second delivery
    assert all(r["output_tokens"] == 40 for r in outcome.by_key.values())
    # B found A dead and billed the time A used and never wrote (the steps of the four requests it
    # was decoding) as one lost row: A's rows cover its uptime again, and the reports count it.
    lost = check_lost_time(out, "A", died, beat_s=1000 / 3000)
    totals = cost_report(out, basis="allocation").totals
    every_row = sum(c["device_s"] for c in rows(out / "costs"))
    assert totals.device_s_by_kind["lost"] == pytest.approx(lost["device_s"])
    assert totals.device_s == pytest.approx(every_row)
    assert totals.billed.device_s + totals.allocated.device_s + totals.unallocated.device_s \
        + totals.duplicate.device_s == pytest.approx(every_row)
    record("kill -9 mid-decode", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           injected_kills=1)


@pytest.fixture(scope="module")
def killed_after_rename(redis_server, tmp_path_factory):
    """An output folder where worker A died after its rows were durable and before its ack, and
    worker B computed those requests again (the duplicates compaction must remove)."""
    client = redis_server.client()
    client.flushall()
    url = redis_server.url
    expected = submit(url, requests("after-rename", 10, 24))
    base = tmp_path_factory.mktemp("after-rename")
    out = base / "out"
    # Hit 1 is the startup cost row's flush; hit 2 is the first flush holding results.
    a = spawn(url, out, "A", "--claim-idle-ms", "1000", faults="sink.after_write=kill@2")
    a.wait()
    assert killed(a), a.log()
    rows_by_a = len(rows(out / "results"))
    held_by_a = len(pending_ids(client, "A"))
    b = spawn(url, out, "B", "--claim-idle-ms", "1000", "--metrics-port", "0", log_level="info")
    try:
        port = b.metrics_port()
        from tests.helpers import wait_until

        wait_until(lambda: not pending_by_consumer(client), timeout=90, what="B to finish everything")
        metrics = b.metrics(port)
    finally:
        b.signal(15)
    assert b.wait() == 0, b.log()
    snapshot = base / "uncompacted"
    shutil.copytree(out, snapshot)
    client.close()
    return {"out": out, "snapshot": snapshot, "expected": expected, "rows_by_a": rows_by_a,
            "held_by_a": held_by_a, "metrics": metrics}


def test_kill_9_after_rename_before_ack_duplicates_removed_by_compaction(killed_after_rename):
    case = killed_after_rename
    out, expected = case["out"], case["expected"]
    assert case["rows_by_a"] >= 1  # A's rows are durable...
    assert case["held_by_a"] == len(expected)  # ...and none of its entries was acked
    before = result_keys(out)
    assert len(before) == len(expected) + case["rows_by_a"]  # B computed A's requests again
    # B took every entry over from A: each is a redelivery in its metrics.
    assert case["metrics"]["mqinfer_redeliveries_total"] == len(expected)
    outcome = compact_and_check(out, expected)
    assert outcome.duplicates_removed == case["rows_by_a"]
    assert outcome.cost_rows_marked_duplicate == case["rows_by_a"]
    record("kill -9 after rename, before ack", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           injected_kills=1, redeliveries=int(case["metrics"]["mqinfer_redeliveries_total"]))


COMPACT_STEPS = ["temp_written", "journal_written", "rename:1", "delete:0"]


def _table(out, dataset):
    return sorted((tuple(sorted((k, repr(v)) for k, v in r.items())) for r in rows(out / dataset)))


def test_kill_9_during_compact_then_rerun_gives_the_same_rows(killed_after_rename, tmp_path):
    case = killed_after_rename
    reference = tmp_path / "reference"
    shutil.copytree(case["snapshot"], reference)
    assert compact(reference).returncode == 0
    want_results, want_costs = _table(reference, "results"), _table(reference, "costs")
    steps = COMPACT_STEPS + ["rename:0+recover:rename:0"]
    for step in steps:
        out = tmp_path / step.replace(":", "_").replace("+", "_")
        shutil.copytree(case["snapshot"], out)
        first, _, recovery = step.partition("+")
        crashed = compact(out, faults=f"compact.{first}=kill")
        assert crashed.returncode == -9, (step, crashed.stdout, crashed.stderr)
        if recovery:  # killed again while finishing the first run's journal
            again = compact(out, faults=f"compact.{recovery}=kill")
            assert again.returncode == -9, (step, again.stderr)
        rerun = compact(out)
        assert rerun.returncode == 0, (step, rerun.stderr)
        assert _table(out, "results") == want_results, step
        assert _table(out, "costs") == want_costs, step
        assert not list(out.rglob(".compact-*")), step
    record("kill -9 during compact", submitted=len(case["expected"]), rows_before=len(result_keys(case["snapshot"])),
           rows_after=len(want_results), lost=0, duplicated=0, worker_crashes=0, injected_kills=len(steps) + 1)


def test_kill_9_inside_parquet_write_leaves_no_partial_file(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("in-write", 8, 16))
    out = tmp_path / "out"
    # Killed with the first results part written and fsynced under its temporary name, not renamed.
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", faults="sink.results.before_rename=kill")
    a.wait()
    assert killed(a), a.log()
    leftovers = temp_files(out / "results")
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    assert rows(out / "results") == []  # no partial file at a final path: nothing published
    orphan_costs = [c for c in rows(out / "costs") if c["kind"] == "request"]
    assert len(orphan_costs) >= 1  # costs are written first: these bill rows that never appeared
    assert len(pending_ids(redis_client, "A")) == len(expected)

    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5", log_level="info")
    assert b.wait() == 0, b.log()
    assert "removed 1 leftover temporary part files" in b.log()
    assert temp_files(out) == []
    outcome = compact_and_check(out, expected, redis_client)
    assert outcome.cost_rows_marked_duplicate == len(orphan_costs)
    record("kill -9 inside a Parquet write", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           injected_kills=1, orphan_cost_rows=len(orphan_costs))


def test_full_disk_no_ack_exit_3_then_another_worker_finishes(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("enospc", 8, 16))
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", faults="sink.results.before_rename=enospc")
    assert a.wait() == 3, a.log()
    assert "cannot write result rows" in a.log() and "No space left on device" in a.log()
    assert rows(out / "results") == []
    assert temp_files(out) == []  # the failed write cleaned up after itself
    # Nothing unwritten was acked: every entry A read is still pending under its name.
    assert pending_ids(redis_client, "A") == pending_ids(redis_client) and len(pending_ids(redis_client)) == 8

    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert pending_by_consumer(redis_client) == {}
    outcome = compact_and_check(out, expected, redis_client)
    assert all(r["worker"] == "B" for r in outcome.by_key.values())
    record("full disk (ENOSPC on the results write)", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           unhealthy_exits=1)
