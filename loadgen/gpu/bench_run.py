"""The phases of ``gpu_bench`` (see ``loadgen/gpu/bench.py``) and its summary.

Each phase is one function of (the arguments, a model's ``ModelSpec``, its requests) returning
a dict of figures; ``run_all`` runs them in order within the budget, model by model, and prints
the summary at the end, however far it got. The pipeline runs go through ``bench_engine.run_engine``
(what ``mqinfer bench`` runs: an embedded server, the client, ``mqinfer worker`` processes, the
results Parquet), transformers through ``hf_baseline``, the decode steps through
``gpu_bench_roofs``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mqinfer.loadgen.gpu.bench_phases import (
    GOAL_DECODE_B1_SHARE,
    GOAL_OVER_ROOF,
    GOAL_VS_STATIC,
    Budget,
    Report,
    default_workdir,
    header,
    log,
    run_gpu_check,
    timed_phase,
)


def prepare_model(name: str, workdir: Path):
    """The ``ModelSpec`` of ``name``: a shape's random checkpoint (written once into ``workdir``,
    no GGUF), ``tiny``, or a checkpoint folder."""
    from mqinfer.loadgen.bench_model import resolve_model
    from mqinfer.loadgen.checkpoint import SHAPES, make_llama_checkpoint, make_standard_checkpoint

    if name == "standard":
        return resolve_model(str(make_standard_checkpoint(workdir / name)))
    if name in SHAPES:
        log(f"{name}: random-weight checkpoint in {workdir / name} (written once, then reused)")
        return resolve_model(str(make_llama_checkpoint(workdir / name, seed=0, **SHAPES[name])))
    return resolve_model(name)


def bench_args(args: argparse.Namespace, spec, dtype: str, timeout_s: float, extra: list[str] | None = None
               ) -> argparse.Namespace:
    """The arguments ``mqinfer bench`` would have for one pipeline run: one worker on the device,
    the workers' own engine defaults."""
    from mqinfer.loadgen.bench_options import add_bench_arguments

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    bench = parser.parse_args(["--model", spec.arg, "--device", args.device, "--dtype", dtype, "--workers", "1",
                               "--seed", str(args.seed), "--timeout-s", f"{max(1.0, timeout_s):.0f}",
                               "--idle-exit-s", "60", *(extra or [])])
    bench.workers, bench.num_threads = 1, None
    return bench


def phase_pipeline(args: argparse.Namespace, spec, requests: list[dict[str, Any]], dtype: str, budget: Budget,
                   scratch: Path) -> dict[str, Any]:
    """The standard workload offline through the whole pipeline."""
    from mqinfer.loadgen.bench_engine import run_engine

    run = run_engine(bench_args(args, spec, dtype, budget.left()), spec, requests, scratch / "offline")
    s = run.offline
    log(f"mqinfer offline: {s.throughput:.1f} tok/s over {s.span_s:.2f}s, {s.num_errors} errors")
    if s.num_errors:
        raise RuntimeError(f"{s.num_errors} of {s.num_requests} requests failed in the pipeline")
    return {"summary": s.to_dict(), "throughput": s.throughput, "overhead": run.overhead}


def phase_transformers(args: argparse.Namespace, spec, requests: list[dict[str, Any]], dtype: str,
                       budget: Budget, scratch: Path) -> dict[str, Any]:
    """transformers on the same device: static batching at each batch size (those the budget
    leaves time for), then its continuous batching where this transformers has it."""
    from mqinfer.loadgen import hf_baseline
    from mqinfer.loadgen.bench_model import hf_folder

    model = hf_baseline.load_hf_model(hf_folder(spec, scratch), dtype=dtype, device=args.device)
    try:
        hf_baseline.warm_up(model, requests)
        static: dict[str, Any] = {}
        best = None
        for batch_size in args.hf_batch_sizes:
            if budget.spent():
                static[str(batch_size)] = {"status": "skipped: time budget spent"}
                continue
            r = hf_baseline.run_static(model, requests, batch_size, progress=None)
            static[str(batch_size)] = r.to_dict()
            log(f"transformers static @{batch_size}: {r.throughput:.1f} tok/s")
            if best is None or r.throughput > best.throughput:
                best = r
        out: dict[str, Any] = {"static": static, "static_best_batch": best.batch_size if best else None,
                               "static_best_throughput": best.throughput if best else None}
        why = hf_baseline.continuous_batching_available(model)
        if why:
            out["continuous"] = {"status": f"not available: {why}"}
        elif budget.spent():
            out["continuous"] = {"status": "skipped: time budget spent"}
        else:
            try:
                c = hf_baseline.run_continuous(model, requests, progress=None, timeout_s=max(1.0, budget.left()))
                out["continuous"] = {"status": "ok", **c.to_dict()}
                out["continuous_throughput"] = c.throughput
                log(f"transformers continuous batching: {c.throughput:.1f} tok/s")
            except (RuntimeError, TimeoutError, ValueError) as exc:
                out["continuous"] = {"status": f"error: {exc}"}
                log(f"transformers continuous batching failed: {exc}")
        return out
    finally:
        del model


def phase_roofs(args: argparse.Namespace, spec, dtype: str, bandwidth) -> dict[str, Any]:
    """A decode step at batch 1 and at ``--roof-batch``, each against its memory roof."""
    from mqinfer.loadgen.gpu.bench_roofs import build_engine, decode_roof, decode_step_seconds

    steps, context = args.roof_steps, args.roof_context
    # The timed steps read the prompt and the tokens generated so far: counted at the middle step.
    read_context = context + 2 + steps // 2
    engine = build_engine(spec.arg, args.device, dtype, max(1, args.roof_batch), context + steps + 16)
    try:
        out: dict[str, Any] = {}
        for key, batch in (("batch_1", 1), ("batch_n", args.roof_batch)):
            step_s = decode_step_seconds(engine, batch, context, steps)
            roof = decode_roof(spec.config, dtype, batch, read_context, step_s, bandwidth)
            out[key] = asdict(roof)
            log(f"decode step at batch {batch}, {read_context} tokens of context: {step_s * 1e3:.3f} ms, "
                f"roof {roof.roof_s * 1e3:.3f} ms ({roof.over_roof:.2f}x the roof, "
                f"{roof.bandwidth_share:.0%} of the bandwidth)")
        return out
    finally:
        engine.close()
        del engine


def phase_online(args: argparse.Namespace, spec, requests: list[dict[str, Any]], dtype: str, budget: Budget,
                 scratch: Path, offline: dict[str, Any]) -> dict[str, Any]:
    """TTFT and TPOT through the pipeline at ``--online-rates`` of the offline run's request rate."""
    from mqinfer.loadgen.bench_engine import run_engine

    summary = offline["summary"]
    # Requests finished without error per second of the offline run (bench_online.request_rate).
    done = summary["num_requests"] - summary["num_errors"]
    offline_rate = done / summary["span_s"] if done > 0 and summary["span_s"] > 0 else 0.0
    if offline_rate <= 0:
        raise RuntimeError("the offline run finished no request, so there is no rate to take fractions of")
    rates = [round(f * offline_rate, 6) for f in args.online_rates]
    subset = requests[: args.online_requests]
    bench = bench_args(args, spec, dtype, budget.left(),
                       ["--mode", "online", "--rate", ",".join(f"{r:g}" for r in rates)])
    run = run_engine(bench, spec, subset, scratch / "online")
    points = []
    for fraction, p in zip(args.online_rates, run.online):
        s = p.summary
        points.append({"fraction": fraction, "rate": p.rate, "summary": s.to_dict(),
                       "ttft_p50_s": s.ttft.p50 if s.ttft else None, "ttft_p99_s": s.ttft.p99 if s.ttft else None,
                       "tpot_p50_s": s.tpot.p50 if s.tpot else None, "tpot_p99_s": s.tpot.p99 if s.tpot else None})
        log(f"online at {p.rate:.3g} req/s ({fraction:g} of offline): TTFT p50 {_ms(points[-1]['ttft_p50_s'])}, "
            f"p99 {_ms(points[-1]['ttft_p99_s'])}; TPOT p50 {_ms(points[-1]['tpot_p50_s'])}")
    return {"offline_rate": offline_rate, "requests": len(subset), "points": points}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def run_all(args: argparse.Namespace, dtype: str, budget: Budget) -> int:
    """Every phase, model by model, within ``budget``; the summary; the exit status."""
    from mqinfer.loadgen.gpu.bench_roofs import device_bandwidth
    from mqinfer.loadgen.workload import make_workload

    workdir = Path(args.workdir) if args.workdir else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(args.json, header(args, dtype))
    errors: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-gpu-bench-"))
    try:
        if args.skip_gpu_check:
            report.body["gpu_check"] = {"status": "not run (--skip-gpu-check)"}
        else:
            report.body["gpu_check"] = check = run_gpu_check(args, budget, scratch)
            if check["status"] != "ok":
                errors.append(f"gpu_check: {check['status']}")
        report.save()
        log(f"measuring the memory bandwidth of {args.device}")
        bandwidth = device_bandwidth(args.device)
        report.body["bandwidth"] = asdict(bandwidth)
        report.save()
        log(f"bandwidth: {bandwidth.bytes_per_s / 1e9:.1f} GB/s ({bandwidth.method})")
        for name in args.models:
            if budget.spent():
                report.phase(name, "status", "skipped: time budget spent")
                continue
            spec = prepare_model(name, workdir)
            requests = make_workload("standard", n=args.num_requests, seed=args.seed, vocab_size=spec.vocab_size,
                                     max_model_len=spec.max_model_len, min_token_id=spec.min_token_id)
            report.phase(name, "model", {"arg": spec.arg, "config": spec.config})
            offline = timed_phase(report, name, "pipeline", budget,
                                  lambda: phase_pipeline(args, spec, requests, dtype, budget, scratch / name), errors)
            timed_phase(report, name, "transformers", budget,
                        lambda: phase_transformers(args, spec, requests, dtype, budget, scratch / name), errors)
            timed_phase(report, name, "decode_roofs", budget,
                        lambda: phase_roofs(args, spec, dtype, bandwidth), errors)
            if offline is not None:
                timed_phase(report, name, "online", budget,
                            lambda: phase_online(args, spec, requests, dtype, budget, scratch / name, offline),
                            errors)
            else:
                report.phase(name, "online", {"status": "not run: no offline run to take rates from"})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        report.body["finished"] = True
        report.body["budget_left_s"] = budget.left()
        report.body["summary"] = summary_rows(report.body)
        report.save()
        print_summary(report.body, budget)
    if errors:
        print("gpu_bench: FAILED: " + "; ".join(errors), file=sys.stderr)
        return 1
    return 0


def summary_rows(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per model: the throughputs, their ratios and the goals each figure meets (None where a
    figure is missing)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, phases in body["models"].items():
        if not isinstance(phases, dict):
            continue
        ours = _figure(phases, "pipeline", "throughput")
        static = _figure(phases, "transformers", "static_best_throughput")
        continuous = _figure(phases, "transformers", "continuous_throughput")
        roofs = phases.get("decode_roofs") or {}
        b1, bn = roofs.get("batch_1"), roofs.get("batch_n")
        row: dict[str, Any] = {
            "mqinfer_tok_s": ours, "hf_static_best_tok_s": static, "hf_continuous_tok_s": continuous,
            "vs_hf_static": ours / static if ours and static else None,
            "vs_hf_continuous": ours / continuous if ours and continuous else None,
            "decode_b1_bandwidth_share": b1["bandwidth_share"] if b1 else None,
            "decode_bn_over_roof": bn["over_roof"] if bn else None, "decode_bn_batch": bn["batch"] if bn else None,
        }
        row["goals"] = {
            f"{GOAL_VS_STATIC:g}x hf static": _met(row["vs_hf_static"], lambda v: v >= GOAL_VS_STATIC),
            "ahead of hf continuous": _met(row["vs_hf_continuous"], lambda v: v > 1.0),
            f"batch 1 >= {GOAL_DECODE_B1_SHARE:.0%} of bandwidth": _met(row["decode_b1_bandwidth_share"],
                                                                         lambda v: v >= GOAL_DECODE_B1_SHARE),
            f"batch-N step <= {GOAL_OVER_ROOF:g}x roof": _met(row["decode_bn_over_roof"], lambda v: v <= GOAL_OVER_ROOF),
        }
        rows[name] = row
    return rows


def _figure(phases: dict[str, Any], phase: str, key: str) -> float | None:
    entry = phases.get(phase)
    if not isinstance(entry, dict) or entry.get("status") != "ok":
        return None
    value = entry.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _met(value: float | None, test) -> bool | None:
    return None if value is None else bool(test(value))


def print_summary(body: dict[str, Any], budget: Budget) -> None:
    """The figures and the goals, per model, on stdout."""
    env = body.get("environment") or {}
    where = ", ".join(env.get("gpus") or []) or env.get("cpu") or "?"
    print(f"\ngpu_bench on {env.get('device')} ({where}), {body.get('dtype')}, torch {env.get('torch')}, "
          f"{body.get('date_utc')} UTC")
    check = body.get("gpu_check") or {}
    print(f"gpu_check: {check.get('status', 'not run')}")
    bw = body.get("bandwidth")
    print(f"bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['method']})" if bw else "bandwidth: not measured")

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for name, row in body.get("summary", {}).items():
        print(f"\n{name}:")
        print(f"  tokens/s  mqinfer {fmt(row['mqinfer_tok_s'], '.1f')}  hf static (best) "
              f"{fmt(row['hf_static_best_tok_s'], '.1f')}  hf continuous {fmt(row['hf_continuous_tok_s'], '.1f')}")
        print(f"  ratios    vs hf static {fmt(row['vs_hf_static'], '.2f')}x  vs hf continuous "
              f"{fmt(row['vs_hf_continuous'], '.2f')}x")
        print(f"  decode    batch 1 at {fmt(row['decode_b1_bandwidth_share'], '.1%')} of the bandwidth; batch "
              f"{row['decode_bn_batch'] or '-'} step {fmt(row['decode_bn_over_roof'], '.2f')}x its roof")
        online = (body["models"].get(name) or {}).get("online") or {}
        for p in online.get("points") or []:
            print(f"  online    {p['rate']:.3g} req/s ({p['fraction']:g} of offline): TTFT p50 {_ms(p['ttft_p50_s'])} "
                  f"p99 {_ms(p['ttft_p99_s'])}, TPOT p50 {_ms(p['tpot_p50_s'])} p99 {_ms(p['tpot_p99_s'])}")
        skipped = [k for k, v in (body["models"].get(name) or {}).items()
                   if isinstance(v, dict) and str(v.get("status", "")).startswith(("skipped", "error", "not run"))]
        if skipped:
            print(f"  not measured: {', '.join(skipped)}")
        goals = ", ".join(f"{g}: {'met' if m else 'NOT met' if m is False else 'n/a'}" for g, m in row["goals"].items())
        print(f"  goals     {goals}")
    print(f"\n{'budget spent' if budget.spent() else f'{budget.left():.0f}s of the budget left'}; "
          f"figures in {body.get('settings', {}).get('json') or 'the JSON file'}")
