"""Cost reports beyond the group sums: input / output cost per token, the most expensive requests,
the hourly series, budgets, charts, and the `mqinfer report costs` command."""

from __future__ import annotations

import csv
import io
import json

import pytest

from mqinfer.ops.budgets import Budgets
from mqinfer.ops.report import cost_report
from mqinfer.ops.report_render import plot, render
from mqinfer.schemas.rows import COST_SCHEMA, CostRow
from mqinfer.schemas.dataset import DatasetWriter
from tests import zygote
from tests.helpers import mqinfer_cmd

H = 1_700_002_800.0  # an hour boundary (UTC)
PRICE = 3.6  # USD per device hour: 0.001 USD per device second


def req(rid, tenant, *, at, prefill, decode, p, o, job="j1", worker="w1", model="tiny@aa"):
    device = prefill + decode
    return CostRow(kind="request", job_id=job, id=rid, tenant=tenant, model=model, request_type="chat",
                   prompt_tokens=p, output_tokens=o, prefill_s=prefill, decode_s=decode, device_s=device,
                   cost_usd=device * PRICE / 3600, price_per_device_hour=PRICE, worker=worker, finished_at=at)


def overhead(kind, *, at, seconds, worker="w1"):
    return CostRow(kind=kind, device_s=seconds, cost_usd=seconds * PRICE / 3600, price_per_device_hour=PRICE,
                   worker=worker, finished_at=at)


ROWS = [
    overhead("startup", at=H + 10, seconds=5.0),
    req("a1", "acme", at=H + 60, prefill=2.0, decode=6.0, p=1000, o=300),
    req("a2", "acme", at=H + 3600 + 5, prefill=1.0, decode=1.0, p=500, o=100),
    req("b1", "beta", at=H + 120, prefill=0.5, decode=9.5, p=100, o=900),
    CostRow(kind="duplicate", job_id="j1", id="b1", tenant="beta", model="tiny@aa", request_type="chat",
            prompt_tokens=100, output_tokens=900, prefill_s=0.5, decode_s=9.5, device_s=10.0, cost_usd=0.01,
            price_per_device_hour=PRICE, worker="w2", finished_at=H + 130),
    overhead("idle", at=H + 3600 + 30, seconds=4.0),
    req("c1", "gamma", at=H + 2 * 86_400 + 40, prefill=0.2, decode=0.2, p=10, o=10),  # two days later
]


@pytest.fixture
def out(tmp_path):
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write(ROWS)
    return tmp_path


def test_input_and_output_cost_per_million_tokens(out):
    acme = next(g for g in cost_report(out).groups if g.key == {"tenant": "acme"})
    input_usd = (2.0 + 1.0) * PRICE / 3600  # the prefill share of each request's cost
    output_usd = (6.0 + 1.0) * PRICE / 3600
    assert acme.usd_per_1m_input_tokens == pytest.approx(input_usd / 1500 * 1e6)
    assert acme.usd_per_1m_output_tokens == pytest.approx(output_usd / 400 * 1e6)
    assert acme.prefill_s == pytest.approx(3.0) and acme.decode_s == pytest.approx(7.0)
    t = cost_report(out).totals
    assert t.usd_per_1m_input_tokens == pytest.approx((2.0 + 1.0 + 0.5 + 0.2) * PRICE / 3600 / 1610 * 1e6)
    assert t.usd_per_1m_output_tokens == pytest.approx((6.0 + 1.0 + 9.5 + 0.2) * PRICE / 3600 / 1310 * 1e6)


def test_most_expensive_requests_are_billed_rows_only(out):
    report = cost_report(out, top=2)
    assert [(r.id, r.worker) for r in report.top_requests] == [("b1", "w1"), ("a1", "w1")]  # not the duplicate
    assert report.top_requests[0].cost_usd == pytest.approx(10.0 * PRICE / 3600)
    assert report.top_requests[0].finished_at == "2023-11-14T23:02:00Z"
    assert cost_report(out, top=0).top_requests == []
    with pytest.raises(ValueError, match="top"):
        cost_report(out, top=-1)


def test_hourly_series_adds_up_to_the_totals(out):
    report = cost_report(out)
    assert [h.hour for h in report.hourly] == ["2023-11-14T23:00:00Z", "2023-11-15T00:00:00Z",
                                               "2023-11-16T23:00:00Z"]
    first, second, third = report.hourly
    assert (first.requests, first.prompt_tokens, first.output_tokens) == (2, 1100, 1200)
    assert first.device_s_by_kind == pytest.approx({"request": 18.0, "idle": 0.0, "startup": 5.0, "duplicate": 10.0, "lost": 0.0})
    assert first.billed_usd == pytest.approx(18.0 * PRICE / 3600)
    assert second.device_s_by_kind == pytest.approx({"request": 2.0, "idle": 4.0, "startup": 0.0, "duplicate": 0.0, "lost": 0.0})
    assert third.requests == 1
    assert sum(h.cost_usd for h in report.hourly) == pytest.approx(report.totals.cost_usd)
    for kind in ("request", "idle", "startup", "duplicate"):
        assert sum(h.device_s_by_kind[kind] for h in report.hourly) == pytest.approx(
            report.totals.device_s_by_kind[kind])


def test_budgets_mark_tenants_over_budget(out):
    budgets = Budgets(tenants={"acme": 0.009, "beta": 0.05, "zed": 1.0}, default_usd=0.0003)
    report = cost_report(out, budgets=budgets)
    status = {s.tenant: s for s in report.budgets}
    assert set(status) == {"acme", "beta", "gamma", "zed"}  # gamma by the default budget; zed listed, no spend
    assert status["acme"].spent_usd == pytest.approx(10.0 * PRICE / 3600) and status["acme"].over
    assert not status["beta"].over and status["beta"].remaining_usd == pytest.approx(0.05 - 0.01)
    assert status["gamma"].over and status["gamma"].budget_usd == 0.0003
    assert not status["zed"].over and status["zed"].spent_usd == 0
    marks = {g.key["tenant"]: g.over_budget for g in report.groups}
    assert marks == {"acme": True, "beta": False, "gamma": True}

    table = render(report)
    assert "budget" in table.splitlines()[0] and "OVER BUDGET" in table
    acme_line = next(line for line in table.splitlines() if line.startswith("acme"))
    assert acme_line.rstrip().endswith("OVER")
    parsed = {r["tenant"]: r["over_budget"] for r in csv.DictReader(io.StringIO(render(report, "csv")))
              if r["row"] == "group"}
    assert parsed == {"acme": "true", "beta": "false", "gamma": "true"}
    # Without a tenant key the groups carry no mark, the budget section still does.
    by_model = cost_report(out, by=["model"], budgets=budgets)
    assert by_model.groups[0].over_budget is None and len(by_model.budgets) == 4


def test_period_budgets_count_each_period_alone(out):
    # a1 (8 device seconds, 0.008 USD) finished on 2023-11-14, a2 (2 s) on 2023-11-15.
    monthly = cost_report(out, budgets=Budgets(tenants={"acme": 0.009}, period="month"))
    (acme,) = monthly.budgets
    assert acme.period == "2023-11" and acme.spent_usd == pytest.approx(0.010) and acme.over
    daily = cost_report(out, budgets=Budgets(tenants={"acme": 0.009}, period="day"))
    (acme,) = daily.budgets
    assert acme.period == "2023-11-14" and acme.spent_usd == pytest.approx(0.008) and not acme.over
    assert cost_report(out, budgets=Budgets(tenants={"acme": 0.0075}, period="day")).budgets[0].over


def test_time_window_applies_to_everything(out):
    report = cost_report(out, since=H + 3600, until=H + 7200)
    assert [g.key["tenant"] for g in report.groups] == ["acme"] and report.totals.requests == 1
    assert [h.hour for h in report.hourly] == ["2023-11-15T00:00:00Z"]
    assert [r.id for r in report.top_requests] == ["a2"]
    with pytest.raises(ValueError, match="empty time window"):
        cost_report(out, since=H + 10, until=H)


def test_json_has_every_section(out):
    doc = json.loads(render(cost_report(out, budgets=Budgets(tenants={"acme": 1.0})), "json"))
    assert set(doc) == {"by", "since", "until", "groups", "totals", "top_requests", "hourly", "budgets",
                        "requests_counted_more_than_once", "extra_request_rows", "basis", "budget_marks",
                        "hourly_by_group", "cost_distribution"}
    assert doc["budgets"][0]["tenant"] == "acme" and doc["hourly"][0]["requests"] == 2
    assert "usd_per_1m_input_tokens" in doc["groups"][0] and doc["totals"]["requests"] == 4


def test_plot_writes_png_charts(out, tmp_path):
    paths = plot(cost_report(out, by=["tenant", "model"]), tmp_path / "charts")
    assert [p.name for p in paths] == ["cost_by_tenant_model.png", "device_time_per_hour.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_report_costs_command(out, tmp_path):
    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[tenants]\nacme = 0.001\n')
    proc = zygote.run(
        mqinfer_cmd("report", "costs", str(out), "--by", "tenant,job_id", "--format", "json", "--budgets",
                str(budgets), "--top", "3", "--plot", str(tmp_path / "charts"), "--since", "2023-11-14T23:00:00"),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["by"] == ["tenant", "job_id"] and len(doc["top_requests"]) == 3
    assert doc["since"] == H  # an ISO time without a zone is UTC
    assert {g["key"]["tenant"]: g["over_budget"] for g in doc["groups"]}["acme"] is True
    assert (tmp_path / "charts" / "device_time_per_hour.png").exists()
    bad = zygote.run(mqinfer_cmd("report", "costs", str(out), "--budgets", str(tmp_path / "missing.toml")),
                     capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "missing.toml" in bad.stderr
