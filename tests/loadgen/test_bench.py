"""`mqinfer bench`: flags, arrivals, report pieces, and small runs through real worker processes."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from mqinfer.loadgen import bench, bench_offline, bench_online, bench_pool, bench_report
from mqinfer.loadgen.metrics import summarize, timings_from_rows
from mqinfer.loadgen.workload import uniform_workload


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_pass_through_flags():
    args = parse()
    assert (args.workload, args.num_requests, args.seed, args.mode, args.workers) == ("standard", 256, 0, "offline", "auto")
    assert args.hf_batch_sizes == [16, 64, 256] and args.dtype == "auto" and args.model is None
    args = parse("--max-num-seqs", "32", "--block-size", "8", "--num-threads", "1", "--max-wait-ms", "2.5", "--dtype", "float32",
                 "--rate", "1,2.5", "--hf-batch-sizes", "8,32")
    assert args.rate == [1.0, 2.5] and args.hf_batch_sizes == [8, 32]
    argv = bench_pool.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", Path("/tmp/out"))
    assert argv[1:5] == ["-P", "-m", "mqinfer", "worker"]  # -P: a folder named mqinfer in the cwd is not imported
    pairs = dict(zip(argv[5::2], argv[6::2]))
    assert pairs["--num-threads"] == "1" and pairs["--max-num-seqs"] == "32" and pairs["--block-size"] == "8" and pairs["--max-wait-ms"] == "2.5"
    assert pairs["--dtype"] == "float32" and pairs["--model"] == "tiny" and pairs["--stream"] == bench_pool.STREAM
    assert "--num-kv-blocks" not in pairs  # unset flags keep the worker's defaults
    assert "--speculative" not in pairs
    args = parse("--speculative", "ngram", "--num-speculative-tokens", "3")
    pairs = dict(zip(*[iter(bench_pool.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", Path("/tmp/out"))[5:])] * 2))
    assert pairs["--speculative"] == "ngram" and pairs["--num-speculative-tokens"] == "3"
    assert "--draft-layers" not in pairs
    args = parse("--speculative", "self", "--draft-layers", "2")
    pairs = dict(zip(*[iter(bench_pool.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", Path("/tmp/out"))[5:])] * 2))
    assert pairs["--speculative"] == "self" and pairs["--draft-layers"] == "2"
    assert "--speculative-policy" not in pairs
    args = parse("--speculative", "ngram", "--speculative-policy", "fixed")
    pairs = dict(zip(*[iter(bench_pool.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", Path("/tmp/out"))[5:])] * 2))
    assert pairs["--speculative-policy"] == "fixed"
    assert "--draft-model" not in pairs
    args = parse("--speculative", "draft", "--draft-model", "/m/draft")
    pairs = dict(zip(*[iter(bench_pool.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", Path("/tmp/out"))[5:])] * 2))
    assert pairs["--speculative"] == "draft" and pairs["--draft-model"] == "/m/draft"
    with pytest.raises(SystemExit):
        parse("--rate", "0")
    with pytest.raises(SystemExit):
        parse("--hf-batch-sizes", "16,x")


def test_rate_half_and_wait_settings_parse(monkeypatch):
    args = parse("--mode", "online", "--rate", "2,half,HALF", "--compare-wait", "20,auto,20", "--max-wait-ms", "auto")
    assert args.rate == [2.0, "half"] and args.compare_wait == [20.0, "auto"] and args.max_wait_ms == "auto"
    assert parse("--rate", "half").rate == ["half"]
    for argv in (["--rate", "halve"], ["--rate", "inf"], ["--compare-wait", "-1"], ["--max-wait-ms", "soon"]):
        with pytest.raises(SystemExit):
            parse(*argv)
    # Left out, the workers' wait is their environment's or their default (10 ms).
    monkeypatch.delenv("MQINFER_MAX_WAIT_MS", raising=False)
    assert bench_pool.worker_wait_setting(None) == 10.0 and bench_pool.worker_wait_setting("auto") == "auto"
    monkeypatch.setenv("MQINFER_MAX_WAIT_MS", "auto")
    assert bench_pool.worker_wait_setting(None) == "auto"


def test_budget_of_an_online_point_from_hand_made_rows():
    # TTFT 0.05, 0.06, 0.20 s; TPOT (finished - first) / (tokens - 1) = 0.02, 0.03, 0.04 s: p50 0.03.
    rows = [{"id": i, "finish_reason": "length", "prompt_tokens": 5, "output_tokens": 11, "enqueued_at": 0.0,
             "started_at": 0.01, "first_token_at": ttft, "finished_at": ttft + 10 * tpot}
            for i, ttft, tpot in (("a", 0.05, 0.02), ("b", 0.06, 0.03), ("c", 0.20, 0.04))]
    s = summarize(timings_from_rows(rows, {"a": 11, "b": 11, "c": 11}))
    p99 = 0.06 + 0.98 * (0.20 - 0.06)
    fixed = bench_online.point_budget(s, 150.0)
    assert fixed.step_s == pytest.approx(0.03) and fixed.max_wait_s == pytest.approx(0.15)
    assert fixed.budget_s == pytest.approx(0.15 + 3 * 0.03) and fixed.ttft_p99_s == pytest.approx(p99) and fixed.met
    tight = bench_online.point_budget(s, 10.0)
    assert tight.budget_s == pytest.approx(0.01 + 0.09) and not tight.met
    # auto: the most the adaptive batcher may wait (its default upper bound, 50 ms).
    auto = bench_online.point_budget(s, "auto")
    assert auto.max_wait_s == pytest.approx(0.05) and auto.budget_s == pytest.approx(0.14) and not auto.met
    point = bench_online.OnlinePoint(6.0, s, 0.0, max_wait_ms="auto", budget=auto)
    line = bench_report.budget_line(point)
    assert line.startswith(f"p99 TTFT {p99 * 1000:.1f} ms vs budget 140.0 ms (max_wait 50 [auto")
    assert "+ 3 x step 30.0" in line and line.endswith(": not met")
    line = bench_report.budget_line(bench_online.OnlinePoint(6.0, s, 0.0, max_wait_ms=150.0, budget=fixed))
    assert "vs budget 240.0 ms (max_wait 150 + 3 x step 30.0" in line and line.endswith(": met")
    # One token each: no step measured, no budget.
    one = [{**r, "output_tokens": 1, "finished_at": r["first_token_at"]} for r in rows]
    assert bench_online.point_budget(summarize(timings_from_rows(one, {"a": 1, "b": 1, "c": 1})), 10.0) is None
    # --rate half: half of the requests finished without error per second of span (0.01 .. 0.6 s).
    assert bench_online.half_rate(s) == pytest.approx(float(f"{3 / (0.6 - 0.01) / 2:.3g}"))


def test_each_rate_of_a_sweep_gets_its_own_first_prompt_token():
    requests = uniform_workload(4, prompt_len=(8, 16), output_len=(2, 4), vocab_size=256, seed=1)
    assert bench_online.unshared_prompts(requests, 0, 256) is requests
    salted = [bench_online.unshared_prompts(requests, k, 256) for k in (1, 2)]
    for version in salted:
        for r, s in zip(requests, version):
            assert s["prompt_token_ids"][1:] == r["prompt_token_ids"][1:] and s["id"] == r["id"]
            assert 3 <= s["prompt_token_ids"][0] < 256
    firsts = [[r["prompt_token_ids"][0] for r in v] for v in (requests, *salted)]
    assert all(a != b != c != a for a, b, c in zip(*firsts))
    assert requests[0]["prompt_token_ids"][0] != salted[0][0]["prompt_token_ids"][0]  # the input is not changed


def test_fixed_workload_and_peer_flags_parse():
    args = parse("--workload", "fixed", "--num-requests", "4", "--prompt-len", "16", "--output-len", "8",
                 "--compare", "hf,llamacpp", "--llamacpp-bin", "/opt/llama", "--gguf", "m.gguf",
                 "--llamacpp-threads", "1,2")
    assert (args.workload, args.num_requests, args.prompt_len, args.output_len) == ("fixed", 4, 16, 8)
    assert args.compare == ["hf", "llamacpp"] and args.llamacpp_threads == [1, 2]
    assert (args.llamacpp_bin, args.gguf) == ("/opt/llama", "m.gguf")
    assert parse("--compare", "LlamaCpp,hf,llamacpp").compare == ["llamacpp", "hf"]  # once each, in order
    assert parse("--compare", "hf").compare == ["hf"]
    assert parse("--prompt-len", "4,8", "--output-len", "2,2").prompt_len == (4, 8)  # ranges for the others
    defaults = parse()
    assert (defaults.compare, defaults.llamacpp_bin, defaults.gguf, defaults.llamacpp_threads) == (None,) * 4
    for argv in (["--compare", "sglang"], ["--compare", ","], ["--prompt-len", "0"], ["--output-len", "8,4"],
                 ["--prompt-len", "x"], ["--llamacpp-threads", "0"], ["--workload", "exact"]):
        with pytest.raises(SystemExit):
            parse(*argv)


def make_llamacpp_dir(tmp_path):
    folder = tmp_path / "llama.cpp-bin"
    folder.mkdir()
    binary = folder / "llama-batched-bench"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    return folder, gguf


def test_llamacpp_flags_are_checked_before_any_work(tmp_path, capsys):
    folder, gguf = make_llamacpp_dir(tmp_path)
    fixed = ["--workload", "fixed", "--prompt-len", "16", "--output-len", "8"]
    peer = ["--compare", "llamacpp", "--llamacpp-bin", str(folder), "--gguf", str(gguf)]
    cases = [
        (["--workload", "uniform", *peer], "--compare llamacpp needs --workload fixed"),
        ([*peer], "needs --workload fixed (llama-batched-bench runs N requests of exactly P prompt and G "
                  "generated tokens), not standard"),
        ([*fixed, "--mode", "online", "--rate", "2", *peer], "compares offline throughput"),
        ([*fixed, "--compare", "llamacpp", "--gguf", str(gguf)], "needs --llamacpp-bin DIR"),
        ([*fixed, "--compare", "llamacpp", "--llamacpp-bin", str(folder)], "and --gguf FILE"),
        ([*fixed, "--compare", "llamacpp", "--llamacpp-bin", str(tmp_path), "--gguf", str(gguf)],
         f"no llama-batched-bench at {tmp_path}/llama-batched-bench"),
        ([*fixed, "--compare", "llamacpp", "--llamacpp-bin", str(folder), "--gguf", str(tmp_path / "no.gguf")],
         "no such file"),
        ([*fixed, "--llamacpp-bin", str(folder)], "--llamacpp-bin applies to --compare llamacpp only"),
        ([*fixed, "--compare", "hf", "--gguf", str(gguf)], "--gguf applies to --compare llamacpp only"),
    ]
    for argv, message in cases:
        assert bench.run_bench(parse(*argv)) == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize("argv, message", [
    (["--workload", "fixed", "--prompt-len", "4,8", "--output-len", "8"],
     "--workload fixed needs --prompt-len as one integer (every request that exact length); it is a range (4,8)"),
    (["--workload", "fixed", "--prompt-len", "16"], "needs --output-len as one integer"),
    (["--workload", "uniform", "--prompt-len", "16"], "--prompt-len 16: one length is for --workload fixed"),
    (["--workload", "lognormal", "--output-len", "8"], "the lognormal workload takes LO,HI"),
    (["--mode", "online"], "needs --rate"),
    (["--compare-wait", "10,auto"], "online only"),
    (["--mode", "online", "--rate", "2", "--compare-wait", "10,auto", "--max-wait-ms", "5"], "leave out"),
    (["--rate", "2"], "online only"),
    (["--skip-engine"], "nothing to run"),
    (["--compare", "unquantized"], "--compare unquantized needs --quantization w8a8|w8a16 or --kv-cache-dtype"),
    (["--compare", "unspeculative"], "--compare unspeculative needs --speculative ngram"),
    (["--speculative", "draft"], "--speculative draft needs --draft-model"),
    (["--output-len", "4,8"], "fixed lengths"),
    (["--workload", "shared-prefix", "--prompt-len", "4,8"], "does not apply"),
    (["--num-prefixes", "4"], "apply to --workload shared-prefix only"),
    (["--mode", "online", "--rate", "2", "--shards", "2"], "--shards applies to --mode offline only"),
    (["--order", "input", "--compare", "input-order"], "--compare input-order needs --order prefix"),
    (["--prefix-cache-scope", "global", "--compare", "global-scope"],
     "--compare global-scope needs --prefix-cache-scope tenant"),
    (["--rounds", "2"], "--rounds applies to --mode offline with --compare unquantized"),
    (["--rounds", "2", "--compare", "hf"], "--rounds applies to --mode offline with --compare unquantized"),
    (["--rounds", "2", "--mode", "online", "--rate", "2", "--speculative", "ngram", "--compare", "unspeculative"],
     "--rounds applies to --mode offline"),
])
def test_inconsistent_flags_exit_2_before_any_work(argv, message, capsys):
    assert bench.run_bench(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    a = bench_online.poisson_arrivals(4000, 8.0, seed=3)
    assert a == bench_online.poisson_arrivals(4000, 8.0, seed=3) and a != bench_online.poisson_arrivals(4000, 8.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        bench_online.poisson_arrivals(3, 0.0, seed=0)


def test_table_lists_each_system():
    rows = [{"id": "a", "finish_reason": "length", "prompt_tokens": 3, "output_tokens": 4, "enqueued_at": 0.0,
             "started_at": 0.0, "first_token_at": 0.5, "finished_at": 2.0}]
    s = summarize(timings_from_rows(rows, {"a": 4}))
    text = bench_report.format_table([("mqinfer offline", s), ("hf-static@16", s)])
    lines = text.splitlines()
    assert lines[2].startswith("mqinfer offline") and " 2.0 " in lines[2]  # 4 tokens / 2 s
    assert lines[3].startswith("hf-static@16")


def test_plots_are_png_files(tmp_path):
    rows = [{"id": "a", "finish_reason": "length", "prompt_tokens": 3, "output_tokens": 4, "enqueued_at": 0.0,
             "started_at": 0.1, "first_token_at": 0.5, "finished_at": 2.0}]
    s = summarize(timings_from_rows(rows, {"a": 4}))
    points = [bench_online.OnlinePoint(1.0, s, 0.0), bench_online.OnlinePoint(2.0, s, 0.0)]
    paths = bench_report.write_plots(tmp_path / "plots", [("mqinfer offline", 100.0), ("hf-static@64", 40.0)], points)
    assert [p.name for p in paths] == ["throughput.png", "latency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_offline_bench_with_the_tiny_model_through_real_workers(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--num-requests", "8", "--workload", "uniform", "--prompt-len", "8,48",
                       "--output-len", "4,24", "--matrix-size", "128", "--out",
                       str(tmp_path / "out"), "--json", str(out_json), "--compare", "hf", "--hf-batch-sizes", "8",
                       "--hf-max-batch-tokens", "256", "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    # The bench asks for byte-level ids for tiny (its ids from 256 up are special tokens).
    requests = uniform_workload(8, prompt_len=(8, 48), output_len=(4, 24), vocab_size=256, seed=0)
    asked = sum(r["max_tokens"] for r in requests)
    ours = report["systems"]["mqinfer offline"]["summary"]
    assert ours["num_requests"] == 8 and ours["num_errors"] == 0
    assert ours["requested_tokens"] == asked == report["workload"]["output_tokens"]
    assert ours["throughput"] == pytest.approx(asked / ours["span_s"])
    per_request = {r["id"]: r for r in report["systems"]["mqinfer offline"]["requests"]}
    assert set(per_request) == {r["id"] for r in requests}
    for r in requests:
        row = per_request[r["id"]]
        assert row["output_tokens"] == r["max_tokens"]  # ignore_eos: every asked token is generated
        assert row["prompt_tokens"] == len(r["prompt_token_ids"])
        assert row["enqueued_at"] <= row["started_at"] <= row["first_token_at"] <= row["finished_at"]
    hf = report["systems"]["hf-static@8"]
    assert hf["requested_tokens"] == asked and report["hf_static_best"] == "hf-static@8"
    assert report["ratios"]["vs_hf_static_best"] == pytest.approx(ours["throughput"] / hf["throughput"])
    assert "hf-continuous" in report["systems"]
    # Greedy from the same weights: at least the first tokens agree with transformers.
    assert report["agreement_vs_hf_static"]["compared"] == 8
    assert report["agreement_vs_hf_static"]["first_token"] >= 0.75
    assert report["compute_ceiling_tok_s"] > 0
    # Overhead from the worker's own busy-time line: forward plus the rest add up to busy time.
    overhead = report["overhead"]
    # A worker stopped before its signal handler was installed (still importing, once the other
    # finished everything) leaves no summary.
    assert 1 <= overhead["workers"] <= report["workers"] and overhead["busy_s"] > 0
    assert sum(overhead["phases_s"].values()) == pytest.approx(overhead["busy_s"], rel=0.02)
    assert 0 < overhead["outside_forward_share"] < 1
    assert "of the workers' busy time" in captured.out
    # --workers auto (the default) starts what `mqinfer run` would.
    from mqinfer.layout import choose_layout

    workers, _, _ = choose_layout({"workers": "auto", "num_threads": None, "device": "cpu", "shards": 1,
                                   "model": "tiny"})
    assert report["workers"] == workers and "--workers auto: " in captured.err
    assert "mqinfer offline" in captured.out and "hf-static@8" in captured.out and "x" in captured.out
    assert (tmp_path / "out" / "results").is_dir()  # --out keeps the workers' datasets


def test_online_at_half_the_offline_throughput(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--mode", "online", "--rate", "half", "--num-requests", "8",
                       "--workload", "uniform", "--prompt-len", "8,48", "--output-len", "4,16",
                       "--max-wait-ms", "5", "--matrix-size", "128", "--json", str(out_json), "--idle-exit-s", "30",
                       "--workers", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    offline = report["systems"]["mqinfer offline"]["summary"]
    assert offline["num_requests"] == 8 and offline["num_errors"] == 0
    assert report["rate_half"]["offline_req_s"] == pytest.approx(8 / offline["span_s"])
    assert report["rate_half"]["rate"] == pytest.approx(8 / offline["span_s"] / 2, rel=0.005)
    [point] = report["online"]
    assert point["rate"] == report["rate_half"]["rate"] and point["max_wait_ms"] == 5.0
    s, b = point["summary"], point["budget"]
    assert s["num_requests"] == 8 and s["num_errors"] == 0
    assert b["ttft_p99_s"] == s["ttft"]["p99"] and b["step_s"] == s["tpot"]["p50"] and b["max_wait_s"] == 0.005
    assert b["budget_s"] == pytest.approx(0.005 + 3 * s["tpot"]["p50"]) and b["met"] == (b["ttft_p99_s"] <= b["budget_s"])
    assert f"online at {point['rate']:g} req/s" in captured.out
    assert f"p99 TTFT {b['ttft_p99_s'] * 1000:.1f} ms vs budget {b['budget_s'] * 1000:.1f} ms (max_wait 5 + 3 x step" \
        in captured.out


def test_online_bench_compares_wait_settings_at_one_rate(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    argv = ["--model", "tiny", "--mode", "online", "--rate", "40", "--compare-wait", "20,auto", "--num-requests", "6",
            "--workload", "lognormal", "--prompt-len", "8,64", "--output-len", "4,16", "--matrix-size", "128",
            "--json", str(out_json), "--idle-exit-s", "30", "--plot", str(plots), "--workers", "2",
            "--out", str(tmp_path / "out")]
    code = bench.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    assert report["compare_wait"] == [20.0, "auto"]
    points = {p["max_wait_ms"]: p for p in report["online"]}
    assert set(points) == {20.0, "auto"} and all(p["rate"] == 40.0 for p in points.values())
    assert points[20.0]["budget"]["max_wait_s"] == 0.02 and points["auto"]["budget"]["max_wait_s"] == 0.05
    for p in points.values():
        s = p["summary"]
        assert s["num_requests"] == 6 and s["num_errors"] == 0
        assert s["ttft"]["count"] == 6 and 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
        enq = sorted(r["enqueued_at"] for r in p["requests"])
        assert enq[-1] - enq[0] > 0.01  # arrivals were spread out, not submitted at once
    table = captured.out[captured.out.index("TTFT p50 ms"):].splitlines()
    rows = [line.split() for line in table[2:4]]
    assert rows[0][:3] == ["40", "20", "ms"] and rows[1][:2] == ["40", "auto"]
    assert float(rows[1][3]) == pytest.approx(points["auto"]["summary"]["ttft"]["p99"] * 1000, abs=0.05)
    assert "mqinfer @40 req/s wait auto" in captured.out and "mqinfer @40 req/s wait 20 ms" in captured.out
    assert (plots / "ttft-by-wait.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each setting's two workers each ran a warm-up request before the measured arrivals.
    rows = ds.dataset(tmp_path / "out" / "results", format="parquet", partitioning="hive").to_table(
        columns=["job_id", "worker"]).to_pylist()
    warmed = {r["worker"] for r in rows if r["job_id"].startswith("bench-warmup-")}
    assert len(warmed) == 4, warmed


def test_fixed_workload_beside_a_stand_in_llamacpp(tmp_path, capsys):
    from mqinfer.workers.engine.loader import TINY_HF_CONFIG
    from tests.loadgen.llamacpp_fakes import make_stand_in, tiny_llama_gguf

    folder = make_stand_in(tmp_path / "llama.cpp-bin")
    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf", TINY_HF_CONFIG)
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--workload", "fixed", "--num-requests", "4", "--prompt-len", "12",
                       "--output-len", "5", "--compare", "llamacpp", "--llamacpp-bin", str(folder), "--gguf",
                       str(gguf), "--llamacpp-threads", "1,2", "--matrix-size", "64", "--json", str(out_json),
                       "--idle-exit-s", "30", "--workers", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    per_request = report["systems"]["mqinfer offline"]["requests"]
    assert len(per_request) == 4
    assert all(r["prompt_tokens"] == 12 and r["output_tokens"] == 5 for r in per_request)  # exact lengths
    lc = report["llamacpp"]
    assert [r["threads"] for r in lc["runs"]] == [1, 2] and [r["s_tok_s"] for r in lc["runs"]] == [40.0, 80.0]
    assert lc["best_threads"] == 2 and (lc["num_requests"], lc["prompt_len"], lc["output_len"]) == (4, 12, 5)
    assert lc["gguf_shape"]["block_count"] == TINY_HF_CONFIG["num_hidden_layers"]
    span = report["systems"]["mqinfer offline"]["summary"]["span_s"]
    assert lc["mqinfer"]["tok_s"] == pytest.approx(4 * (12 + 5) / span)
    assert report["ratios"]["vs_llamacpp_best"] == pytest.approx(lc["mqinfer"]["tok_s"] / 80.0)
    assert f"mqinfer / llama.cpp (best: -t 2): {lc['mqinfer']['tok_s'] / 80.0:.2f}x" in captured.out
    rows = {line.split("  ")[0].strip(): line.split() for line in captured.out.splitlines()
            if line.startswith(("llama.cpp -t", "mqinfer offline  "))}
    assert rows["llama.cpp -t 2"][-1] == "80.00" and rows["llama.cpp -t 1"][-1] == "40.00"
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert [c["argv"][c["argv"].index("-t") + 1] for c in calls] == ["1", "2"]
    assert all(c["omp"] == "passive" and c["argv"][c["argv"].index("-c") + 1] == "68" for c in calls)
    # Both roofs, as least times, and every system's share of them.
    roofs = report["roofs"]
    from mqinfer.loadgen.bench_roofs import workload_bytes

    need = workload_bytes(TINY_HF_CONFIG, [{"prompt_token_ids": [0] * 12, "max_tokens": 5}] * 4, dtype="float32")
    assert roofs["bytes"]["total"] == need.total and roofs["bytes"]["steps"] == 5
    assert roofs["memory_s"] == pytest.approx(need.total / roofs["bandwidth"]["bytes_per_s"])
    assert roofs["bandwidth"]["bytes_per_s"] >= roofs["bandwidth_before"]["bytes_per_s"]
    assert set(roofs["shares"]) == {"mqinfer offline", "llama.cpp -t 1", "llama.cpp -t 2"}
    t_s = next(r["t_s"] for r in lc["runs"] if r["threads"] == 2)
    assert roofs["shares"]["llama.cpp -t 2"]["memory"] == pytest.approx(roofs["memory_s"] / t_s)
    assert roofs["shares"]["mqinfer offline"]["compute"] == pytest.approx(report["ceiling_share"]["mqinfer offline"])
    assert "of the memory roof" in captured.out and "roofs: compute" in captured.out


def test_int8_weights_and_kv_beside_the_unquantized_run(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--num-requests", "6", "--workload", "fixed", "--prompt-len", "16",
                       "--output-len", "8", "--matrix-size", "128", "--workers", "1", "--json", str(out_json),
                       "--quantization", "w8a8", "--kv-cache-dtype", "int8", "--compare", "unquantized",
                       "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    assert report["engine_flags"]["quantization"] == "w8a8" and report["engine_flags"]["kv_cache_dtype"] == "int8"
    ours = report["systems"]["mqinfer offline"]["summary"]
    plain = report["systems"]["mqinfer offline, unquantized"]["summary"]
    assert ours["num_errors"] == plain["num_errors"] == 0 and plain["num_requests"] == 6
    assert report["ratios"]["vs_unquantized"] == pytest.approx(ours["throughput"] / plain["throughput"])
    assert report["agreement_vs_unquantized"]["compared"] == 6
    assert "--quantization w8a8 --kv-cache-dtype int8 / unquantized: " in captured.out



def test_shared_prefix_job_routed_over_two_shards_beside_input_order(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--workload", "shared-prefix", "--num-requests", "24", "--num-prefixes", "3",
                       "--prefix-len", "64,96", "--output-len", "2,4", "--matrix-size", "128", "--workers", "2",
                       "--num-threads", "1", "--shards", "2", "--compare", "input-order", "--json", str(out_json),
                       "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    routed, plain = report["prefix_cache"], report["systems"]["mqinfer offline, input order"]["prefix_cache"]
    for r in (routed, plain):
        assert 0 < r["hit_tokens"] <= r["ideal_per_worker"] <= r["ideal_once"]
        assert sum(r["requests_per_worker"]) == 24
    # Routing keeps a prefix's requests on one worker; spread by id, each worker computes most prefixes.
    assert routed["ideal_per_worker"] > plain["ideal_per_worker"]
    assert report["routing"]["routed"] == 24 and report["order"] == "prefix"
    ours, other = (report["systems"][k]["summary"] for k in ("mqinfer offline", "mqinfer offline, input order"))
    assert report["ratios"]["vs_input_order"] == pytest.approx(ours["throughput"] / other["throughput"])
    assert report["agreement_vs_input_order"]["identical"] == 1.0
    assert "mqinfer / the same with --order input --route id: " in captured.out


def test_speculation_beside_the_unspeculative_run_in_rounds_that_alternate_which_runs_first(tmp_path, capsys):
    # One bench of two rounds: round 1 is the table's pair, which the speculation checks read;
    # round 2 runs the variant first, and the rounds' figures and median are checked after them.
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--num-requests", "4", "--workload", "fixed", "--prompt-len", "16",
                       "--output-len", "24", "--matrix-size", "128", "--workers", "1", "--json", str(out_json),
                       "--dtype", "float32", "--speculative", "ngram", "--compare", "unspeculative",
                       "--rounds", "2", "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    assert report["engine_flags"]["speculative"] == "ngram"
    ours = report["systems"]["mqinfer offline"]["summary"]
    plain = report["systems"]["mqinfer offline, unspeculative"]["summary"]
    assert ours["num_errors"] == plain["num_errors"] == 0 and plain["num_requests"] == 4
    assert report["ratios"]["vs_unspeculative"] == pytest.approx(ours["throughput"] / plain["throughput"])
    # Greedy float32: speculation changes no token.
    assert report["agreement_vs_unspeculative"]["compared"] == 4
    assert report["agreement_vs_unspeculative"]["identical"] == 1.0
    assert "--speculative ngram / unspeculative: " in captured.out
    # The workers' speculation totals, summed from their exit summaries.
    spec = report["speculation"]
    assert spec["proposer"] == "ngram" and spec["workers"] == 1 and spec["steps"] > 0
    assert spec["proposed_tokens"] >= spec["accepted_tokens"] >= 0
    assert "speculation (ngram): " in captured.out

    rounds = report["rounds"]["unspeculative"]
    assert rounds["order"] == ["mqinfer first", "unspeculative first"]
    assert len(rounds["mqinfer_tok_s"]) == len(rounds["variant_tok_s"]) == 2
    # Round 1 is the table's pair; every ratio is its round's pair, and the median is theirs.
    ours = report["systems"]["mqinfer offline"]["summary"]["throughput"]
    plain = report["systems"]["mqinfer offline, unspeculative"]["summary"]["throughput"]
    assert (rounds["mqinfer_tok_s"][0], rounds["variant_tok_s"][0]) == (ours, plain)
    assert rounds["ratios"] == pytest.approx([a / b for a, b in zip(rounds["mqinfer_tok_s"], rounds["variant_tok_s"])])
    assert rounds["median_ratio"] == pytest.approx(sum(rounds["ratios"]) / 2)
    assert report["ratios"]["vs_unspeculative_median"] == rounds["median_ratio"]
    # Round 2 ran the variant first.
    lines = [line for line in captured.err.splitlines() if "round 2 of 2: " in line]
    assert [line.split("round 2 of 2: ")[1] for line in lines] == ["unspeculative", "mqinfer"]
    assert "mqinfer / unspeculative over 2 rounds (alternating which ran first): " in captured.out


def test_other_layout_reruns_with_one_worker_of_every_thread(tmp_path, capsys):
    from mqinfer.loadgen.bench import other_layout

    assert other_layout(argparse.Namespace(workers=2, num_threads=1)) == {"workers": 1, "num_threads": 2}
    assert other_layout(argparse.Namespace(workers=1, num_threads=4)) == {"workers": 4, "num_threads": 1}
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--num-requests", "4", "--workload", "fixed", "--prompt-len", "8",
                       "--output-len", "6", "--matrix-size", "128", "--workers", "2", "--num-threads", "1",
                       "--json", str(out_json), "--compare", "other-layout", "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    other = report["systems"]["mqinfer offline, other layout"]
    assert (other["workers"], other["num_threads"]) == (1, 2) and other["summary"]["num_errors"] == 0
    assert "mqinfer again with --workers 1 --num-threads 2" in captured.err
    ours = report["systems"]["mqinfer offline"]["summary"]["throughput"]
    assert report["ratios"]["vs_other_layout"] == pytest.approx(ours / other["summary"]["throughput"])
    assert "/ the other layout (1 x 2): " in captured.out
    assert bench.run_bench(parse("--compare", "other-layout", "--mode", "online", "--rate", "2")) == 2
    assert "compares CPU layouts offline" in capsys.readouterr().err


def test_a_shared_prefix_job_finds_the_same_prefixes_under_both_cache_scopes(tmp_path, capsys):
    """The bench's requests are one tenant's: the default scope keeps every prefix hit of global."""
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--workload", "shared-prefix", "--num-requests", "16", "--num-prefixes", "2",
                       "--prefix-len", "64,96", "--output-len", "2,4", "--matrix-size", "128", "--workers", "1",
                       "--num-threads", "1", "--compare", "global-scope", "--json", str(out_json),
                       "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    assert report["engine_flags"]["prefix_cache_scope"] == "tenant"
    scoped, shared = report["prefix_cache"], report["systems"]["mqinfer offline, global scope"]["prefix_cache"]
    assert scoped["hit_tokens"] == shared["hit_tokens"] > 0
    assert report["agreement_vs_global_scope"]["identical"] == 1.0
    ours, other = (report["systems"][k]["summary"] for k in ("mqinfer offline", "mqinfer offline, global scope"))
    assert report["ratios"]["vs_global_scope"] == pytest.approx(ours["throughput"] / other["throughput"])
    assert "mqinfer --prefix-cache-scope tenant / global: " in captured.out
    assert "--prefix-cache-scope global: " in captured.out


class _SecondWorkerLate(bench_pool.WorkerPool):
    """Real workers, the second started a few seconds after the first (as on a busy machine,
    where one process imports and loads more slowly than another)."""

    def start(self) -> None:
        self.start_one(0)
        time.sleep(3.0)
        self.start_one(1)


def test_an_offline_backlog_is_split_between_workers_when_one_starts_late(tmp_path):
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    args = parse("--model", "tiny", "--workers", "2", "--num-threads", "1", "--idle-exit-s", "30",
                 "--max-batch", "8")
    # Outputs long enough that the first worker is still on its half when the second is ready.
    requests = uniform_workload(32, prompt_len=(8, 16), output_len=(128, 160), vocab_size=256, seed=0)
    out = tmp_path / "out"
    server = EmbeddedServer(tmp_path / "redis", unix_socket=True, appendonly=False).start()
    try:
        producer = Producer(server.url, stream=bench_pool.STREAM)
        pool = _SecondWorkerLate(bench_pool.worker_argv(args, "tiny", server.url, out), 2, tmp_path / "logs", out)
        timings, _ = bench_offline.run_offline(args, requests, producer, pool, out, "split-job")
    finally:
        server.stop()
    assert len(timings) == 32 and all(t.ok for t in timings)
    per_worker = Counter(ds.dataset(out / "results", format="parquet").to_table().column("worker").to_pylist())
    # Submitted only once both had joined their group: the one ready first takes its share, not
    # the whole backlog while the other loads.
    assert set(per_worker) == set(pool.consumers) and min(per_worker.values()) >= 8, per_worker
