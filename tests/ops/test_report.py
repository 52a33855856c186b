"""Cost reports: group sums and totals equal the rows; rendering in three formats."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest

from mqinfer.ops.report import cost_report
from mqinfer.ops.report_render import render
from mqinfer.schemas.rows import COST_SCHEMA, CostRow
from mqinfer.schemas.dataset import DatasetWriter

T = 1_700_000_000.0


def row(kind, tenant=None, *, rid=None, job=None, model="tiny", worker="w1", at=T, p=0, c=0, o=0, dev=0.0):
    return CostRow(kind=kind, job_id=job, id=rid, tenant=tenant, model=model,
                   request_type=None if rid is None else "chat", prompt_tokens=p, cached_prompt_tokens=c,
                   output_tokens=o, device_s=dev, cost_usd=dev * 2.0 / 3600, price_per_device_hour=2.0,
                   worker=worker, finished_at=at)


ROWS = [
    row("request", "acme", rid="1", job="j1", at=T + 1, p=100, c=40, o=20, dev=3.0),
    row("request", "acme", rid="2", job="j2", at=T + 2, p=50, c=0, o=30, dev=1.0, worker="w2"),
    row("request", "beta", rid="3", job="j1", at=T + 3, p=10, c=0, o=0, dev=0.5),
    row("request", "beta", rid="4", at=T + 86_400, p=0, o=0, dev=0.0),  # next day, no tokens
    row("duplicate", "acme", rid="1", job="j1", at=T + 4, p=100, o=20, dev=2.0),
    row("idle", at=T + 5, dev=10.0),
    row("startup", at=T, dev=4.0, worker="w2"),
]


@pytest.fixture
def out(tmp_path):
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write(ROWS)
    return tmp_path


def test_groups_and_totals_equal_the_rows(out):
    report = cost_report(out)
    assert [g.key for g in report.groups] == [{"tenant": "acme"}, {"tenant": "beta"}]  # highest cost first
    acme, beta = report.groups
    assert (acme.requests, acme.prompt_tokens, acme.cached_prompt_tokens, acme.output_tokens) == (2, 150, 40, 50)
    assert acme.device_s == pytest.approx(4.0) and acme.cost_usd == pytest.approx(4.0 * 2 / 3600)
    assert acme.usd_per_1m_tokens == pytest.approx(acme.cost_usd / 200 * 1e6)
    assert (beta.requests, beta.prompt_tokens, beta.output_tokens, beta.device_s) == (2, 10, 0, 0.5)

    t = report.totals
    all_device = sum(r.device_s for r in ROWS)
    assert t.device_s == pytest.approx(all_device) and t.cost_usd == pytest.approx(sum(r.cost_usd for r in ROWS))
    assert t.device_s_by_kind == pytest.approx({"request": 4.5, "idle": 10.0, "startup": 4.0, "duplicate": 2.0, "lost": 0.0})
    assert t.device_share_by_kind["idle"] == pytest.approx(10.0 / all_device)
    assert sum(t.device_share_by_kind.values()) == pytest.approx(1.0)
    assert (t.requests, t.prompt_tokens, t.cached_prompt_tokens, t.output_tokens) == (4, 160, 40, 50)
    assert t.usd_per_1m_tokens == pytest.approx(4.5 * 2 / 3600 / 210 * 1e6)
    # The summary lines: billed (request rows, the groups' sum), overhead, duplicate; TOTAL is all three.
    b = t.billed
    assert (b.key, b.requests, b.prompt_tokens, b.cached_prompt_tokens, b.output_tokens) == ({}, 4, 160, 40, 50)
    assert b.device_s == pytest.approx(4.5) and b.cost_usd == pytest.approx(sum(g.cost_usd for g in report.groups))
    assert b.usd_per_1m_tokens == t.usd_per_1m_tokens
    assert t.overhead.device_s == pytest.approx(14.0) and t.overhead.cost_usd == pytest.approx(14.0 * 2 / 3600)
    assert t.duplicate.device_s == pytest.approx(2.0) and t.duplicate.cost_usd == pytest.approx(2.0 * 2 / 3600)
    assert t.device_s == pytest.approx(b.device_s + t.overhead.device_s + t.duplicate.device_s)
    assert t.cost_usd == pytest.approx(b.cost_usd + t.overhead.cost_usd + t.duplicate.cost_usd)
    assert report.requests_counted_more_than_once == 0 and report.extra_request_rows == 0


def test_group_by_several_keys_and_nulls(out):
    report = cost_report(out, by=["tenant", "job_id"])
    got = {(g.key["tenant"], g.key["job_id"]): (g.requests, g.device_s) for g in report.groups}
    assert got == {
        ("acme", "j1"): (1, 3.0), ("acme", "j2"): (1, 1.0), ("beta", "j1"): (1, 0.5), ("beta", None): (1, 0.0),
    }
    by_worker = {g.key["worker"]: g.requests for g in cost_report(out, by=["worker"]).groups}
    assert by_worker == {"w1": 3, "w2": 1}
    (only,) = cost_report(out, by=["model", "request_type"]).groups
    assert (only.key, only.requests) == ({"model": "tiny", "request_type": "chat"}, 4)


def test_time_window(out):
    report = cost_report(out, since=T + 1, until=T + 3)  # since inclusive, until exclusive
    assert [(g.key["tenant"], g.requests) for g in report.groups] == [("acme", 2)]
    assert report.totals.device_s_by_kind == pytest.approx({"request": 4.0, "idle": 0.0, "startup": 0.0,
                                                            "duplicate": 0.0, "lost": 0.0})
    assert cost_report(out, since=T + 86_400).totals.requests == 1


def test_bad_group_keys(out):
    for by in (["tenant", "colour"], [], ["tenant", "tenant"]):
        with pytest.raises(ValueError, match="cannot group costs by"):
            cost_report(out, by=by)


def test_render_formats(out):
    report = cost_report(out, by=["tenant", "job_id"])
    parsed = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    groups = [r for r in parsed if r["row"] == "group"]
    assert [(r["tenant"], r["job_id"], int(r["requests"]), float(r["device_s"])) for r in groups] == [
        (g.key["tenant"], g.key["job_id"] or "", g.requests, g.device_s) for g in report.groups
    ]
    assert groups[-1]["usd_per_1m_tokens"] == ""  # beta without a job: no tokens
    summary = {r["row"]: r for r in parsed[len(groups):]}
    assert list(summary) == ["billed", "overhead", "duplicate", "total"]
    assert int(summary["billed"]["requests"]) == 4 and float(summary["billed"]["device_s"]) == pytest.approx(4.5)
    assert summary["overhead"]["requests"] == "" and float(summary["overhead"]["device_s"]) == pytest.approx(14.0)
    assert float(summary["total"]["device_s"]) == pytest.approx(20.5)
    assert {summary[k]["tenant"] for k in summary} == {""}
    assert json.loads(render(report, "json")) == json.loads(json.dumps(dataclasses.asdict(report)))
    table = render(report, "table")
    assert table.splitlines()[0].split() == ["tenant", "job_id", "requests", "prompt_tokens",
                                             "cached_prompt_tokens", "output_tokens", "device_s", "cost_usd",
                                             "usd_per_1m_in", "usd_per_1m_out", "usd_per_1m_tokens"]
    assert "(none)" in table and "TOTAL" in table
    idle_line = next(line for line in table.splitlines() if line.strip().startswith("idle"))
    assert "10.000 s" in idle_line and "48.78%" in idle_line  # 10 of 20.5 device seconds
    with pytest.raises(ValueError, match="format"):
        render(report, "xml")


def test_empty_dataset(tmp_path):
    (tmp_path / "costs").mkdir()
    report = cost_report(tmp_path)
    assert report.groups == [] and report.totals.device_s == 0 and report.totals.usd_per_1m_tokens is None
    assert report.totals.billed.requests == 0 and report.totals.billed.cost_usd == 0
    assert "TOTAL" in render(report)
    # The header and the four summary lines, all zero.
    lines = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert [r["row"] for r in lines] == ["billed", "overhead", "duplicate", "total"]
    assert {float(r["device_s"]) for r in lines} == {0.0}


def test_missing_folder_or_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such output folder"):
        cost_report(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no costs/ dataset in"):
        cost_report(tmp_path)


def test_rejected_tokens_are_summed_and_shown_when_speculation_ran(tmp_path):
    import msgspec
    import pyarrow as pa

    # One file from before the column existed (read as null, counted as 0), one with it.
    older = pa.schema([f for f in COST_SCHEMA if f.name != "rejected_tokens"])
    DatasetWriter(tmp_path / "costs", older, "w1").write([row("request", "acme", rid="1", at=T + 1, p=5, o=5, dev=1.0)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([
        msgspec.structs.replace(row("request", "acme", rid="2", at=T + 2, p=5, o=9, dev=1.0), rejected_tokens=7),
        msgspec.structs.replace(row("request", "beta", rid="3", at=T + 3, p=5, o=9, dev=1.0), rejected_tokens=3),
    ])
    report = cost_report(tmp_path)
    assert {g.key["tenant"]: g.rejected_tokens for g in report.groups} == {"acme": 7, "beta": 3}
    assert report.totals.rejected_tokens == report.totals.billed.rejected_tokens == 10
    table = render(report, "table")
    header = table.splitlines()[0].split()
    assert header[header.index("output_tokens") + 1] == "rejected_tokens"
    billed = next(line for line in table.splitlines() if line.startswith("billed"))
    assert billed.split()[6] == "10"  # label (2 words), requests, prompt, cached, output, rejected
    csv_rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert {r["tenant"]: r["rejected_tokens"] for r in csv_rows if r["row"] == "group"} == {"acme": "7", "beta": "3"}
    assert json.loads(render(report, "json"))["totals"]["rejected_tokens"] == 10


def test_no_rejected_tokens_column_in_the_table_without_speculation(out):
    assert "rejected_tokens" not in render(cost_report(out), "table")


def test_prompt_tokens_served_by_kv_tiers_are_summed_and_shown_when_tiers_ran(tmp_path):
    import msgspec
    import pyarrow as pa

    # One file from before the tier columns existed (null, counted as 0), one with them.
    older = pa.schema([f for f in COST_SCHEMA if not f.name.endswith("d_cached_tokens")])
    DatasetWriter(tmp_path / "costs", older, "w1").write([row("request", "acme", rid="1", at=T + 1, p=5, o=5, dev=1.0)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([
        msgspec.structs.replace(row("request", "acme", rid="2", at=T + 2, p=64, c=48, o=9, dev=1.0),
                                host_cached_tokens=32, disk_cached_tokens=16),
        msgspec.structs.replace(row("request", "beta", rid="3", at=T + 3, p=64, c=64, o=9, dev=1.0),
                                shared_cached_tokens=48),
    ])
    report = cost_report(tmp_path)
    tiers = {g.key["tenant"]: (g.host_cached_tokens, g.disk_cached_tokens, g.shared_cached_tokens)
             for g in report.groups}
    assert tiers == {"acme": (32, 16, 0), "beta": (0, 0, 48)}
    t = report.totals
    assert (t.host_cached_tokens, t.disk_cached_tokens, t.shared_cached_tokens) == (32, 16, 48)
    assert t.billed.shared_cached_tokens == 48
    header = render(report, "table").splitlines()[0].split()
    i = header.index("cached_prompt_tokens")
    assert header[i + 1:i + 4] == ["host_cached", "disk_cached", "shared_cached"]
    csv_rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert {r["tenant"]: r["disk_cached_tokens"] for r in csv_rows if r["row"] == "group"} == {"acme": "16", "beta": "0"}
    assert json.loads(render(report, "json"))["totals"]["host_cached_tokens"] == 32
    # Without tiers the table keeps its usual columns.
    DatasetWriter(tmp_path / "plain" / "costs", COST_SCHEMA, "w1").write(ROWS)
    assert "host_cached" not in render(cost_report(tmp_path / "plain"), "table")


def test_cost_files_from_before_device_share_read_beside_new_ones(tmp_path):
    """Old rows billed a whole device each; new rows bill a share. Reports, job costs and the
    per-hour lines sum the device seconds as written, whatever the files hold."""
    import msgspec
    import pyarrow as pa

    from mqinfer.ops.job_cost import job_cost
    from mqinfer.ops.report import _read_costs

    older = pa.schema([f for f in COST_SCHEMA if f.name != "device_share"])
    DatasetWriter(tmp_path / "costs", older, "w1").write([row("request", "acme", rid="1", job="j", at=T + 1, dev=4.0),
                                                          row("idle", at=T + 2, dev=2.0)])
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([
        msgspec.structs.replace(row("request", "acme", rid="2", job="j", at=T + 3, dev=1.5, worker="w2"),
                                device_share=0.5),
        msgspec.structs.replace(row("idle", at=T + 4, dev=0.5, worker="w2"), device_share=0.5),
    ])
    table = _read_costs(tmp_path, None, None)
    assert sorted(table["device_share"].to_pylist()) == [0.5, 0.5, 1.0, 1.0]
    report = cost_report(tmp_path, by=["worker"])
    assert report.totals.device_s == pytest.approx(8.0)
    assert {g.key["worker"]: g.device_s for g in report.groups} == {"w1": 4.0, "w2": 1.5}
    assert sum(sum(h.device_s_by_kind.values()) for h in report.hourly) == pytest.approx(8.0)
    assert json.loads(render(report, "json"))["totals"]["device_s"] == pytest.approx(8.0)
    cost = job_cost([tmp_path], "j")
    assert (cost.device_s, cost.rows) == (pytest.approx(5.5), 2)


def test_a_request_with_choices_counts_once_with_every_choices_tokens_and_cost(tmp_path):
    from mqinfer.ops.report import uncompacted_warning

    import msgspec

    base = row("request", "acme", rid="n", job="j", at=T + 1, p=40, o=6, dev=1.0)
    rows = [msgspec.structs.replace(base, index=0, cached_prompt_tokens=0, device_s=2.0, cost_usd=2.0 * 2 / 3600),
            msgspec.structs.replace(base, index=1, cached_prompt_tokens=32),
            msgspec.structs.replace(base, index=2, cached_prompt_tokens=32),
            row("request", "acme", rid="single", job="j", at=T + 2, p=5, o=1, dev=0.5)]
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write(rows)
    report = cost_report(tmp_path)
    [acme] = report.groups
    assert (acme.requests, acme.prompt_tokens, acme.cached_prompt_tokens, acme.output_tokens) == (2, 125, 64, 19)
    assert acme.device_s == pytest.approx(4.5)
    assert report.totals.requests == 2 and report.requests_counted_more_than_once == 0
    assert uncompacted_warning(report, tmp_path) is None
    assert sum(h.requests for h in report.hourly) == 2


def test_schema_validity_counts_the_rows_with_a_response_format(tmp_path):
    from mqinfer.ops.report import schema_validity
    from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow

    assert schema_validity(tmp_path) is None  # no results
    results = [ResultRow(id=f"r{i}", model="tiny", finish_reason=reason, finished_at=T, worker="w1",
                         schema_valid=valid)
               for i, (reason, valid) in enumerate([("stop", True), ("stop", True), ("length", False),
                                                    ("stop", None)])]
    DatasetWriter(tmp_path / "results", RESULT_SCHEMA, "w1").write(results)
    assert schema_validity(tmp_path) == (2, 3)
    unconstrained = tmp_path / "plain"
    DatasetWriter(unconstrained / "results", RESULT_SCHEMA, "w1").write(results[3:])
    assert schema_validity(unconstrained) is None
