"""Budgets on any group (tenants, jobs, metadata.KEY = VALUE) with warning thresholds: the file,
the report's statuses and marks, the worker's guard against a real Redis server, and the metrics
per group and threshold."""

from __future__ import annotations

import csv
import io

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mqinfer.ops.budgets import (BudgetError, BudgetGuard, Budgets, check_groups, group_spend_key, load_budgets,
                                 spend_key)
from mqinfer.ops.metrics import WorkerMetrics
from mqinfer.ops.report import cost_report
from mqinfer.ops.report_render import render
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.rows import COST_SCHEMA, CostRow
from tests.helpers import FakeClock

T = 1_700_002_800.0  # 2023-11-14T23:00:00Z
PRICE = 3.6  # 0.001 USD per device second

FILE = '''
period = "month"
thresholds = [25, 50, 100]
[tenants]
acme = 1.0
[jobs]
nightly = 0.010
[metadata.business_line]
retail = 0.004
travel = 0.100
'''


def test_a_budgets_file_with_jobs_metadata_groups_and_thresholds(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(FILE)
    b = load_budgets(path)
    assert b.jobs == {"nightly": 0.01} and b.metadata == {"business_line": {"retail": 0.004, "travel": 0.1}}
    assert b.thresholds == (25.0, 50.0, 100.0)
    assert b.keys() == ["tenant", "job_id", "metadata.business_line"]
    assert b.budget_of("job_id", "nightly") == 0.01 and b.budget_of("metadata.business_line", "retail") == 0.004
    assert b.budget_of("metadata.business_line", "health") is None and b.budget_of("job_id", None) is None
    assert b.groups_of("acme", "nightly", {"business_line": "retail", "ticket": "T-1"}) == [
        ("tenant", "acme", 1.0), ("job_id", "nightly", 0.01), ("metadata.business_line", "retail", 0.004)]
    assert b.groups_of("beta", None, {}) == []
    # The default lines are 50, 80 and 100 percent.
    assert Budgets().thresholds == (50.0, 80.0, 100.0)
    assert b.reached(0.003, 0.004) == [25.0, 50.0] and b.reached(0.0, 0.0) == [] and b.reached(1e-9, 0.0) == [
        25.0, 50.0, 100.0]


@pytest.mark.parametrize("text, message", [
    ("thresholds = [80, 50]\n", "thresholds"),
    ("thresholds = []\n", "thresholds"),
    ("thresholds = [0, 50]\n", "thresholds"),
    ('thresholds = ["half"]\n', "thresholds"),
    ("[jobs]\nj1 = -2\n", "jobs.j1"),
    ("[metadata]\nbusiness_line = 3\n", "metadata.business_line"),
    ("[metadata.business_line]\nretail = \"lots\"\n", "metadata.business_line.retail"),
    ("jobs = 1\n", "`jobs` must be a table"),
])
def test_bad_group_budgets_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "b.toml"
    path.write_text(text)
    with pytest.raises(BudgetError, match=message):
        load_budgets(path)


def _row(rid, tenant, *, at, seconds, job="nightly", line=None):
    return CostRow(kind="request", job_id=job, id=rid, tenant=tenant, model="m", device_s=seconds,
                   decode_s=seconds, cost_usd=seconds * PRICE / 3600, price_per_device_hour=PRICE, worker="w1",
                   finished_at=at, index=0, metadata={"business_line": line} if line else {})


@pytest.fixture
def out(tmp_path):
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write([
        _row("r1", "acme", at=T + 10, seconds=3.0, line="retail"),  # 0.003 USD
        _row("r2", "acme", at=T + 20, seconds=2.0, line="retail"),  # 0.002
        _row("t1", "beta", at=T + 30, seconds=30.0, line="travel", job="other"),  # 0.030
        _row("n1", "beta", at=T + 40, seconds=1.0),  # 0.001, no label
    ])
    (tmp_path / "b.toml").write_text(FILE)
    return tmp_path


def test_the_report_lists_every_group_with_the_thresholds_it_reached(out):
    report = cost_report(out, by=["metadata.business_line"], budgets=load_budgets(out / "b.toml"))
    status = {s.group: s for s in report.budgets}
    assert list(status) == ["tenant=acme", "job_id=nightly", "metadata.business_line=retail",
                            "metadata.business_line=travel"]
    retail = status["metadata.business_line=retail"]
    assert retail.spent_usd == pytest.approx(0.005) and retail.over and retail.thresholds_reached == [25, 50, 100]
    assert retail.tenant is None and retail.period == "2023-11"
    travel = status["metadata.business_line=travel"]
    assert travel.thresholds_reached == [25.0] and not travel.over  # 0.03 of 0.1
    nightly = status["job_id=nightly"]
    assert nightly.spent_usd == pytest.approx(0.006) and nightly.thresholds_reached == [25.0, 50.0]
    assert status["tenant=acme"].thresholds_reached == []
    # Groups keyed by the label carry the marks; a group of no budget carries none.
    marks = {g.key["metadata.business_line"]: (g.over_budget, g.budget_threshold) for g in report.groups}
    assert marks == {"retail": (True, 100.0), "travel": (False, 25.0), None: (None, None)}
    table = render(report)
    lines = {line.split()[0]: line for line in table.splitlines() if line.split()}
    assert lines["retail"].rstrip().endswith("OVER") and lines["travel"].rstrip().endswith(">=25%")
    assert "job_id=nightly" in table and "warning: >=50%" in table and "OVER BUDGET" in table
    parsed = {r["metadata.business_line"]: (r["over_budget"], r["budget_threshold"])
              for r in csv.DictReader(io.StringIO(render(report, "csv"))) if r["row"] == "group"}
    assert parsed == {"retail": ("true", "100.0"), "travel": ("false", "25.0"), "": ("", "")}
    # By job: the job's mark; by a key no budget names: no marks.
    by_job = {g.key["job_id"]: g.over_budget for g in cost_report(out, by="job_id",
                                                                 budgets=load_budgets(out / "b.toml")).groups}
    assert by_job == {"nightly": False, "other": None}
    assert cost_report(out, by="model", budgets=load_budgets(out / "b.toml")).budget_marks is False


def test_check_groups_takes_the_worst_period():
    b = Budgets(jobs={"j": 1.0}, period="day")
    (s,) = check_groups(b, {("job_id", "j", "2023-11-14"): 0.6, ("job_id", "j", "2023-11-15"): 0.9,
                            ("job_id", "x", "2023-11-14"): 5.0})
    assert (s.group, s.period, s.spent_usd, s.thresholds_reached) == ("job_id=j", "2023-11-15", 0.9, [50.0, 80.0])


def test_the_guard_refuses_a_spent_metadata_group_or_job_and_charges_each_group(redis_client):
    clock = FakeClock(T)
    budgets = Budgets(jobs={"nightly": 0.5}, metadata={"business_line": {"retail": 0.3}}, period="month")
    guard = BudgetGuard(budgets, redis_client, "bg", clock=clock, refresh_s=60.0)
    retail = {"business_line": "retail"}
    assert guard.exceeded("acme", job_id="nightly", metadata=retail) is None
    guard.note("1-0", "acme", 0.3, T, job_id="nightly", metadata=retail)
    refused = guard.exceeded("beta", metadata=retail)  # another tenant, the same label
    assert "metadata.business_line='retail'" in refused and "month 2023-11" in refused
    assert guard.exceeded("beta", job_id="nightly", metadata={"business_line": "travel"}) is None
    guard.note("2-0", "beta", 0.25, T, job_id="nightly", metadata={"business_line": "travel"})
    assert "job 'nightly'" in guard.exceeded(None, job_id="nightly")

    pipe = redis_client.pipeline(transaction=True)
    charged = guard.charge(pipe, ["1-0", "2-0"])
    pipe.execute()
    guard.charged(charged)
    groups = {k.decode(): float(v) for k, v in redis_client.hgetall(group_spend_key("bg", "2023-11")).items()}
    assert groups == {"job_id=nightly": pytest.approx(0.55), "metadata.business_line=retail": pytest.approx(0.3)}
    # Tenants are charged as ever, whether or not they have a budget.
    tenants = {k.decode(): float(v) for k, v in redis_client.hgetall(spend_key("bg", "2023-11")).items()}
    assert tenants == {"acme": pytest.approx(0.3), "beta": pytest.approx(0.25)}
    assert guard.group_spend_snapshot() == {("tenant", "acme"): pytest.approx(0.3),
                                            ("tenant", "beta"): pytest.approx(0.25),
                                            ("job_id", "nightly"): pytest.approx(0.55),
                                            ("metadata.business_line", "retail"): pytest.approx(0.3)}
    # Another worker reading the hashes refuses the same requests.
    other = BudgetGuard(budgets, redis_client, "bg", clock=clock)
    assert other.exceeded("x", job_id="nightly") is not None and other.exceeded("x", metadata=retail) is not None


def test_metrics_per_group_and_threshold(redis_client):
    clock = FakeClock(T)
    budgets = Budgets(tenants={"acme": 1.0}, jobs={"nightly": 0.5}, metadata={"business_line": {"retail": 0.3}})
    guard = BudgetGuard(budgets, redis_client, "bm", clock=clock)
    redis_client.hincrbyfloat(spend_key("bm"), "acme", 0.6)
    redis_client.hincrbyfloat(group_spend_key("bm"), "job_id=nightly", 0.45)
    m = WorkerMetrics()
    m.watch_budgets(guard, redis_client)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples
               if s.name.startswith("mqinfer_budget") or s.name.startswith("mqinfer_tenant_")}

    def reached(key, value):
        return {t: samples[("mqinfer_budget_threshold_reached",
                            (("key", key), ("threshold", t), ("value", value)))] for t in ("50", "80", "100")}

    assert reached("tenant", "acme") == {"50": 1.0, "80": 0.0, "100": 0.0}
    assert reached("job_id", "nightly") == {"50": 1.0, "80": 1.0, "100": 0.0}
    assert reached("metadata.business_line", "retail") == {"50": 0.0, "80": 0.0, "100": 0.0}
    assert samples[("mqinfer_budget_usd", (("key", "job_id"), ("value", "nightly")))] == 0.5
    assert samples[("mqinfer_budget_spend_usd", (("key", "job_id"), ("value", "nightly")))] == pytest.approx(0.45)
    assert samples[("mqinfer_tenant_spend_usd", (("tenant", "acme"),))] == pytest.approx(0.6)
    # Spending the rest of the job's budget raises its 100% line.
    redis_client.hincrbyfloat(group_spend_key("bm"), "job_id=nightly", 0.05)
    text = generate_latest(m.registry).decode()
    assert 'mqinfer_budget_threshold_reached{key="job_id",threshold="100",value="nightly"} 1.0' in text


def test_a_worker_refuses_a_spent_label_group_and_exports_its_lines(redis_url, redis_client, tmp_path):
    """A real worker with --enforce-budgets: the first request labelled business_line=retail spends
    that group's whole (tiny) budget; the next one is refused, another label's request runs, and the
    metrics say the group reached every threshold."""
    import json
    import signal
    import socket
    import urllib.request

    from mqinfer.schemas import keys
    from tests.helpers import rows, start_worker, wait_exit, wait_until

    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[metadata.business_line]\nretail = 0.000000001\ntravel = 1000\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    worker = start_worker(redis_url, out, "--stream", "bgw", "--budgets", str(budgets), "--enforce-budgets",
                          "--metrics-port", str(port), "--flush-interval-s", "0.1", "--price-per-device-hour", "36",
                          "--consumer", "w1")

    def send(rid, line):
        redis_client.xadd(keys.request_stream("bgw"), {"json": json.dumps(
            {"id": rid, "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True, "temperature": 0,
             "metadata": {"business_line": line}}), "v": "1"})

    def results():
        return {r["id"]: r for r in rows(out / "results")} if (out / "results").is_dir() else {}

    try:
        send("r1", "retail")
        wait_until(lambda: redis_client.hget(group_spend_key("bgw"), "metadata.business_line=retail"),
                   timeout=120, what="r1's spend acked")
        send("r2", "retail")
        send("t1", "travel")
        wait_until(lambda: {"r1", "r2", "t1"} <= set(results()), timeout=60, what="three rows")
        got = results()
        assert got["r1"]["finish_reason"] == "length" and got["t1"]["finish_reason"] == "length"
        assert got["r2"]["error_code"] == "budget_exceeded"
        assert "metadata.business_line='retail'" in got["r2"]["error"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for threshold in ("50", "80", "100"):
            assert (f'mqinfer_budget_threshold_reached{{key="metadata.business_line",threshold="{threshold}",'
                    'value="retail"} 1.0') in text
            assert (f'mqinfer_budget_threshold_reached{{key="metadata.business_line",threshold="{threshold}",'
                    'value="travel"} 0.0') in text
    finally:
        worker.send_signal(signal.SIGTERM)
        code, err = wait_exit(worker)
    assert code == 0, err[-3000:]
