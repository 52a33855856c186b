"""Workers stopped, paused and racing: SIGTERM drains, a paused worker's late work does not double
rows, and two workers re-claiming a dead one's entries at once each take distinct entries."""

from __future__ import annotations

import signal
import time
from collections import Counter

from mqinfer.schemas import keys
from tests.faults.faultkit import (
    STREAM,
    compact_and_check,
    consumers,
    killed,
    pending_by_consumer,
    pending_ids,
    record,
    requests,
    result_keys,
    spawn,
    submit,
    wait_claimable,
)
from tests.helpers import rows, wait_until

HANDBACK = "mqinfer-handback"


def test_sigterm_drains_hands_back_and_leaves_nothing_pending_under_its_name(redis_url, redis_client, tmp_path):
    short = requests("drain", 4, 6, prefix="short")
    long = requests("drain", 4, 250, prefix="long")
    expected = submit(redis_url, short + long)
    out = tmp_path / "out"
    # Eight running at once; the short ones finish, and a 0.1 s drain is far too short for the long
    # ones (250 steps).
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", "--drain-timeout-s", "0.1")
    # A flush writes the short ones' rows, then acks them: until the ack, all eight are pending.
    wait_until(lambda: len(rows(out / "results")) >= 4 and len(pending_ids(redis_client, "A")) <= 4, timeout=60,
               what="the short requests' rows and acks")
    assert len(pending_ids(redis_client, "A")) == 4  # the long ones are running
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.log()

    assert pending_ids(redis_client, "A") == set()
    assert "A" not in consumers(redis_client)  # it left the group, owning nothing
    handed_back = pending_ids(redis_client, HANDBACK)
    assert len(handed_back) == 4
    # Handed back entries are claimable at once, and A's unfinished delivery does not count.
    for p in redis_client.xpending_range(STREAM, keys.GROUP, "-", "+", 10, consumername=HANDBACK):
        assert p["time_since_delivered"] >= 1000 and p["times_delivered"] == 0

    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert pending_by_consumer(redis_client) == {}
    outcome = compact_and_check(out, expected, redis_client)
    assert {k[1] for k, r in outcome.by_key.items() if r["worker"] == "A"} == {f"short{i}" for i in range(4)}
    longs = [r for k, r in outcome.by_key.items() if k[1].startswith("long")]
    assert all(r["output_tokens"] == 250 and r["worker"] == "B" and r["attempt"] == 1 for r in longs)
    record("SIGTERM drain (0.1 s drain timeout)", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           handed_back=len(handed_back))


def test_sigstop_past_claim_idle_then_sigcont_gives_no_second_row(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("paused", 6, 160))
    out = tmp_path / "out"
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    wait_until(lambda: len(pending_ids(redis_client, "A")) == 6, timeout=60, what="A to read everything")
    # A moment for A to get into its decode, so that the stop lands mid-request (any
    # moment would do; nothing observable marks "decoding" from outside).
    time.sleep(0.05)
    a.signal(signal.SIGSTOP)
    try:
        assert pending_ids(redis_client, "A")  # stopped holding entries
        paused_at = time.monotonic()
        b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
        wait_until(lambda: {k[1] for k in result_keys(out)} >= {k[1] for k in expected} and not pending_ids(redis_client),
                   timeout=90, what="B to finish A's requests")
        paused_s = time.monotonic() - paused_at
    finally:
        a.signal(signal.SIGCONT)
    assert a.wait() == 0, a.log()  # resumed, noticed its entries were taken, kept serving, exited
    assert b.wait() == 0, b.log()
    assert paused_s > 1.0
    late_rows_by_a = sum(1 for r in rows(out / "results") if r["worker"] == "A")
    outcome = compact_and_check(out, expected, redis_client)
    assert outcome.duplicates_removed == late_rows_by_a
    record("SIGSTOP past the claim idle time, then SIGCONT", submitted=len(expected),
           rows_before=outcome.rows_before, rows_after=outcome.rows_after, lost=0,
           duplicated=outcome.duplicates_removed, worker_crashes=0, paused_s=round(paused_s, 1),
           late_rows_by_paused_worker=late_rows_by_a)


def test_two_workers_reclaiming_at_once_take_each_entry_once(redis_url, redis_client, tmp_path):
    expected = submit(redis_url, requests("race", 24, 30))
    out = tmp_path / "out"
    # A reads all 24 and dies at its fifth step, before any result row is written.
    a = spawn(redis_url, out, "A", "--claim-idle-ms", "2000", "--flush-interval-s", "60", "--flush-rows", "10000",
              faults="worker.after_step=kill@5")
    a.wait()
    assert killed(a), a.log()
    assert len(pending_ids(redis_client, "A")) == 24 and rows(out / "results") == []
    # A's entries become claimable once idle for the claim idle time. Both workers start after
    # that, so that each finds all 24 claimable at once rather than idling out (--idle-exit-s)
    # before the first of them is.
    wait_claimable(redis_client, 2000)

    # Both start together and take over in chunks of four (--max-batch bounds each claim).
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "2000", "--max-batch", "4", "--idle-exit-s", "1.5")
    c = spawn(redis_url, out, "C", "--claim-idle-ms", "2000", "--max-batch", "4", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()
    assert c.wait() == 0, c.log()
    assert pending_by_consumer(redis_client) == {}

    before = rows(out / "results")
    per_worker = Counter(r["worker"] for r in before)
    assert len(before) == 24 and len({r["id"] for r in before}) == 24  # no entry taken twice
    assert set(per_worker) <= {"B", "C"} and sum(per_worker.values()) == 24
    assert all(r["attempt"] == 2 for r in before)
    outcome = compact_and_check(out, expected, redis_client)
    assert outcome.duplicates_removed == 0
    record("two workers re-claiming at once", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           injected_kills=1, rows_by_worker=dict(per_worker))
