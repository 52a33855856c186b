"""Parquet sinks: partitioning, atomic publication, crash leftovers, flush policy and order."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow
from mqinfer.schemas.dataset import DatasetWriter, part_files, partition_for, remove_temp_files
from mqinfer.workers.queue.sink import Sinks
from tests.helpers import FakeClock

DAY1 = 1_700_000_000.0  # 2023-11-14 UTC
DAY2 = DAY1 + 86_400


def result(i: int, finished_at: float = DAY1, job: str | None = "j") -> ResultRow:
    return ResultRow(job_id=job, id=f"r{i}", model="tiny", finish_reason="stop", prompt_tokens=2, output_tokens=1,
                     output_token_ids=[i], text="x", finished_at=finished_at, worker="w-1")


def cost(i: int, finished_at: float = DAY1) -> CostRow:
    return CostRow(kind="request", job_id="j", id=f"r{i}", tenant="default", model="tiny", device_s=0.5,
                   cost_usd=0.01, worker="w-1", finished_at=finished_at)


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def read(paths) -> list[dict]:
    return [row for p in paths for row in pq.read_table(p).to_pylist()]


def test_partition_is_the_utc_date_of_finished_at():
    assert partition_for(DAY1) == "date=2023-11-14"
    assert partition_for(1_700_006_399.999999) == "date=2023-11-14"  # the last µs of the day
    assert partition_for(0.0) == "date=1970-01-01"


def test_writer_publishes_one_part_per_partition(tmp_path):
    writer = DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "host/1:a")
    paths = writer.write([result(1), result(2, DAY2), result(3)])
    assert [p.parent.name for p in paths] == ["date=2023-11-14", "date=2023-11-15"]
    for p in paths:
        assert p.name.startswith("part-host_1_a-") and p.suffix == ".parquet"
    assert [r["id"] for r in read(paths)] == ["r1", "r3", "r2"]
    assert not [f for f in all_files(tmp_path) if ".tmp-" in f]
    assert part_files(tmp_path / "results") == sorted(paths)


def test_part_names_sort_by_write_time(tmp_path):
    writer = DatasetWriter(tmp_path, COST_SCHEMA, "w")
    written = [writer.write([cost(i)])[0].name for i in range(30)]
    assert sorted(written) == written and len(set(written)) == 30


def test_failure_before_rename_leaves_no_file(tmp_path):
    def boom(temp: Path) -> None:
        assert temp.exists() and temp.name.startswith(".tmp-")
        raise OSError("disk full")

    writer = DatasetWriter(tmp_path, RESULT_SCHEMA, "w", before_rename=boom)
    with pytest.raises(OSError, match="disk full"):
        writer.write([result(1)])
    assert all_files(tmp_path) == []


def test_crash_leaves_a_temp_file_that_remove_temp_files_deletes(tmp_path):
    # A real crash: the process dies between fsync and rename.
    script = textwrap.dedent(f"""
        import os
        from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow
        from mqinfer.schemas.dataset import DatasetWriter
        row = ResultRow(id="r", model="m", finish_reason="stop", finished_at={DAY1}, worker="w")
        DatasetWriter({str(tmp_path)!r}, RESULT_SCHEMA, "w", before_rename=lambda p: os._exit(3)).write([row])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    left = all_files(tmp_path)
    assert len(left) == 1 and left[0].startswith("date=2023-11-14/.tmp-")
    assert part_files(tmp_path) == []
    assert remove_temp_files(tmp_path) == 1
    assert all_files(tmp_path) == []
    assert remove_temp_files(tmp_path / "missing") == 0


def test_remove_temp_files_spares_a_live_writer(tmp_path):
    seen = []

    def cleanup_meanwhile(temp: Path) -> None:
        seen.append(remove_temp_files(tmp_path))  # another worker starting up right now

    writer = DatasetWriter(tmp_path, RESULT_SCHEMA, "w", before_rename=cleanup_meanwhile)
    paths = writer.write([result(1)])
    assert seen == [0]
    assert [r["id"] for r in read(paths)] == ["r1"]


def test_flush_policy_by_rows_and_age(tmp_path):
    clock = FakeClock(100.0)
    sinks = Sinks(tmp_path, "w-1", flush_rows=4, flush_interval_s=2.0, clock=clock)
    assert not sinks.should_flush() and sinks.pending == 0
    sinks.add(result(1), cost(1))
    assert sinks.pending == 2 and not sinks.should_flush()
    clock.advance(1.9)
    assert not sinks.should_flush()
    clock.advance(0.1)
    assert sinks.should_flush()  # the oldest row waited the interval
    assert sinks.flush() == 2 and sinks.pending == 0 and not sinks.should_flush()
    sinks.add(result(2), cost(2))
    sinks.add_cost(CostRow(kind="idle", device_s=1.0, worker="w-1", finished_at=DAY1))
    assert not sinks.should_flush()
    sinks.add_cost(CostRow(kind="startup", device_s=3.0, worker="w-1", finished_at=DAY1))
    assert sinks.should_flush() and sinks.pending == 4
    assert sinks.flush() == 4
    costs = read(part_files(tmp_path / "costs"))
    assert sorted(r["kind"] for r in costs) == ["idle", "request", "request", "startup"]
    assert sorted(r["id"] for r in read(part_files(tmp_path / "results"))) == ["r1", "r2"]
    assert sinks.flush() == 0


def test_flush_writes_costs_before_results(tmp_path):
    order = []
    sinks = Sinks(tmp_path, "w-1", before_rename=lambda temp: order.append(temp.parent.parent.name))
    sinks.add(result(1), cost(1))
    sinks.add(result(2, DAY2), cost(2, DAY2))
    sinks.flush()
    assert order == ["costs", "costs", "results", "results"]


def test_failed_flush_keeps_unwritten_rows_and_never_writes_twice(tmp_path):
    failures = {"results": 1}

    def flaky(temp: Path) -> None:
        dataset = temp.parent.parent.name
        if failures.get(dataset):
            failures[dataset] -= 1
            raise OSError(f"{dataset}: no space left")

    sinks = Sinks(tmp_path, "w-1", before_rename=flaky)
    for i in range(3):
        sinks.add(result(i), cost(i))
    with pytest.raises(OSError, match="results: no space left"):
        sinks.flush()
    # The costs were published; the results wait for the next flush.
    assert len(read(part_files(tmp_path / "costs"))) == 3
    assert part_files(tmp_path / "results") == []
    assert sinks.pending == 3
    assert sinks.flush() == 3
    assert sorted(r["id"] for r in read(part_files(tmp_path / "results"))) == ["r0", "r1", "r2"]
    assert len(read(part_files(tmp_path / "costs"))) == 3  # not written again
    assert not [f for f in all_files(tmp_path) if ".tmp-" in f]


def test_bad_row_is_refused_when_added(tmp_path):
    sinks = Sinks(tmp_path, "w-1")
    bad = ResultRow(id="r", model=None, finish_reason="stop", finished_at=DAY1, worker="w-1")
    with pytest.raises(ValueError, match="`model` must not be null"):
        sinks.add(bad, cost(1))
    with pytest.raises(ValueError, match="`output_tokens` must be an int32"):
        sinks.add(result(1), CostRow(kind="request", output_tokens=2**31, worker="w-1", finished_at=DAY1))
    with pytest.raises(ValueError, match="`finished_at` must not be null"):
        sinks.add_cost(CostRow(kind="idle", worker="w-1", finished_at=None))
    assert sinks.pending == 0
    with pytest.raises(ValueError, match="flush_rows"):
        Sinks(tmp_path, "w", flush_rows=0)
