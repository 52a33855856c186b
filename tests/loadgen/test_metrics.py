"""Throughput and percentile arithmetic on hand-made rows and a real results Parquet file."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.loadgen.metrics import (
    RequestTiming,
    percentile,
    percentiles,
    summarize,
    timings_from_results,
    timings_from_rows,
    token_agreement,
    ttft_budget,
)

T0 = 1_800_000_000.0


def row(rid, *, enq, start, first, fin, out, reason="length", prompt=10):
    return {"id": rid, "finish_reason": reason, "prompt_tokens": prompt, "output_tokens": out,
            "enqueued_at": T0 + enq, "started_at": T0 + start, "first_token_at": None if first is None else T0 + first,
            "finished_at": T0 + fin}


ROWS = [
    row("a", enq=0.0, start=1.0, first=1.5, fin=3.5, out=5),   # ttft 1.5, e2e 3.5, tpot 2/4 = 0.5
    row("b", enq=0.0, start=2.0, first=2.2, fin=4.2, out=11),  # ttft 2.2, e2e 4.2, tpot 2/10 = 0.2
    row("c", enq=0.5, start=1.0, first=1.1, fin=6.0, out=8),   # asked for 6: only 6 count; ttft 0.6, e2e 5.5
    row("d", enq=0.5, start=1.0, first=None, fin=1.0, out=0, reason="error"),
    row("other-job", enq=0, start=0, first=0, fin=100, out=1000),
]
REQUESTED = {"a": 5, "b": 11, "c": 6, "d": 4}


def test_summary_of_hand_made_rows():
    timings = timings_from_rows(ROWS, REQUESTED)
    assert [t.id for t in timings] == ["a", "b", "c", "d"]
    s = summarize(timings)
    assert s.num_requests == 4 and s.num_errors == 1
    assert s.requested_tokens == 5 + 11 + 6
    assert s.span_s == pytest.approx(6.0 - 1.0)  # first ok start (1.0) to last ok finish (6.0)
    assert s.throughput == pytest.approx(22 / 5.0)
    assert s.ttft.count == 3 and s.ttft.p50 == pytest.approx(1.5)
    assert s.ttft.max == pytest.approx(2.2) and s.ttft.mean == pytest.approx((1.5 + 2.2 + 0.6) / 3)
    # sorted e2e: 3.5, 4.2, 5.5 -> p90 = 4.2 + 0.8 * 1.3
    assert s.e2e.p50 == pytest.approx(4.2) and s.e2e.p90 == pytest.approx(4.2 + 0.8 * 1.3)
    assert s.e2e.p99 == pytest.approx(4.2 + 0.98 * 1.3)
    # tpot: a 0.5, b 0.2, c 4.9 / 7 = 0.7
    assert s.tpot.p50 == pytest.approx(0.5) and s.tpot.max == pytest.approx(0.7)


def test_no_successful_rows_means_no_throughput():
    s = summarize(timings_from_rows([ROWS[3]], REQUESTED))
    assert s.num_errors == 1 and s.throughput == 0.0 and s.ttft is None and s.e2e is None


def test_percentile_matches_known_values_and_numpy():
    values = list(range(1, 102))  # 1..101
    assert percentile(values, 50) == 51 and percentile(values, 90) == 91 and percentile(values, 99) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentiles([None, None]) is None
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=60), st.sampled_from([0, 50, 90, 99, 100]))
def test_percentile_agrees_with_numpy(values, q):
    assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-9)


def test_counted_tokens_never_exceed_the_request():
    t = RequestTiming("x", 3, requested_tokens=4, output_tokens=9, enqueued_at=0, started_at=0,
                      first_token_at=1, finished_at=2)
    assert t.counted_tokens == 4 and t.tpot == pytest.approx(1 / 8)
    short = RequestTiming("y", 3, 4, 1, 0, 0, 1, 2)
    assert short.tpot is None and short.counted_tokens == 1


def test_timings_from_a_real_results_parquet_file(tmp_path):
    def ts(seconds):
        return datetime.fromtimestamp(T0 + seconds, tz=timezone.utc)

    schema = pa.schema([
        ("job_id", pa.string()), ("id", pa.string()), ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()),
        ("output_token_ids", pa.list_(pa.int32())),
        ("enqueued_at", pa.timestamp("us", tz="UTC")), ("started_at", pa.timestamp("us", tz="UTC")),
        ("first_token_at", pa.timestamp("us", tz="UTC")), ("finished_at", pa.timestamp("us", tz="UTC")),
    ])
    table = pa.Table.from_pylist([
        {"job_id": "j", "id": "a", "finish_reason": "length", "prompt_tokens": 7, "output_tokens": 3,
         "output_token_ids": [5, 6, 7], "enqueued_at": ts(0), "started_at": ts(0.25), "first_token_at": ts(0.5),
         "finished_at": ts(1.5)},
        {"job_id": "j", "id": "b", "finish_reason": "length", "prompt_tokens": 9, "output_tokens": 2,
         "output_token_ids": [8, 9], "enqueued_at": ts(0), "started_at": ts(0.75), "first_token_at": ts(1.0),
         "finished_at": ts(2.25)},
    ], schema=schema)
    (tmp_path / "results" / "date=2026-12-02").mkdir(parents=True)
    pq.write_table(table, tmp_path / "results" / "date=2026-12-02" / "part-0.parquet")
    read = ds.dataset(tmp_path / "results", format="parquet", partitioning="hive").to_table()
    timings = timings_from_results(read, {"a": 3, "b": 2})
    by_id = {t.id: t for t in timings}
    assert by_id["a"].started_at == pytest.approx(T0 + 0.25) and by_id["a"].ttft == pytest.approx(0.5)
    assert by_id["b"].e2e == pytest.approx(2.25) and by_id["b"].prompt_tokens == 9
    s = summarize(timings)
    assert s.throughput == pytest.approx(5 / 2.0)  # 5 tokens over 0.25 .. 2.25


def test_token_agreement():
    a = {"x": [1, 2, 3, 4], "y": [5, 6], "z": [9], "only-a": [1]}
    b = {"x": [1, 2, 0, 0], "y": [5, 6], "z": [8]}
    g = token_agreement(a, b)
    assert g.compared == 3
    assert g.first_token == pytest.approx(2 / 3) and g.identical == pytest.approx(1 / 3)
    assert g.common_prefix == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert token_agreement({"x": [1]}, {"y": [1]}) is None


def test_ttft_budget_is_max_wait_plus_three_steps():
    b = ttft_budget(0.080, max_wait_s=0.010, step_s=0.025)
    assert b.steps == 3 and b.budget_s == pytest.approx(0.085) and b.met
    assert not ttft_budget(0.090, 0.010, 0.025).met
    assert ttft_budget(0.085, 0.010, 0.025).met  # at most: the budget itself passes
    assert ttft_budget(0.3, 0.05, 0.1, steps=2).budget_s == pytest.approx(0.25)
    for bad in (-0.001, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ttft_budget(0.1, bad, 0.01)
        with pytest.raises(ValueError):
            ttft_budget(bad, 0.01, 0.01)
    with pytest.raises(ValueError):
        ttft_budget(0.1, 0.01, 0.01, steps=-1)
