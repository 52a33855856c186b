"""The allocation basis of cost reports: each worker-hour's startup and idle time spread over the
groups by their request device time there; nothing unassigned while anyone used the worker, and
the totals still every row's."""

from __future__ import annotations

import csv
import io
import json

import pytest

from mqinfer.ops.report import cost_report
from mqinfer.ops.report_render import render
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA
from tests import zygote
from tests.helpers import mqinfer_cmd
from tests.ops.test_report import ROWS, T, row

# ROWS, by worker and hour (T and T + 5 s share an hour):
#   w1, hour of T: acme 3.0 s and beta 0.5 s of requests, 10 s idle
#   w2, hour of T: acme 1.0 s of requests, 4 s startup
#   w1, a day later: beta 0 s of requests
# and here, w3 in the hour of T: 6 s idle, no request at all.
IDLE_ALONE = row("idle", at=T, dev=6.0, worker="w3")


@pytest.fixture
def out(tmp_path):
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write([*ROWS, IDLE_ALONE])
    return tmp_path


def usd(seconds: float) -> float:
    return seconds * 2.0 / 3600


def test_overhead_goes_to_those_who_used_the_worker_that_hour(out):
    report = cost_report(out, basis="allocation")
    acme, beta = report.groups
    assert acme.key == {"tenant": "acme"} and beta.key == {"tenant": "beta"}
    assert acme.allocated_device_s == pytest.approx(10.0 * 3.0 / 3.5 + 4.0)
    assert beta.allocated_device_s == pytest.approx(10.0 * 0.5 / 3.5)
    assert acme.allocated_usd == pytest.approx(usd(acme.allocated_device_s))
    assert acme.total_usd == pytest.approx(acme.cost_usd + acme.allocated_usd)
    t = report.totals
    # Only the worker-hour nobody used stays unassigned.
    assert t.unallocated.device_s == pytest.approx(6.0) and t.unallocated.cost_usd == pytest.approx(usd(6.0))
    assert t.allocated.device_s + t.unallocated.device_s == pytest.approx(t.overhead.device_s)
    # Totals are every row's, to the cent, whichever the basis.
    usage = cost_report(out)
    assert t.cost_usd == usage.totals.cost_usd
    assert round(t.billed.cost_usd + t.allocated.cost_usd + t.unallocated.cost_usd + t.duplicate.cost_usd, 2) \
        == round(t.cost_usd, 2)
    assert sum(g.total_usd for g in report.groups) == pytest.approx(t.billed.total_usd)
    # Under usage nothing is spread.
    assert all(g.allocated_usd == 0 and g.total_usd == g.cost_usd for g in usage.groups)
    assert usage.totals.allocated.cost_usd == 0


def test_any_grouping_and_the_order_by_total(out):
    report = cost_report(out, by=["tenant", "worker"], basis="allocation")
    by_key = {(g.key["tenant"], g.key["worker"]): g for g in report.groups}
    assert by_key[("acme", "w2")].allocated_device_s == pytest.approx(4.0)  # all of w2's startup
    assert by_key[("beta", "w1")].allocated_device_s == pytest.approx(10.0 * 0.5 / 3.5)
    totals = [g.total_usd for g in report.groups]
    assert totals == sorted(totals, reverse=True)


def test_rendered_columns_and_lines(out):
    report = cost_report(out, basis="allocation")
    lines = list(csv.reader(io.StringIO(render(report, "csv"))))
    header = lines[0]
    assert header[-3:] == ["allocated_device_s", "allocated_usd", "total_usd"]
    named = {line[0]: dict(zip(header, line)) for line in lines[1:] if line[0] != "group"}
    assert list(named) == ["billed", "overhead", "allocated", "unallocated", "duplicate", "total"]
    assert float(named["unallocated"]["device_s"]) == pytest.approx(6.0)
    table = render(report, "table")
    assert "alloc_usd" in table and "total_usd" in table and "of it unallocated" in table
    assert json.loads(render(report, "json"))["basis"] == "allocation"
    # The usage report keeps its columns and lines.
    usage = render(cost_report(out), "csv")
    assert "allocated_usd" not in usage and "\nallocated," not in usage


def test_the_command_line_flag(out):
    proc = zygote.run(mqinfer_cmd("report", "costs", str(out), "--basis", "allocation", "--format", "csv"),
                      capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "allocated_usd" in proc.stdout.splitlines()[0]
    bad = zygote.run(mqinfer_cmd("report", "costs", str(out), "--basis", "fair"), capture_output=True,
                     text=True, timeout=120)
    assert bad.returncode == 2 and "allocation" in bad.stderr


def test_lost_time_is_overhead_of_its_own_kind_and_spread_like_it(tmp_path):
    # w1 was killed: 7 s it used and never wrote come back as a `lost` row under its name (written
    # by the worker that found it dead), in the hour of T where acme and beta used w1.
    lost = row("lost", at=T + 6, dev=7.0)
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w2").write([*ROWS, IDLE_ALONE, lost])
    report = cost_report(tmp_path, basis="allocation")
    t = report.totals
    assert t.device_s_by_kind["lost"] == pytest.approx(7.0) and t.cost_usd_by_kind["lost"] == pytest.approx(usd(7.0))
    assert t.overhead.device_s == pytest.approx(10.0 + 4.0 + 6.0 + 7.0)
    acme, beta = report.groups
    assert acme.allocated_device_s == pytest.approx((10.0 + 7.0) * 3.0 / 3.5 + 4.0)
    assert beta.allocated_device_s == pytest.approx((10.0 + 7.0) * 0.5 / 3.5)
    # The totals are still every row's: billed + spread + unspread overhead + duplicate.
    every_row = sum(r.device_s for r in [*ROWS, IDLE_ALONE, lost])
    assert t.device_s == pytest.approx(every_row)
    assert t.billed.device_s + t.allocated.device_s + t.unallocated.device_s + t.duplicate.device_s \
        == pytest.approx(every_row)
    table = render(report, "table")
    assert "overhead (startup + idle + lost)" in table and "lost_s" in table
    (lost_line,) = [line for line in table.splitlines() if line.strip().startswith("lost ")]
    assert "7.000 s" in lost_line
