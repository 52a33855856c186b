"""`mqinfer bench`: flags, arrivals, report pieces, and small runs through real worker processes."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from mqinfer.loadgen import bench
from mqinfer.loadgen.metrics import summarize, timings_from_rows
from mqinfer.loadgen.workload import uniform_workload


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def worker_available() -> str | None:
    try:
        import mqinfer.workers.worker  # noqa: F401
    except ImportError as exc:
        return f"the worker is not built yet: {exc}"
    return None


needs_worker = pytest.mark.skipif(worker_available() is not None, reason=str(worker_available()))


def test_defaults_and_pass_through_flags():
    args = parse()
    assert (args.workload, args.num_requests, args.seed, args.mode, args.workers) == ("standard", 256, 0, "offline", 1)
    assert args.hf_batch_sizes == [16, 64, 256] and args.dtype == "bfloat16" and args.model is None
    args = parse("--max-num-seqs", "32", "--block-size", "8", "--max-wait-ms", "2.5", "--dtype", "float32",
                 "--rate", "1,2.5", "--hf-batch-sizes", "8,32")
    assert args.rate == [1.0, 2.5] and args.hf_batch_sizes == [8, 32]
    argv = bench.worker_argv(args, "tiny", "unix://:pw@/tmp/s.sock", bench.Path("/tmp/out"))
    assert argv[1:4] == ["-m", "mqinfer", "worker"]
    pairs = dict(zip(argv[4::2], argv[5::2]))
    assert pairs["--max-num-seqs"] == "32" and pairs["--block-size"] == "8" and pairs["--max-wait-ms"] == "2.5"
    assert pairs["--dtype"] == "float32" and pairs["--model"] == "tiny" and pairs["--stream"] == bench.STREAM
    assert "--num-kv-blocks" not in pairs  # unset flags keep the worker's defaults
    with pytest.raises(SystemExit):
        parse("--rate", "0")
    with pytest.raises(SystemExit):
        parse("--hf-batch-sizes", "16,x")


@pytest.mark.parametrize("argv, message", [
    (["--mode", "online"], "needs --rate"),
    (["--rate", "2"], "online only"),
    (["--skip-engine"], "nothing to run"),
    (["--output-len", "4,8"], "fixed lengths"),
    (["--workload", "shared-prefix", "--prompt-len", "4,8"], "does not apply"),
])
def test_inconsistent_flags_exit_2_before_any_work(argv, message, capsys):
    assert bench.run_bench(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    a = bench.poisson_arrivals(4000, 8.0, seed=3)
    assert a == bench.poisson_arrivals(4000, 8.0, seed=3) and a != bench.poisson_arrivals(4000, 8.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        bench.poisson_arrivals(3, 0.0, seed=0)


def test_table_lists_each_system():
    rows = [{"id": "a", "finish_reason": "length", "prompt_tokens": 3, "output_tokens": 4, "enqueued_at": 0.0,
             "started_at": 0.0, "first_token_at": 0.5, "finished_at": 2.0}]
    s = summarize(timings_from_rows(rows, {"a": 4}))
    text = bench.format_table([("mqinfer offline", s), ("hf-static@16", s)])
    lines = text.splitlines()
    assert lines[2].startswith("mqinfer offline") and " 2.0 " in lines[2]  # 4 tokens / 2 s
    assert lines[3].startswith("hf-static@16")


def test_plots_are_png_files(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install matplotlib)")
    rows = [{"id": "a", "finish_reason": "length", "prompt_tokens": 3, "output_tokens": 4, "enqueued_at": 0.0,
             "started_at": 0.1, "first_token_at": 0.5, "finished_at": 2.0}]
    s = summarize(timings_from_rows(rows, {"a": 4}))
    points = [bench.OnlinePoint(1.0, s, 0.0), bench.OnlinePoint(2.0, s, 0.0)]
    paths = bench.write_plots(tmp_path / "plots", [("mqinfer offline", 100.0), ("hf-static@64", 40.0)], points)
    assert [p.name for p in paths] == ["throughput.png", "latency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@needs_worker
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
    assert "mqinfer offline" in captured.out and "hf-static@8" in captured.out and "x" in captured.out
    assert (tmp_path / "out" / "results").is_dir()  # --out keeps the workers' datasets


@needs_worker
def test_online_bench_with_the_tiny_model(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = bench.main(["--model", "tiny", "--mode", "online", "--rate", "40", "--num-requests", "6",
                       "--workload", "lognormal", "--prompt-len", "8,64", "--output-len", "4,16",
                       "--matrix-size", "128", "--json", str(out_json),
                       "--idle-exit-s", "30"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    [point] = report["online"]
    s = point["summary"]
    assert point["rate"] == 40.0 and s["num_requests"] == 6 and s["num_errors"] == 0
    assert s["ttft"]["count"] == 6 and 0 < s["ttft"]["p50"] <= s["ttft"]["p99"] <= s["e2e"]["p99"]
    enq = sorted(r["enqueued_at"] for r in point["requests"])
    assert enq[-1] - enq[0] > 0.01  # arrivals were spread out, not submitted at once
    assert "mqinfer @40 req/s" in captured.out
