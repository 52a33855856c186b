"""The tenants benchmark: its share arithmetic, its flags, and one small run with the tiny model
through real workers (a few seconds)."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen import tenants_bench
from mqinfer.loadgen.metrics import RequestTiming


def test_max_min_fair_gives_a_light_tenant_what_it_asks_and_the_rest_by_weight():
    # Demands as fractions of the capacity: a asks for 10% of it, b for more than all of it.
    assert tenants_bench.max_min_fair({"a": 0.1, "b": 3.0}, {"a": 1, "b": 1}) == pytest.approx({"a": 0.1, "b": 0.9})
    # Both ask for more than their weight's share: shares follow the weights.
    assert tenants_bench.max_min_fair({"a": 1.0, "b": 1.0}, {"a": 2, "b": 1}) == pytest.approx(
        {"a": 2 / 3, "b": 1 / 3})
    assert tenants_bench.max_min_fair({"a": 0.2, "b": 5.0, "c": 5.0}, {"a": 1, "b": 1, "c": 2}) == pytest.approx(
        {"a": 0.2, "b": 0.8 / 3, "c": 1.6 / 3})
    # Everyone asks for less than there is: everyone gets what it asks.
    assert tenants_bench.max_min_fair({"a": 0.2, "b": 0.3}, {"a": 1, "b": 1}) == pytest.approx({"a": 0.2, "b": 0.3})


def test_tokens_served_in_a_window_are_each_requests_share_of_it():
    t = RequestTiming("x", 10, requested_tokens=10, output_tokens=10, enqueued_at=0.0, started_at=1.0,
                      first_token_at=1.5, finished_at=3.0)
    requests = [{"prompt_token_ids": [1] * 10, "max_tokens": 10}]
    assert tenants_bench.served_in([t], requests, 0.0, 10.0) == pytest.approx(20)
    assert tenants_bench.served_in([t], requests, 2.0, 10.0) == pytest.approx(10)
    assert tenants_bench.served_in([t], requests, 3.5, 10.0) == 0


def test_bad_tenant_weights_and_rates_exit_2(capsys):
    for argv, message in [(["--tenant-weights", "light=0"], "must be a finite number > 0"),
                          (["--light-rate", "0"], "expected a finite number > 0")]:
        with pytest.raises(SystemExit) as exc:
            tenants_bench.build_parser().parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_small_run_with_the_tiny_model_through_real_workers(tmp_path, capsys):
    out = tmp_path / "tenants.json"
    code = tenants_bench.main(["--model", "tiny", "--light-requests", "4", "--light-rate", "8", "--heavy-factor", "3",
                               "--prompt-len", "8,24", "--output-len", "4,8", "--max-num-seqs", "4",
                               "--num-threads", "1", "--workers", "1", "--tenant-weights", "light=2",
                               "--json", str(out), "--out", str(tmp_path / "out")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "light tenant queueing delay" in printed and "token shares" in printed
    result = json.loads(out.read_text())
    assert result["tenant_weights"] == "light=2,heavy=1"
    for run in ("alone", "flood"):
        assert result["light_queue_delay_s"][run]["count"] == 4
        assert result["light_queue_delay_s"][run]["p99"] >= 0
    assert result["heavy_queue_delay_s"]["count"] == 12
    tenants = result["tenants"]
    assert tenants["light"]["weight_share"] == pytest.approx(2 / 3)
    assert sum(t["served_share"] for t in tenants.values()) == pytest.approx(1)
    assert sum(t["fair_share"] for t in tenants.values()) == pytest.approx(1)
