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
    # Targets: TTFTs of 0.1 s and 0.3 s, TPOTs of 0.1 s and 0.3 s, against targets between.
    assert "met_targets" not in stats
    assert mixed_bench.latency(rows, {"slo_ttft_ms": 250, "slo_tpot_ms": 200})["met_targets"] == 1
    assert mixed_bench.latency(rows, {"slo_ttft_ms": 301, "slo_tpot_ms": 301})["met_targets"] == 2
    assert mixed_bench.latency(rows, {"slo_ttft_ms": 50, "slo_tpot_ms": 300})["met_targets"] == 0


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
    assert "met both targets: alone " in printed
    result = json.loads(out.read_text())
    assert result["targets"] == {"slo_ttft_ms": 500, "slo_tpot_ms": 50}
    for run in ("alone", "mixed"):
        stats = result["latency_s"][run]
        assert stats["count"] == 3
        assert 0 < stats["ttft"]["p50"] <= stats["ttft"]["p99"] and 0 < stats["tpot"]["p99"]
        assert 0 <= stats["met_targets"] <= 3
    assert result["bulk_mixed_rows"] == 8
    tps = result["throughput_tokens_per_s"]
    assert tps["bulk_alone"] > 0 and tps["mixed"] > 0
    assert tps["mixed_over_bulk_alone"] == pytest.approx(tps["mixed"] / tps["bulk_alone"])
    assert result["mixed_over_alone"]["tpot_p99"] == pytest.approx(
        result["latency_s"]["mixed"]["tpot"]["p99"] / result["latency_s"]["alone"]["tpot"]["p99"])


def test_the_vllm_peer_gets_the_same_runs_with_interactive_requests_at_the_higher_priority():
    from mqinfer.loadgen import vllm_mixed

    spec = resolve_model("tiny")
    args = mixed_bench.build_parser().parse_args(["--interactive-requests", "3", "--bulk-requests", "4"])
    work = mixed_bench.workloads(spec, args)
    phases = mixed_bench.phases(args)
    runner = vllm_mixed.runner_spec(spec.folder or "tiny", "auto", 16, work, phases)
    assert [p["name"] for p in runner["phases"]] == ["bulk alone", "mixed", "interactive alone"]
    assert runner["dtype"] == "bfloat16" and runner["max_num_seqs"] == 16
    mixed = runner["phases"][1]["requests"]
    assert [r["priority"] for r in mixed] == [1] * 4 + [0] * 3  # vLLM serves the lower value first
    assert [r["arrival_s"] for r in mixed] == phases[1][1][0][1] + phases[1][1][1][1]
    assert [r["prompt_token_ids"] for r in mixed[4:]] == [r["prompt_token_ids"] for r in work["mixed_interactive"]]
    assert runner["max_model_len"] == max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in mixed)
    # The runner's per-request times become the bench's timings, key by key; one never finished is not ok.
    result = {"phases": {p["name"]: [{"id": r["id"], "enqueued_at": 100.0 + r["arrival_s"], "prompt_tokens": 1,
                                      "first_token_at": 101.0 + r["arrival_s"], "output_tokens": r["max_tokens"],
                                      "finished_at": 103.0 + r["arrival_s"]} for r in p["requests"]]
                         for p in runner["phases"]}}
    result["phases"]["mixed"][0]["finished_at"] = None
    timings = vllm_mixed.timings_of(result, work)
    assert [t.ok for t in timings["mixed_bulk"]] == [False, True, True, True]
    chat = timings["mixed_interactive"][0]
    assert chat.ttft == pytest.approx(1.0) and chat.output_tokens == work["mixed_interactive"][0]["max_tokens"]
    assert mixed_bench.summarize(timings)["latency_s"]["mixed"]["count"] == 3


def test_a_python_without_vllm_is_a_recorded_failure_and_the_flags_are_checked(tmp_path, capsys):
    import sys

    from mqinfer.loadgen import vllm_mixed

    spec = resolve_model("tiny")
    args = mixed_bench.build_parser().parse_args(["--interactive-requests", "2", "--bulk-requests", "2",
                                                  "--compare", "vllm", "--vllm-python", sys.executable,
                                                  "--out", str(tmp_path)])
    work = mixed_bench.workloads(spec, args)
    peer = vllm_mixed.compare(args, tmp_path / "model", work, mixed_bench.phases(args), mixed_bench.summarize)
    assert "No module named 'vllm'" in peer["error"]
    assert mixed_bench.against({}, peer) == {}
    for argv, words in ((["--compare", "vllm"], "needs --vllm-python"),
                        (["--vllm-python", sys.executable], "--compare vllm only"),
                        (["--model", "tiny", "--compare", "vllm", "--vllm-python", sys.executable],
                         "needs a checkpoint folder")):
        with pytest.raises(SystemExit, match=words):
            mixed_bench.run(mixed_bench.build_parser().parse_args(argv))
    with pytest.raises(SystemExit):
        mixed_bench.build_parser().parse_args(["--compare", "hf"])
