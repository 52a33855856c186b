"""Compaction: the keep rules, cost marking, idempotence, and crash safety at every step."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mqinfer.ops.compact import JOURNAL_NAME, CompactStats, compact
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow
from mqinfer.schemas.dataset import DatasetWriter, part_files

T = 1_700_000_000.0  # 2023-11-14 UTC
DAY2 = T + 86_400


def res(rid, job, worker, at, *, error=False, text="ok") -> ResultRow:
    return ResultRow(
        job_id=job, id=rid, model="tiny", finish_reason="error" if error else "stop",
        error_code="internal_error" if error else None, error="boom" if error else None,
        prompt_tokens=0 if error else 3, output_tokens=0 if error else 2, output_token_ids=[] if error else [5, 6],
        text=None if error else text, finished_at=at, worker=worker, attempt=1,
    )


def cost(rid, job, worker, at, *, kind="request", device_s=1.0) -> CostRow:
    return CostRow(kind=kind, job_id=job, id=rid, tenant=None if rid is None else "t", model="tiny",
                   request_type=None if rid is None else "default", prompt_tokens=3, output_tokens=2,
                   device_s=device_s, cost_usd=device_s / 1000, price_per_device_hour=3.6, worker=worker,
                   finished_at=at)


def build(out: Path) -> None:
    """A dataset with every case of the keep and marking rules, written as workers would."""
    r1 = DatasetWriter(out / "results", RESULT_SCHEMA, "w1")
    r2 = DatasetWriter(out / "results", RESULT_SCHEMA, "w2")
    c1 = DatasetWriter(out / "costs", COST_SCHEMA, "w1")
    c2 = DatasetWriter(out / "costs", COST_SCHEMA, "w2")
    r1.write([
        res("A", "j", "w1", T + 1, error=True),
        res("B", "j", "w1", T + 2, error=True),
        res("C", "j", "w1", T + 4, text="late"),
        res("D", None, "w1", T + 6),
        res("D", "j", "w1", T + 6),
        res("F", "j", "w1", T + 8, text="w1 wins the file-name tie"),
        res("G", "j", "w1", T + 9, text="first row"),
        res("G", "j", "w1", T + 9, text="second row"),
        res("E", "j", "w1", DAY2 + 1, error=True),
    ])
    r1.write([res("D", "j", "w1", T + 6)])  # the same row again: a retried write
    r2.write([
        res("A", "j", "w2", T + 5),
        res("B", "j", "w2", T + 3, error=True),
        res("C", "j", "w2", T + 3, text="early"),
        res("F", "j", "w2", T + 8, text="w2 loses the tie"),
        res("E", "j", "w2", T + 7),
    ])
    c1.write([
        cost("A", "j", "w1", T + 1), cost("B", "j", "w1", T + 2), cost("C", "j", "w1", T + 4),
        cost("D", None, "w1", T + 6), cost("D", "j", "w1", T + 6), cost("F", "j", "w1", T + 8),
        cost("G", "j", "w1", T + 9), cost("E", "j", "w1", DAY2 + 1),
        cost("H", "j", "w1", T + 10),  # orphan: the worker died before writing the result
        cost(None, None, "w1", T + 11, kind="idle", device_s=4.0),
        cost(None, None, "w1", T, kind="startup", device_s=2.0),
    ])
    c1.write([cost("D", "j", "w1", T + 6), cost(None, None, "w1", T + 11, kind="idle", device_s=4.0)])  # retried
    c2.write([
        cost("A", "j", "w2", T + 5), cost("B", "j", "w2", T + 3), cost("C", "j", "w2", T + 3),
        cost("F", "j", "w2", T + 8), cost("E", "j", "w2", T + 7),
    ])


def rows(out: Path, dataset: str) -> list[tuple]:
    """Every row of a dataset as comparable tuples, sorted (file layout ignored)."""
    out_rows = []
    for path in part_files(out / dataset):
        for row in pq.read_table(path).to_pylist():
            out_rows.append(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in row.items()))
    return sorted(out_rows, key=repr)


def snapshot(out: Path) -> tuple[list, list]:
    return rows(out, "results"), rows(out, "costs")


def files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != ".compact.lock")


def test_keep_rules_and_cost_marking(tmp_path):
    build(tmp_path)
    before_device = sum(dict(r)["device_s"] for r in rows(tmp_path, "costs"))
    stats = compact(tmp_path)

    kept = {(d["job_id"], d["id"]): d for d in map(dict, rows(tmp_path, "results"))}
    assert {k: (v["worker"], v["finished_at"].timestamp(), v["finish_reason"], v["text"]) for k, v in kept.items()} == {
        ("j", "A"): ("w2", T + 5, "stop", "ok"),          # a success beats an earlier error
        ("j", "B"): ("w1", T + 2, "error", None),         # only errors: the first written
        ("j", "C"): ("w2", T + 3, "stop", "early"),       # two successes: the earlier finished_at
        (None, "D"): ("w1", T + 6, "stop", "ok"),         # same id, no job: another request
        ("j", "D"): ("w1", T + 6, "stop", "ok"),
        ("j", "E"): ("w2", T + 7, "stop", "ok"),          # the error a day later is dropped
        ("j", "F"): ("w1", T + 8, "stop", "w1 wins the file-name tie"),
        ("j", "G"): ("w1", T + 9, "stop", "first row"),   # same file and time: the lower row index
    }

    kinds = Counter((d["kind"], d["job_id"], d["id"], d["worker"]) for d in map(dict, rows(tmp_path, "costs")))
    assert kinds == Counter({
        ("duplicate", "j", "A", "w1"): 1, ("request", "j", "A", "w2"): 1,
        ("request", "j", "B", "w1"): 1, ("duplicate", "j", "B", "w2"): 1,
        ("duplicate", "j", "C", "w1"): 1, ("request", "j", "C", "w2"): 1,
        ("request", None, "D", "w1"): 1, ("request", "j", "D", "w1"): 1,
        ("duplicate", "j", "E", "w1"): 1, ("request", "j", "E", "w2"): 1,
        ("request", "j", "F", "w1"): 1, ("duplicate", "j", "F", "w2"): 1,
        ("request", "j", "G", "w1"): 1,
        ("duplicate", "j", "H", "w1"): 1,
        ("idle", None, None, "w1"): 1, ("startup", None, None, "w1"): 1,
    })
    # Marking changes the kind only; the retried copies (one D, one idle) are gone.
    after_device = sum(dict(r)["device_s"] for r in rows(tmp_path, "costs"))
    assert after_device == before_device - 1.0 - 4.0
    for d in map(dict, rows(tmp_path, "costs")):
        assert d["cost_usd"] == d["device_s"] / 1000

    assert stats == CompactStats(
        results_before=15, results_after=8, duplicates_removed=7, costs_before=18, costs_after=16,
        cost_rows_marked_duplicate=6, identical_cost_rows_removed=2, files_before=8, files_after=3,
        recovered=False,
    )
    assert not [f for f in files(tmp_path) if "tmp" in f or JOURNAL_NAME in f]


def test_compaction_is_a_fixed_point(tmp_path):
    build(tmp_path)
    compact(tmp_path)
    layout, data = files(tmp_path), snapshot(tmp_path)
    stats = compact(tmp_path)
    assert files(tmp_path) == layout and snapshot(tmp_path) == data
    assert stats.files_before == stats.files_after == 3  # the day-2 results partition emptied out
    assert (stats.duplicates_removed, stats.cost_rows_marked_duplicate, stats.identical_cost_rows_removed) == (0, 0, 0)


def test_a_late_result_turns_its_orphan_cost_back_into_a_request(tmp_path):
    # Compaction ran between a worker's cost write and its result write.
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write([cost("X", "j", "w1", T + 1)])
    assert compact(tmp_path).cost_rows_marked_duplicate == 1
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w1").write([res("X", "j", "w1", T + 1)])
    compact(tmp_path)
    assert [dict(r)["kind"] for r in rows(tmp_path, "costs")] == ["request"]


def test_empty_and_missing_datasets(tmp_path):
    assert compact(tmp_path / "missing") == CompactStats()
    assert not (tmp_path / "missing").exists()
    assert compact(tmp_path) == CompactStats()
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write([cost(None, None, "w1", T, kind="idle")])
    stats = compact(tmp_path)
    assert (stats.costs_before, stats.costs_after, stats.files_after) == (1, 1, 1)


class Crash(Exception):
    pass


def crash_at(step: str):
    def hook(name: str) -> None:
        if name == step:
            raise Crash(name)
    return hook


def test_crash_at_every_step_then_rerun_gives_the_same_rows(tmp_path):
    original = tmp_path / "original"
    build(original)
    reference = tmp_path / "reference"
    shutil.copytree(original, reference)
    steps: list[str] = []
    compact(reference, fault=steps.append)
    expected = snapshot(reference)
    assert steps[:2] == ["temp_written", "journal_written"]
    assert {s.split(":")[0] for s in steps[2:]} == {"rename", "delete"}

    for step in steps:
        out = tmp_path / f"crash-{step.replace(':', '-')}"
        shutil.copytree(original, out)
        with pytest.raises(Crash):
            compact(out, fault=crash_at(step))
        if step != "temp_written":
            assert (out / JOURNAL_NAME).exists()
            # Crash again while recovering, then let it finish.
            with pytest.raises(Crash):
                compact(out, fault=crash_at("recover:rename:0"))
        stats = compact(out)
        assert stats.recovered == (step != "temp_written")
        assert snapshot(out) == expected, step
        assert not [f for f in files(out) if "tmp" in f or JOURNAL_NAME in f]


def test_leftovers_of_a_run_killed_before_its_journal_are_removed(tmp_path):
    build(tmp_path)
    expected_dir = tmp_path.parent / (tmp_path.name + "-ref")
    shutil.copytree(tmp_path, expected_dir)
    compact(expected_dir)
    folder = tmp_path / "results" / "date=2023-11-14"
    (folder / ".compact-tmp-deadbeef-0001.parquet").write_bytes(b"half a parquet file")
    (tmp_path / (JOURNAL_NAME + ".tmp")).write_text('{"version": 1, "ren')
    compact(tmp_path)
    assert snapshot(tmp_path) == snapshot(expected_dir)
    assert not [f for f in files(tmp_path) if "tmp" in f]


def test_a_killed_process_recovers(tmp_path):
    build(tmp_path)
    reference = tmp_path.parent / (tmp_path.name + "-ref")
    shutil.copytree(tmp_path, reference)
    compact(reference)
    script = textwrap.dedent(f"""
        import os
        from mqinfer.ops.compact import compact
        compact({str(tmp_path)!r}, fault=lambda step: os._exit(9) if step == "rename:1" else None)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / JOURNAL_NAME).exists()
    assert compact(tmp_path).recovered
    assert snapshot(tmp_path) == snapshot(reference)


def test_two_compactions_do_not_run_at_once(tmp_path):
    build(tmp_path)
    inner: list[Exception] = []

    def second_compaction(step: str) -> None:
        if step == "temp_written":
            try:
                compact(tmp_path)
            except RuntimeError as exc:
                inner.append(exc)

    compact(tmp_path, fault=second_compaction)
    assert len(inner) == 1 and "another compaction" in str(inner[0])


def test_cost_files_written_before_rejected_tokens_existed_still_compact(tmp_path):
    import pyarrow as pa

    older = pa.schema([f for f in COST_SCHEMA if f.name != "rejected_tokens"])
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w1").write([res("A", "j", "w1", T + 1),
                                                                     res("B", "j", "w1", T + 2)])
    DatasetWriter(tmp_path / "costs", older, "w1").write([cost("A", "j", "w1", T + 1)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([
        CostRow(**{**{f: getattr(cost("B", "j", "w2", T + 2), f) for f in CostRow.__struct_fields__},
                   "rejected_tokens": 7})])
    compact(tmp_path)
    got = {r["id"]: r["rejected_tokens"] for path in part_files(tmp_path / "costs")
           for r in pq.read_table(path).to_pylist()}
    assert got == {"A": None, "B": 7}


def test_cost_files_written_before_device_share_existed_compact_as_one_whole_device(tmp_path):
    import pyarrow as pa

    from mqinfer.ops.compact import drop_job

    older = pa.schema([f for f in COST_SCHEMA if f.name != "device_share"])
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w1").write([res("A", "j", "w1", T + 1),
                                                                     res("B", "j", "w1", T + 2)])
    DatasetWriter(tmp_path / "costs", older, "w1").write([cost("A", "j", "w1", T + 1), cost(None, None, "w1", T + 1.5,
                                                                                        kind="idle")])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([
        CostRow(**{**{f: getattr(cost("B", "j", "w2", T + 2), f) for f in CostRow.__struct_fields__},
                   "device_share": 0.5})])
    compact(tmp_path)

    def shares():
        return sorted((r["id"] or "-", r["device_share"]) for path in part_files(tmp_path / "costs")
                      for r in pq.read_table(path).to_pylist())
    assert shares() == [("-", 1.0), ("A", 1.0), ("B", 0.5)]
    assert compact(tmp_path).files_before == compact(tmp_path).files_after  # still a fixed point
    drop_job(tmp_path, "j")
    assert shares() == [("-", 1.0)]


# -- choices (n > 1) and rows from before the index column ---------------------------------------


def test_one_row_per_choice_and_each_choices_cost_row_bills_once(tmp_path):
    import msgspec

    def choice(row, index):
        return msgspec.structs.replace(row, index=index, text=f"{row.worker}/{index}")

    def choice_cost(c, index):
        return msgspec.structs.replace(c, index=index)

    # w1 wrote all three choices of N; w2 (a redelivery) wrote them again later, choice 1 an error.
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w1").write(
        [choice(res("N", "j", "w1", T + 1), i) for i in range(3)])
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w2").write(
        [choice(res("N", "j", "w2", T + 2, error=i == 1), i) for i in range(3)])
    # M: one choice failed, the other did not; each is kept as it is.
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w3").write(
        [choice(res("M", "j", "w3", T + 1, error=True), 0), choice(res("M", "j", "w3", T + 1), 1)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write([choice_cost(cost("N", "j", "w1", T + 1), i)
                                                                for i in range(3)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([choice_cost(cost("N", "j", "w2", T + 2), i)
                                                                for i in range(3)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w3").write([choice_cost(cost("M", "j", "w3", T + 1), i)
                                                                for i in range(2)])
    stats = compact(tmp_path)
    kept = sorted((d["id"], d["index"], d["text"]) for d in map(dict, rows(tmp_path, "results")))
    # N: every choice from w1 (w2's are later, and its choice 1 an error).
    assert kept == [("M", 0, "w3/0"), ("M", 1, "w3/1"), ("N", 0, "w1/0"), ("N", 1, "w1/1"), ("N", 2, "w1/2")]
    kinds = Counter((d["kind"], d["id"], d["index"], d["worker"]) for d in map(dict, rows(tmp_path, "costs")))
    assert kinds == Counter({
        ("request", "N", 0, "w1"): 1, ("request", "N", 1, "w1"): 1, ("request", "N", 2, "w1"): 1,
        ("duplicate", "N", 0, "w2"): 1, ("duplicate", "N", 1, "w2"): 1, ("duplicate", "N", 2, "w2"): 1,
        ("request", "M", 0, "w3"): 1, ("request", "M", 1, "w3"): 1,
    })
    assert (stats.results_after, stats.duplicates_removed, stats.cost_rows_marked_duplicate) == (5, 3, 3)
    again = snapshot(tmp_path)
    compact(tmp_path)
    assert snapshot(tmp_path) == again


def test_rows_written_before_the_index_column_are_choice_zero(tmp_path):
    import pyarrow as pa

    from mqinfer.schemas.rows import rows_to_table

    old_results = rows_to_table([res("O", "j", "w1", T + 1), res("P", "j", "w1", T + 1, error=True)],
                                RESULT_SCHEMA).drop_columns(["index"])
    old_costs = rows_to_table([cost("O", "j", "w1", T + 1), cost("P", "j", "w1", T + 1),
                               cost(None, None, "w1", T + 2, kind="idle")], COST_SCHEMA).drop_columns(["index"])
    folder = tmp_path / "results" / "date=2023-11-14"
    folder.mkdir(parents=True)
    pq.write_table(old_results, folder / "part-old-results.parquet")
    folder = tmp_path / "costs" / "date=2023-11-14"
    folder.mkdir(parents=True)
    pq.write_table(old_costs, folder / "part-old-costs.parquet")
    # A new worker wrote P again (choice 0), successfully.
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w2").write([res("P", "j", "w2", T + 3)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write(
        [CostRow(**{**{f: getattr(cost("P", "j", "w2", T + 3), f) for f in CostRow.__struct_fields__}, "index": 0})])
    compact(tmp_path)
    kept = sorted((d["id"], d["index"], d["worker"]) for d in map(dict, rows(tmp_path, "results")))
    assert kept == [("O", 0, "w1"), ("P", 0, "w2")]
    costs = sorted((d["kind"], d["id"] or "", d["index"] if d["index"] is not None else -1, d["worker"])
                   for d in map(dict, rows(tmp_path, "costs")))
    assert costs == [("duplicate", "P", 0, "w1"), ("idle", "", -1, "w1"), ("request", "O", 0, "w1"),
                     ("request", "P", 0, "w2")]
    for path in part_files(tmp_path / "results") + part_files(tmp_path / "costs"):
        assert "index" in pq.read_schema(path).names  # rewritten with the column
    assert pa.types.is_int32(pq.read_schema(part_files(tmp_path / "results")[0]).field("index").type)
