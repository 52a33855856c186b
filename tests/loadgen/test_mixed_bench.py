"""The mixed benchmark (interactive requests beside a bulk backlog): its flags, its arithmetic, and
one small run with the tiny model through a real worker on the CPU (a few seconds)."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen import mixed_bench
from mqinfer.loadgen.bench_model import resolve_model
from mqinfer.loadgen.metrics import RequestTiming


def timing(rid: str, enqueued: float, first: float, finished: float, output: int) -> RequestTiming:
    return RequestTiming(rid, 8, requested_tokens=output, output_tokens=output, enqueued_at=enqueued,
                         started_at=enqueued, first_token_at=first, finished_at=finished)


def test_throughput_and_latency_come_from_the_rows():
    rows = [timing("a", 10.0, 10.1, 11.1, 11), timing("b", 10.5, 10.8, 12.0, 5)]
    # 16 tokens from the first arrival (10.0) to the last row (12.0).
    assert mixed_bench.throughput(rows) == pytest.approx(8.0)
    stats = mixed_bench.latency(rows)
    assert stats["count"] == 2
    assert stats["ttft"]["max"] == pytest.approx(0.3) and stats["tpot"]["max"] == pytest.approx(0.3)
    assert mixed_bench.throughput([]) == 0.0


def test_interactive_requests_carry_the_targets_unless_told_not_to():
    spec = resolve_model("tiny")
    args = mixed_bench.build_parser().parse_args(["--slo-ttft-ms", "300", "--slo-tpot-ms", "30",
                                                  "--interactive-requests", "3", "--bulk-requests", "2"])
    work = mixed_bench.workloads(spec, args)
    assert all(r["slo_ttft_ms"] == 300 and r["slo_tpot_ms"] == 30 for r in work["interactive"] + work["mixed_interactive"])
    assert not any("slo_tpot_ms" in r for r in work["bulk"] + work["mixed_bulk"])
    # No run shares a prompt with another (no prefix-cache hits across runs).
    prompts = [tuple(r["prompt_token_ids"]) for rs in work.values() for r in rs]
    assert len(set(prompts)) == len(prompts)
    args = mixed_bench.build_parser().parse_args(["--no-targets", "--interactive-requests", "2"])
    assert not any("slo_tpot_ms" in r for r in mixed_bench.workloads(spec, args)["interactive"])


@pytest.mark.parametrize("argv, message", [(["--slo-tpot-ms", "0"], "expected"),
                                           (["--interactive-rate", "-1"], "expected a finite number > 0"),
                                           (["--bulk-requests", "x"], "")])
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        mixed_bench.build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_small_run_with_the_tiny_model_through_a_real_worker(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    code = mixed_bench.main(["--model", "tiny", "--interactive-requests", "3", "--interactive-rate", "20",
                             "--interactive-prompt-len", "12", "--interactive-output-len", "6", "--bulk-requests", "8",
                             "--bulk-prompt-len", "20", "--bulk-output-len", "10", "--mixed-delay-s", "0.1",
                             "--num-threads", "1", "--json", str(out), "--out", str(tmp_path / "out")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "interactive latency, ms" in printed and "total throughput" in printed
    result = json.loads(out.read_text())
    assert result["targets"] == {"slo_ttft_ms": 500, "slo_tpot_ms": 50}
    for run in ("alone", "mixed"):
        stats = result["latency_s"][run]
        assert stats["count"] == 3
        assert 0 < stats["ttft"]["p50"] <= stats["ttft"]["p99"] and 0 < stats["tpot"]["p99"]
    assert result["bulk_mixed_rows"] == 8
    tps = result["throughput_tokens_per_s"]
    assert tps["bulk_alone"] > 0 and tps["mixed"] > 0
    assert tps["mixed_over_bulk_alone"] == pytest.approx(tps["mixed"] / tps["bulk_alone"])
    assert result["mixed_over_alone"]["tpot_p99"] == pytest.approx(
        result["latency_s"]["mixed"]["tpot"]["p99"] / result["latency_s"]["alone"]["tpot"]["p99"])
