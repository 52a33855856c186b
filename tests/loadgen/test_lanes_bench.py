"""The lanes benchmark: its arithmetic (which entries a stream has delivered, the contention
window, tokens in a window), its flags, and one small run of each scenario with the tiny model
through real workers under --lanes tenant and --lanes none (a few seconds each)."""

from __future__ import annotations

import json
import math

import pytest

from mqinfer.loadgen import lanes_bench
from mqinfer.loadgen.metrics import RequestTiming


def test_help_names_the_scenarios_and_the_comparison(capsys):
    with pytest.raises(SystemExit) as exc:
        lanes_bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("--scenario", "backlog", "weights", "throughput", "--lanes-compare", "--rounds", "--json"):
        assert word in text


def test_flags_parse_and_bad_values_exit_2(capsys):
    parse = lanes_bench.build_parser().parse_args
    assert parse([]).scenario == ["backlog", "weights", "throughput"]
    assert parse(["--scenario", "weights"]).scenario == ["weights"]
    assert parse(["--lanes-compare", "tenant,none"]).lanes_compare == ["tenant", "none"]
    assert parse(["--lanes-compare", "job,tenant"]).lanes_compare == ["tenant,job"]  # the one mode
    assert parse(["--lanes-compare", "tenant,job/none/job"]).lanes_compare == ["tenant,job", "none", "job"]
    assert parse([]).tenant_weights == {"alpha": 2.0, "beta": 1.0}
    for argv, message in [(["--scenario", "fast"], "unknown scenario"),
                          (["--lanes-compare", "tenant/lanes"], "--lanes must be one of"),
                          (["--rounds", "0"], "expected an integer >= 1")]:
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_rounds_alternate_which_mode_goes_first():
    assert [lanes_bench.mode_order(["tenant", "none"], k) for k in range(3)] == [
        ["tenant", "none"], ["none", "tenant"], ["tenant", "none"]]


def test_a_stream_delivers_its_first_entries_and_their_tenants_are_counted():
    order = {"one": ["a", "b", "a", "b"], "lane-a": ["a", "a", "a"]}
    assert lanes_bench.delivered_by_tenant(order, {"one": 4, "lane-a": 3}) == {"a": 0, "b": 0}
    assert lanes_bench.delivered_by_tenant(order, {"one": 1, "lane-a": 1}) == {"a": 4, "b": 1}
    assert lanes_bench.delivered_by_tenant(order, {"one": 0, "lane-a": 0}) == {"a": 5, "b": 2}


def test_the_window_ends_at_the_last_sample_with_both_tenants_unread():
    samples = [(1.0, {"a": 0, "b": 0}, {"a": 4, "b": 4}),
               (2.0, {"a": 2, "b": 1}, {"a": 2, "b": 3}),
               (3.0, {"a": 4, "b": 2}, {"a": 0, "b": 2}),
               (4.0, {"a": 4, "b": 4}, {"a": 0, "b": 0})]
    assert lanes_bench.contention_window(samples, ("a", "b")) == (2.0, {"a": 2, "b": 1})
    assert lanes_bench.contention_window(samples[2:], ("a", "b")) is None


def test_output_tokens_in_a_window_are_spread_over_decoding():
    t = RequestTiming("x", 10, requested_tokens=10, output_tokens=10, enqueued_at=0.0, started_at=0.5,
                      first_token_at=1.0, finished_at=3.0)
    assert lanes_bench.output_tokens_in([t], 0.0, 10.0) == pytest.approx(10)
    assert lanes_bench.output_tokens_in([t], 0.0, 2.0) == pytest.approx(5)
    assert lanes_bench.output_tokens_in([t], 3.5, 9.0) == 0


def _run(tmp_path, scenario: str, *extra: str) -> dict:
    out = tmp_path / "lanes.json"
    code = lanes_bench.main(["--scenario", scenario, "--model", "tiny", "--workers", "1", "--num-threads", "1",
                             "--max-num-seqs", "2", "--max-batch", "2", "--prompt-len", "8,16", "--output-len", "4,8",
                             "--json", str(out), "--out", str(tmp_path / "out"), *extra])
    assert code == 0
    return json.loads(out.read_text())


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_a_small_backlog_run(tmp_path, capsys):
    result = _run(tmp_path, "backlog", "--bulk-requests", "12", "--interactive-requests", "3", "--rounds", "1")
    assert "backlog: 12 bulk requests" in capsys.readouterr().out
    runs = result["backlog"]["runs"]
    assert [r["lanes"] for r in runs] == ["tenant", "none"]
    for r in runs:
        assert 0 <= r["bulk_finished_by_then"] <= 12
        assert r["bulk_finished_share"] == pytest.approx(r["bulk_finished_by_then"] / 12)
        assert r["interactive_last_finished_s"] > 0 and r["alone_last_finished_s"] > 0
        for key in ("interactive_queue_delay_s", "alone_queue_delay_s"):
            assert r[key]["count"] == 3 and 0 <= r[key]["p50"] <= r[key]["p99"]
        assert _number(r["p99_vs_alone"]) and isinstance(r["goal_met"], bool)
    for mode in ("tenant", "none"):
        assert all(_number(v) for v in result["backlog"]["median"][mode].values())


def test_a_small_weights_run(tmp_path, capsys):
    result = _run(tmp_path, "weights", "--weights-requests", "10", "--rounds", "1")
    assert "alpha=2,beta=1 (target 2)" in capsys.readouterr().out
    weights = result["weights"]
    assert weights["target_ratio"] == 2.0
    runs = {r["lanes"]: r for r in weights["runs"]}
    for r in runs.values():
        # A worker holds about 6 of the 20 requests: both tenants are still unread at the first look.
        assert r["samples"] >= 2 and r["window_s"] > 0
        for key in ("delivered_ratio", "started_ratio", "output_tokens_ratio", "both_unfinished_output_tokens_ratio"):
            assert _number(r[key]) and r[key] > 0
        assert 0 < r["delivered"]["alpha"] + r["delivered"]["beta"] < 20
        assert r["output_tokens"]["alpha"] > 0 and r["output_tokens"]["beta"] > 0
    # One stream, requests interleaved alpha, beta, ...: the queue hands them out in that order.
    assert runs["none"]["delivered"]["alpha"] - runs["none"]["delivered"]["beta"] in (0, 1)


def test_a_small_throughput_run(tmp_path, capsys):
    result = _run(tmp_path, "throughput", "--throughput-requests", "2", "--rounds", "1")
    assert "throughput: the standard workload" in capsys.readouterr().out
    t = result["throughput"]
    assert [(r["round"], r["lanes"]) for r in t["runs"]] == [(1, "tenant"), (1, "none")]
    for r in t["runs"]:
        for tenant in ("default", "solo"):
            assert r["tenants"][tenant]["output_tokens_per_s"] > 0 and r["tenants"][tenant]["errors"] == 0
    assert t["ratio"]["none"]["default"] == {"rounds": [1.0], "median": 1.0}
    for tenant in ("default", "solo"):
        ratio = t["ratio"]["tenant"][tenant]
        [value] = ratio["rounds"]
        assert _number(value) and value > 0 and ratio["median"] == value


def test_throughput_ratios_pair_each_rounds_modes_and_take_the_median():
    def run(round_no, mode, default, solo):
        return {"round": round_no, "lanes": mode, "tenants": {
            "default": {"output_tokens_per_s": default}, "solo": {"output_tokens_per_s": solo}}}

    runs = [run(1, "tenant", 110.0, 90.0), run(1, "none", 100.0, 100.0),
            run(2, "none", 200.0, 100.0), run(2, "tenant", 180.0, 120.0),
            run(3, "tenant", 300.0, 100.0), run(3, "none", 300.0, 100.0)]
    ratios = lanes_bench.throughput_ratios(runs, ["tenant", "none"])
    assert ratios["tenant"]["default"] == {"rounds": [pytest.approx(1.1), pytest.approx(0.9), 1.0],
                                           "median": 1.0}
    assert ratios["tenant"]["solo"]["rounds"] == [pytest.approx(0.9), pytest.approx(1.2), 1.0]
    assert ratios["none"]["solo"] == {"rounds": [1.0, 1.0, 1.0], "median": 1.0}
    summary = lanes_bench.summarize_runs("throughput", runs, ["tenant", "none"])
    assert summary["tenant"]["tenants.default.output_tokens_per_s"] == 180.0
