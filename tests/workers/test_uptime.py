"""Uptime records and the ``lost`` row: a dead worker's unwritten time is billed once, by one claimer,
as the same row whoever writes it; a stopped worker and a live one are never billed."""

from __future__ import annotations

import pytest

from mqinfer.ops.compact import compact
from mqinfer.schemas import keys
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA
from mqinfer.workers.queue.uptime import LostTime, UptimeRecord
from tests.helpers import rows

T = 1_700_000_000.0
CLAIM_IDLE_MS = 4000  # dead after 4 s without a beat; a claim in progress is taken over after 4 s


def record(redis_client, name: str = "A") -> UptimeRecord:
    return UptimeRecord(redis_client, "requests", name, started_at=T, model="tiny@abc", price_per_device_hour=36.0)


def claimer(redis_client, name: str) -> LostTime:
    return LostTime(redis_client, "requests", keys.GROUP, name, claim_idle_ms=CLAIM_IDLE_MS)


def test_a_dead_worker_is_billed_its_unwritten_time_once(redis_client):
    a = record(redis_client)
    a.beat(T + 5.0, billed_s=0.0)
    a.before_write(T + 6.0, 4.0)  # 4 s of rows flushed...
    a.written(4.0)
    a.beat(T + 10.0, billed_s=a.billed_s)  # ...its last sign of life, then it is killed
    b, c = claimer(redis_client, "B"), claimer(redis_client, "C")
    assert b.claim(["A"], T + 13.0) == []  # a beat 3 s ago: alive
    (row,) = b.claim(["A"], T + 14.5)
    assert (row.kind, row.worker, row.model, row.job_id, row.tenant) == ("lost", "A", "tiny@abc", None, None)
    # Its rows (4 s) and the lost row cover its uptime up to its last beat.
    assert row.device_s == pytest.approx(10.0 - 4.0) and row.finished_at == T + 10.0
    assert row.cost_usd == pytest.approx(6.0 * 36.0 / 3600) and row.price_per_device_hour == 36.0
    assert c.claim(["A"], T + 14.6) == []  # being billed by B
    b.confirm()
    assert c.claim(["A"], T + 60.0) == [] and b.claim(["A"], T + 60.0) == []  # billed


def test_a_claimer_that_dies_before_its_row_is_durable_is_replaced_by_one_writing_the_same_row(redis_client,
                                                                                                tmp_path):
    a = record(redis_client)
    a.beat(T + 3.0, billed_s=1.25)
    b, c = claimer(redis_client, "B"), claimer(redis_client, "C")
    (first,) = b.claim(["A"], T + 10.0)  # B dies without confirming
    assert c.claim(["A"], T + 12.0) == []  # its claim holds a while
    (second,) = c.claim(["A"], T + 14.5)
    assert second == first  # identical in every column: compaction keeps one if both were written
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "B").write([first])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "C").write([second])
    compact(tmp_path)
    assert [(r["kind"], r["worker"]) for r in rows(tmp_path / "costs")] == [("lost", "A")]
    c.confirm()
    b.confirm()  # a late confirm of the replaced claimer changes nothing
    assert claimer(redis_client, "D").claim(["A"], T + 100.0) == []
    assert redis_client.hget(keys.worker_uptime("requests", "A"), "claim") == b"C"


def test_a_stopped_worker_and_one_without_a_record_are_not_billed(redis_client):
    a = record(redis_client)
    a.beat(T + 1.0, billed_s=0.0)
    a.close(T + 2.0)
    assert claimer(redis_client, "B").claim(["A", "never-started"], T + 100.0) == []


def test_a_stalled_worker_billed_as_lost_gives_the_seconds_back_from_its_idle_rows(redis_client):
    a = record(redis_client)
    a.beat(T + 2.0, billed_s=0.5)
    b = claimer(redis_client, "B")
    (row,) = b.claim(["A"], T + 30.0)  # a 28 s step: taken for dead
    assert row.device_s == pytest.approx(1.5)
    b.confirm()
    a.beat(T + 31.0, billed_s=0.5)  # it was alive after all
    assert a.credit_s == pytest.approx(1.5)
    assert a.idle_to_bill(1.0) == 0.0 and a.idle_to_bill(2.0) == pytest.approx(1.5) and a.credit_s == 0.0
    a.beat(T + 32.0, billed_s=0.5)
    assert a.credit_s == 0.0  # given back once
    # Killed later: only the time after the first lost row is billed again.
    a.beat(T + 40.0, billed_s=3.0)
    (again,) = claimer(redis_client, "C").claim(["A"], T + 50.0)
    assert again.device_s == pytest.approx(40.0 - 3.0 - 1.5) and again.finished_at == T + 40.0


def test_a_worker_restarted_under_the_same_name_bills_its_previous_life_then_starts_over(redis_client):
    a = record(redis_client)
    a.beat(T + 5.0, billed_s=1.0)  # then killed; restarted at once with the same --consumer
    again = UptimeRecord(redis_client, "requests", "A", started_at=T + 6.0, model="tiny@abc",
                         price_per_device_hour=36.0)
    (row,) = claimer(redis_client, "A").previous_life(T + 6.5)  # no wait for --claim-idle-ms
    assert (row.worker, row.device_s, row.finished_at) == ("A", pytest.approx(4.0), T + 5.0)
    again.beat(T + 6.5, billed_s=0.0, fresh=True)
    fields = redis_client.hgetall(keys.worker_uptime("requests", "A"))
    assert b"claim" not in fields and b"lost_s" not in fields and fields[b"started_at"] == repr(T + 6.0).encode()
    # Killed again: billed from its new start only.
    again.beat(T + 9.0, billed_s=0.5)
    (second,) = claimer(redis_client, "B").claim(["A"], T + 14.0)
    assert second.device_s == pytest.approx(9.0 - 6.0 - 0.5)


def test_a_live_worker_waiting_on_the_stream_is_not_taken_for_dead_under_a_short_claim_idle_time(redis_client):
    # Its reads block up to a second between beats: with --claim-idle-ms 1000, a beat 2 s old is
    # still a live worker.
    a = record(redis_client)
    a.beat(T + 10.0, billed_s=0.0)
    short = LostTime(redis_client, "requests", keys.GROUP, "B", claim_idle_ms=1000)
    assert short.claim(["A"], T + 12.0) == []
    assert len(short.claim(["A"], T + 13.0)) == 1


def test_a_dead_worker_holding_a_share_of_the_device_is_billed_its_share_of_the_lost_time(redis_client):
    # One thread of a 4-core machine: its rows cover a quarter of its uptime, and so does its lost row.
    a = UptimeRecord(redis_client, "requests", "A", started_at=T, model="tiny@abc", price_per_device_hour=36.0,
                     device_share=0.25)
    a.beat(T + 2.0, billed_s=0.0)
    a.before_write(T + 4.0, 1.0)
    a.written(1.0)
    a.beat(T + 10.0, billed_s=a.billed_s)  # then killed
    (row,) = claimer(redis_client, "B").claim(["A"], T + 20.0)
    assert row.device_share == 0.25
    assert row.device_s == pytest.approx(10.0 * 0.25 - 1.0) and row.cost_usd == pytest.approx(1.5 * 36.0 / 3600)


def test_a_record_without_a_share_counts_one_device(redis_client):
    # Left by a worker from before records held their share: it billed whole devices.
    a = record(redis_client)
    a.beat(T + 8.0, billed_s=3.0)
    redis_client.hdel(keys.worker_uptime("requests", "A"), "share")
    (row,) = claimer(redis_client, "B").claim(["A"], T + 20.0)
    assert (row.device_s, row.device_share) == (pytest.approx(5.0), 1.0)
