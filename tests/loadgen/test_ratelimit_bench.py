"""The rate-limit benchmark: its flags, its per-tenant arithmetic, and (slow) a few seconds through two
real workers with the tiny model."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import pytest

from mqinfer.loadgen import ratelimit_bench
from mqinfer.workers.tenant_limits import TenantLimit


def test_bad_limits_and_rates_exit_2(capsys):
    for argv, message in [(["--limits", "gold=-1"], "must be a finite number > 0, got '-1'"),
                          (["--limits", "gold=1,gold=2"], "tenant 'gold' is given twice"),
                          (["--limits", "free=10"], "the unlimited tenant's name"),
                          (["--overload", "x"], "expected a number")]:
        with pytest.raises(SystemExit) as exc:
            ratelimit_bench.build_parser().parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_achieved_tokens_per_second_count_the_requests_started_in_the_window():
    args = argparse.Namespace(prompt_len=4, max_tokens=6, overload=2.0, free_rate=1.0)

    def row(tenant, at, worker="w0", error_code=None):
        started = None if at is None else datetime.fromtimestamp(at, timezone.utc)
        return {"tenant": tenant, "started_at": started, "worker": worker, "error_code": error_code,
                "finish_reason": "error" if error_code else "length"}

    rows = [row("gold", 100.5), row("gold", 101.0, "w1"), row("gold", 104.0), row("gold", 111.0),
            row("gold", None, error_code="rate_limited"), row("free", 102.0)]
    tenants = ratelimit_bench.measure(rows, {"gold": TenantLimit(10)}, args, (100.0, 110.0))
    gold = tenants["gold"]
    assert gold["achieved_tokens_per_s"] == pytest.approx(3 * 10 / 10)  # 3 starts of 10 tokens in 10 s
    assert gold["error"] == pytest.approx(3 / 10 - 1)
    assert (gold["requests"], gold["ran"], gold["rate_limited"]) == (5, 4, 1)
    assert gold["by_worker"] == {"w0": 2, "w1": 1} and gold["offered_tokens_per_s"] == 20
    assert tenants["free"]["limit_tokens_per_s"] is None and tenants["free"]["achieved_tokens_per_s"] == 1.0


@pytest.mark.slow  # the default suite holds two workers to a shared limit in tests/workers/test_rate_limits.py
def test_a_short_run_through_two_real_workers(tmp_path, capsys):
    out = tmp_path / "rl.json"
    code = ratelimit_bench.main(["--limits", "gold=320", "--duration-s", "4", "--skip-s", "1", "--free-rate", "2",
                                 "--json", str(out), "--out", str(tmp_path / "out")])
    assert code == 0
    assert "achieved" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["rows"] == result["submitted"]
    gold = result["tenants"]["gold"]
    # 3 s measured at 10 requests a second: a request (32 tokens) more or less is 11 tokens/s.
    assert gold["achieved_tokens_per_s"] <= 320 + 32 / 3 + 1e-9
    assert gold["rate_limited"] > 0 and len(gold["by_worker"]) == 2
