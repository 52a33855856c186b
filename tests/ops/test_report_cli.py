"""`mqinfer report costs` as a user runs it: clear errors for a wrong folder, a warning on a folder
that was not compacted, and the same summary lines (billed, overhead, duplicate, TOTAL) in the
table, CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import pytest

from mqinfer.ops.compact import compact
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow
from mqinfer.schemas.dataset import DatasetWriter
from tests import zygote
from tests.helpers import mqinfer_cmd

T = 1_700_000_000.0
PRICE = 3.6  # USD per device hour: 0.001 USD per device second


def result(rid, job, worker, at, *, error=False) -> ResultRow:
    return ResultRow(job_id=job, id=rid, tenant="acme", model="tiny", finish_reason="error" if error else "stop",
                     error_code="internal_error" if error else None, error="boom" if error else None,
                     prompt_tokens=0 if error else 10, output_tokens=0 if error else 5,
                     output_token_ids=[] if error else [1, 2, 3, 4, 5], text=None if error else "ok",
                     finished_at=at, worker=worker)


def cost(kind, worker, at, seconds, *, rid=None, job=None, tenant="acme") -> CostRow:
    billed = rid is not None
    return CostRow(kind=kind, job_id=job, id=rid, tenant=tenant if billed else None, model="tiny",
                   request_type="chat" if billed else None, prompt_tokens=10 if billed else 0,
                   output_tokens=5 if billed else 0, prefill_s=seconds / 4 if billed else 0.0,
                   decode_s=3 * seconds / 4 if billed else 0.0, device_s=seconds, cost_usd=seconds * PRICE / 3600,
                   price_per_device_hour=PRICE, worker=worker, finished_at=at)


@pytest.fixture
def uncompacted(tmp_path) -> Path:
    """Two workers' rows as they wrote them: A failed on w1 and succeeded on w2; C (no job) finished
    on both; B exists in two jobs, which are two different requests."""
    out = tmp_path / "out"
    DatasetWriter(out / "results", RESULT_SCHEMA, "w1").write([
        result("A", "j", "w1", T + 10, error=True), result("B", "j", "w1", T + 12), result("C", None, "w1", T + 14),
    ])
    DatasetWriter(out / "results", RESULT_SCHEMA, "w2").write([
        result("A", "j", "w2", T + 20), result("C", None, "w2", T + 16), result("B", "k", "w2", T + 18),
    ])
    DatasetWriter(out / "costs", COST_SCHEMA, "w1").write([
        cost("startup", "w1", T, 5.0),
        cost("request", "w1", T + 10, 2.0, rid="A", job="j"),
        cost("request", "w1", T + 12, 1.0, rid="B", job="j"),
        cost("request", "w1", T + 14, 1.5, rid="C"),
        cost("idle", "w1", T + 30, 6.0),
    ])
    DatasetWriter(out / "costs", COST_SCHEMA, "w2").write([
        cost("startup", "w2", T, 3.0),
        cost("request", "w2", T + 20, 4.0, rid="A", job="j"),
        cost("request", "w2", T + 16, 0.5, rid="C"),
        cost("request", "w2", T + 18, 2.5, rid="B", job="k", tenant="beta"),
    ])
    return out


def report(*args: str) -> subprocess.CompletedProcess:
    return zygote.run(mqinfer_cmd("report", "costs", *args), capture_output=True, text=True, timeout=120)


def test_missing_folder_is_a_one_line_error(tmp_path):
    missing = tmp_path / "nope"
    proc = report(str(missing))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"mqinfer report costs: error: no such output folder: {missing}\n"

    (tmp_path / "results").mkdir()  # an output folder, but no costs dataset in it
    proc = report(str(tmp_path), "--format", "json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"mqinfer report costs: error: no costs/ dataset in {tmp_path}\n"
    assert "Traceback" not in proc.stderr


def test_empty_costs_dataset_is_an_empty_report(tmp_path):
    (tmp_path / "costs").mkdir()
    proc = report(str(tmp_path), "--format", "json")
    assert proc.returncode == 0 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["groups"] == [] and doc["totals"]["requests"] == 0 and doc["totals"]["cost_usd"] == 0


def test_uncompacted_folder_warns_and_keeps_its_numbers(uncompacted):
    proc = report(str(uncompacted), "--format", "json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert proc.stderr == (
        f"mqinfer report costs: warning: 2 requests are counted more than once (2 extra `request` cost rows): "
        f"{uncompacted} has not been compacted; run `mqinfer compact {uncompacted}` first\n"
    )
    doc = json.loads(proc.stdout)
    # Every request row is still counted: the warning explains the numbers, it does not change them.
    assert doc["totals"]["requests"] == 6 and doc["totals"]["billed"]["device_s"] == pytest.approx(11.5)
    assert (doc["requests_counted_more_than_once"], doc["extra_request_rows"]) == (2, 2)

    stats = compact(uncompacted)
    assert stats.cost_rows_marked_duplicate == 2
    proc = report(str(uncompacted), "--format", "json")
    assert proc.returncode == 0 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["totals"]["requests"] == 4 and doc["requests_counted_more_than_once"] == 0
    assert doc["totals"]["duplicate"]["device_s"] == pytest.approx(2.0 + 0.5)  # A on w1, C on w2


def test_warning_counts_only_the_window(uncompacted):
    # Before T + 15 no request repeats yet: the second rows of A and C come later.
    proc = report(str(uncompacted), "--until", str(T + 15), "--format", "csv")
    assert proc.returncode == 0 and proc.stderr == ""
    proc = report(str(uncompacted), "--until", str(T + 17))  # C's second row (T + 16) is in
    assert proc.returncode == 0 and "1 request is counted more than once (1 extra `request` cost row)" in proc.stderr


def _table_summary(text: str) -> dict[str, tuple[int | None, float, float]]:
    """The summary lines of the text table: label -> (requests or None, device_s, cost_usd)."""
    lines = text.splitlines()
    header = lines[0]

    def cell(line: str, column: str) -> str:
        end = header.index(column) + len(column)  # numbers are right-aligned under their header
        start = header.rindex("  ", 0, end - len(column)) + 2
        return line[start:end].strip()

    labels = {"billed (requests)": "billed", "overhead (startup + idle + lost)": "overhead",
              "duplicate (not billed)": "duplicate", "TOTAL (every row)": "total"}
    found = {}
    for line in lines:
        for label, name in labels.items():
            if line.startswith(label):
                requests = cell(line, "requests")
                found[name] = (int(requests) if requests else None, float(cell(line, "device_s")),
                               float(cell(line, "cost_usd")))
    return found


def test_three_formats_give_the_same_totals(uncompacted):
    compact(uncompacted)
    table = report(str(uncompacted), "--by", "tenant,job_id")
    csv_out = report(str(uncompacted), "--by", "tenant,job_id", "--format", "csv")
    json_out = report(str(uncompacted), "--by", "tenant,job_id", "--format", "json")
    for proc in (table, csv_out, json_out):
        assert proc.returncode == 0 and proc.stderr == ""

    # The rows: requests A (w2, 4 s), B in j (1 s), C (w1, 1.5 s), B in k (2.5 s); startup 5 + 3 s and
    # idle 6 s; duplicates A (w1, 2 s) and C (w2, 0.5 s).
    expected = {"billed": (4, 9.0), "overhead": (None, 14.0), "duplicate": (None, 2.5), "total": (None, 25.5)}

    totals = json.loads(json_out.stdout)["totals"]
    from_json = {
        "billed": (totals["billed"]["requests"], totals["billed"]["device_s"], totals["billed"]["cost_usd"]),
        "overhead": (None, totals["overhead"]["device_s"], totals["overhead"]["cost_usd"]),
        "duplicate": (None, totals["duplicate"]["device_s"], totals["duplicate"]["cost_usd"]),
        "total": (None, totals["device_s"], totals["cost_usd"]),
    }
    rows = list(csv.DictReader(io.StringIO(csv_out.stdout)))
    assert [r["row"] for r in rows] == ["group"] * 3 + ["billed", "overhead", "duplicate", "total"]
    from_csv = {r["row"]: (int(r["requests"]) if r["requests"] else None, float(r["device_s"]), float(r["cost_usd"]))
                for r in rows if r["row"] != "group"}
    from_table = _table_summary(table.stdout)

    for source in (from_json, from_csv, from_table):
        assert set(source) == set(expected)
        for name, (requests, device_s) in expected.items():
            got_requests, got_device_s, got_cost = source[name]
            assert got_requests == requests, (name, source)
            assert got_device_s == pytest.approx(device_s), (name, source)
            assert got_cost == pytest.approx(device_s * PRICE / 3600, abs=1e-6), (name, source)

    # The groups add up to the billed line, and TOTAL is billed + overhead + duplicate.
    groups = [r for r in rows if r["row"] == "group"]
    assert sum(float(r["cost_usd"]) for r in groups) == pytest.approx(from_csv["billed"][2])
    assert sum(from_json[k][1] for k in ("billed", "overhead", "duplicate")) == pytest.approx(from_json["total"][1])
    assert totals["requests"] == totals["billed"]["requests"] == 4


def test_help_says_what_the_totals_count():
    proc = zygote.run(mqinfer_cmd("report", "costs", "--help"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for phrase in ("`overhead` (startup + idle + lost rows", "`TOTAL` (every row", "mqinfer compact DIR", "`billed`"):
        assert phrase in text
