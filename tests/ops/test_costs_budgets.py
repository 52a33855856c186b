"""Budgets: the TOML file, checking spend, and the worker-side guard against a real Redis server."""

from __future__ import annotations

import pytest

from mqinfer.ops.budgets import BudgetError, Budgets, BudgetGuard, BudgetStatus, check_budgets, load_budgets, spend_key
from tests.helpers import FakeClock

T = 1_700_002_800.0  # 2023-11-14T23:00:00Z


def test_load_a_budgets_file(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text('period = "month"\ndefault_usd = 5\n[tenants]\nacme = 120.5\n"team b" = 0\n')
    b = load_budgets(path)
    assert b == Budgets(tenants={"acme": 120.5, "team b": 0}, default_usd=5, period="month")
    assert b.limit("acme") == 120.5 and b.limit("team b") == 0 and b.limit("other") == 5
    assert b.limit(None) == 5  # a request without a tenant is tenant "default"
    assert Budgets(tenants={"acme": 1.0}).limit("beta") is None


@pytest.mark.parametrize("text, message", [
    ('period = "week"\n', "period"),
    ('[tenants]\nacme = -1\n', "tenants.acme"),
    ('[tenants]\nacme = "lots"\n', "tenants.acme"),
    ('[tenants]\nacme = inf\n', "tenants.acme"),
    ('default_usd = true\n', "default_usd"),
    ('tenants = 3\n', "table"),
    ('budget = 3\n', "unknown keys budget"),
    ('[tenants\n', "not valid TOML"),
])
def test_bad_budgets_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "b.toml"
    path.write_text(text)
    with pytest.raises(BudgetError, match=message) as info:
        load_budgets(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(BudgetError, match="does not exist"):
        load_budgets(tmp_path / "nope.toml")


def test_periods_are_utc_calendar_periods():
    assert Budgets(period="total").period_of(T) == ""
    assert Budgets(period="month").period_of(T) == "2023-11"
    assert Budgets(period="day").period_of(T) == "2023-11-14"
    assert Budgets(period="day").period_of(T + 3600) == "2023-11-15"


def test_check_budgets_reports_the_worst_period():
    b = Budgets(tenants={"acme": 10.0, "idle-co": 3.0}, default_usd=1.0, period="day")
    spend = {("acme", "2023-11-14"): 4.0, ("acme", "2023-11-15"): 12.0, ("beta", "2023-11-14"): 0.5,
             ("gamma", "2023-11-14"): 1.0}
    got = {s.tenant: s for s in check_budgets(b, spend)}
    assert got["acme"] == BudgetStatus("acme", "2023-11-15", 10.0, 12.0, True, 0.0,
                                       thresholds_reached=[50.0, 80.0, 100.0])
    assert got["beta"] == BudgetStatus("beta", "2023-11-14", 1.0, 0.5, False, 0.5, thresholds_reached=[50.0])
    assert got["gamma"].over  # spending exactly the budget reaches it
    assert got["idle-co"] == BudgetStatus("idle-co", "", 3.0, 0.0, False, 3.0)
    assert check_budgets(Budgets(tenants={"acme": 1.0}), {("nobody", ""): 9.0})[0].tenant == "acme"


def test_spend_keys_share_the_stream_slot():
    assert spend_key("requests") == "mqinfer:{requests}:spend"
    assert spend_key("requests", "2023-11") == "mqinfer:{requests}:spend:2023-11"


def test_guard_refuses_once_spent_and_counts_spend_at_ack(redis_client):
    clock = FakeClock(T)
    guard = BudgetGuard(Budgets(tenants={"acme": 0.5, "zero": 0.0}, period="month"), redis_client, "requests",
                        clock=clock, refresh_s=60.0)
    assert guard.exceeded("acme") is None and guard.exceeded("nobody") is None
    refused = guard.exceeded("zero")
    assert "zero" in refused and "month 2023-11" in refused

    guard.note("1-0", "acme", 0.3, T)
    guard.note("2-0", "acme", 0.0, T)  # free rows are not tracked
    assert guard.exceeded("acme") is None  # 0.3 written, not acked: still under 0.5
    guard.note("3-0", "acme", 0.25, T)
    assert "acme" in guard.exceeded("acme")  # unacked rows of this worker count too

    pipe = redis_client.pipeline(transaction=True)
    charged = guard.charge(pipe, ["1-0", "2-0", "3-0", "9-9"])
    assert charged == ["1-0", "3-0"]
    pipe.execute()
    guard.charged(charged)
    key = spend_key("requests", "2023-11")
    assert float(redis_client.hget(key, "acme")) == pytest.approx(0.55)
    assert 0 < redis_client.ttl(key) <= 62 * 86_400
    assert "0.550000" in guard.exceeded("acme")
    assert guard.spend_snapshot() == {"acme": pytest.approx(0.55)}

    # A new month starts from zero.
    clock.now = T + 40 * 86_400
    assert guard.exceeded("acme") is None
    assert guard.spend_snapshot() == {}


def test_guard_sees_other_workers_spend_after_its_refresh(redis_client):
    clock = FakeClock(T)
    guard = BudgetGuard(Budgets(tenants={"acme": 1.0}), redis_client, "s1", clock=clock, refresh_s=1.0)
    assert guard.exceeded("acme") is None
    redis_client.hincrbyfloat(spend_key("s1"), "acme", 1.5)  # another worker acked rows
    assert guard.exceeded("acme") is None  # read less than refresh_s ago
    clock.advance(1.0)
    assert "all time" in guard.exceeded("acme")
