"""Interactive requests beside a bulk backlog on the same worker, measured through the real pipeline.

Runs an embedded server and ``mqinfer worker`` processes (``bench_pool``). Three runs on the same
workers, each with prompts of its own (nothing is a prefix-cache hit from an earlier run):

1. **bulk alone**: ``--bulk-requests`` requests without targets, all at once (first, so that no
   interactive request has been seen and its steps are those of a worker without targets);
2. **mixed**: the bulk requests again, all at once, and ``--mixed-delay-s`` later interactive
   requests with latency targets (``--slo-ttft-ms``, ``--slo-tpot-ms``) arriving as a Poisson
   process at ``--interactive-rate`` (second, so that, as after the first run, the backlog starts
   on a worker that has seen no interactive request lately and runs as without targets until the
   first one arrives);
3. **interactive alone**: interactive requests again, at the same rate.

Reported, as a table on stdout and with ``--json FILE`` as JSON: the interactive requests' TTFT and
TPOT (from their result rows: ``first_token_at - enqueued_at``, and the mean gap between their
tokens) at p50 / p99, alone and mixed, with the mixed over alone ratios, and how many met both
targets; and the total throughput
(output tokens per second from the run's first arrival to its last row) of the bulk run and of the
mixed run, with their ratio. ``--no-targets`` sends the interactive requests without targets, so
that they are scheduled as bulk: the comparison without step plans. ``--compare vllm --vllm-python
PATH`` runs the same three runs (the same requests at the same arrival times) through vLLM's CPU
build in its own environment (loadgen/vllm_mixed.py), with ``scheduling_policy="priority"`` and the
interactive requests at the higher priority, and reports its figures and ours over its.

A chat-like tenant beside a 600-request backlog is ``--interactive-requests 30 --interactive-rate 3 --interactive-prompt-len 64
--interactive-output-len 32 --bulk-requests 600 --bulk-prompt-len 128 --bulk-output-len 64``; the
defaults are a smaller one for a quick check. Take figures on a quiet machine.

``python -m mqinfer.loadgen.mixed_bench --help``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_model import ModelSpec, resolve_model
from mqinfer.loadgen.bench_online import poisson_arrivals, unshared_prompts
from mqinfer.loadgen.bench_options import add_worker_engine_options, positive_int, run_scenario
from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, read_results, wait_done, worker_argv
from mqinfer.loadgen.metrics import RequestTiming, percentiles
from mqinfer.loadgen.tenants_bench import positive_float, submit_all
from mqinfer.loadgen.workload import fit_to_context, uniform_workload

INTERACTIVE, BULK = "interactive", "bulk"
VLLM = "vllm"  # --compare: vLLM's CPU build with priority scheduling on the same requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.mixed_bench",
        description="Interactive requests with latency targets alone, a bulk backlog alone, and both together "
                    "on the same workers: interactive p99 TTFT and TPOT and total throughput, through the real "
                    "pipeline.")
    g = p.add_argument_group("workload")
    g.add_argument("--model", default=None, metavar="M",
                   help="`tiny`, a shape name, a checkpoint folder, or a .gguf file (default: the standard "
                        "benchmark checkpoint).")
    g.add_argument("--interactive-requests", type=positive_int, default=10, metavar="N",
                   help="Interactive requests in each run that has them (default: 10).")
    g.add_argument("--interactive-rate", type=positive_float, default=3.0, metavar="R",
                   help="Their arrivals per second, a Poisson process (default: 3).")
    g.add_argument("--interactive-prompt-len", type=positive_int, default=64, metavar="T",
                   help="Their prompt tokens (default: 64).")
    g.add_argument("--interactive-output-len", type=positive_int, default=32, metavar="T",
                   help="Their output tokens (default: 32).")
    g.add_argument("--slo-ttft-ms", type=positive_int, default=500, metavar="MS",
                   help="Their time-to-first-token target (default: 500).")
    g.add_argument("--slo-tpot-ms", type=positive_int, default=50, metavar="MS",
                   help="Their time-per-output-token target (default: 50).")
    g.add_argument("--no-targets", action="store_true",
                   help="Send the interactive requests without targets (scheduled as bulk: no step plans).")
    g.add_argument("--bulk-requests", type=positive_int, default=60, metavar="N",
                   help="Bulk requests in each run that has them, all submitted at once (default: 60).")
    g.add_argument("--bulk-prompt-len", type=positive_int, default=128, metavar="T",
                   help="Their prompt tokens (default: 128).")
    g.add_argument("--bulk-output-len", type=positive_int, default=64, metavar="T",
                   help="Their output tokens (default: 64).")
    g.add_argument("--mixed-delay-s", type=float, default=1.0, metavar="S",
                   help="In the mixed run, the first interactive request arrives this long after the bulk "
                        "requests (default: 1).")
    g.add_argument("--seed", type=int, default=0, help="Workload and arrival seed (default: 0).")

    g = p.add_argument_group("run")
    g.add_argument("--workers", type=positive_int, default=1, metavar="N", help="Worker processes (default: 1).")
    g.add_argument("--out", default=None, metavar="DIR", help="Keep the workers' output here (default: a temp dir).")
    g.add_argument("--timeout-s", type=float, default=3600.0, metavar="S", help="Give up on a run after this long.")
    g.add_argument("--idle-exit-s", type=float, default=600.0, metavar="S",
                   help="Workers exit after this long with nothing to do (default: 600).")
    g.add_argument("--json", default=None, metavar="FILE", help="Write every figure as JSON.")
    g.add_argument("--compare", default=None, choices=(VLLM,),
                   help="Also run the same three runs (the same requests and arrival times) through vLLM's CPU "
                        "build with scheduling_policy=priority, the interactive requests at the higher priority "
                        "(needs --vllm-python and a checkpoint folder as --model).")
    g.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="For --compare vllm: the python of an environment with vLLM's CPU build "
                        "(docs/benchmarking.md says how to make one).")

    add_worker_engine_options(p)
    return p


def workloads(spec: ModelSpec, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Each run's requests: ``interactive`` and ``bulk`` alone, ``mixed_interactive`` and
    ``mixed_bulk`` (the same lengths, prompts salted so that no run shares a cached block)."""
    def make(kind: str, n: int, prompt: int, output: int, seed: int) -> list[dict[str, Any]]:
        reqs = uniform_workload(n, prompt_len=(prompt, prompt), output_len=(output, output),
                                vocab_size=spec.vocab_size, seed=seed, id_prefix=kind,
                                min_token_id=spec.min_token_id)
        extra: dict[str, Any] = {"tenant": kind, "temperature": 0.0, "ignore_eos": True}
        if kind == INTERACTIVE and not args.no_targets:
            extra.update(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
        return [{**fit_to_context(r, spec.max_model_len), **extra} for r in reqs]

    interactive = make(INTERACTIVE, args.interactive_requests, args.interactive_prompt_len,
                       args.interactive_output_len, args.seed)
    bulk = make(BULK, args.bulk_requests, args.bulk_prompt_len, args.bulk_output_len, args.seed + 1)
    return {"interactive": interactive, "bulk": unshared_prompts(bulk, 1, spec.vocab_size, spec.min_token_id),
            "mixed_interactive": unshared_prompts(interactive, 2, spec.vocab_size, spec.min_token_id),
            "mixed_bulk": unshared_prompts(bulk, 3, spec.vocab_size, spec.min_token_id)}


def latency(timings: list[RequestTiming], targets: dict[str, int] | None = None) -> dict[str, Any]:
    """p50 / p99 of TTFT and TPOT (seconds) over the requests that ran; with ``targets``
    (``slo_ttft_ms``, ``slo_tpot_ms``), also how many of them met both (``met_targets``: TTFT and
    mean time per output token after the first: the definition of a result row's ``slo_met``,
    workers/queue/slo.py's ``missed_targets``, applied to timings so that vLLM's runs count alike)."""
    ok = [t for t in timings if t.ok]
    out: dict[str, Any] = {"count": len(ok)}
    for name, values in (("ttft", [t.ttft for t in ok]), ("tpot", [t.tpot for t in ok])):
        stats = percentiles(values)
        out[name] = None if stats is None else {"p50": stats.p50, "p99": stats.p99, "max": stats.max}
    if targets is not None:
        ttft_s, tpot_s = targets["slo_ttft_ms"] / 1000.0, targets["slo_tpot_ms"] / 1000.0
        out["met_targets"] = sum(1 for t in ok if t.ttft is not None and t.ttft <= ttft_s
                                 and (t.tpot is None or t.tpot <= tpot_s))
    return out


def throughput(timings: list[RequestTiming]) -> float:
    """Output tokens per second from the first arrival to the last row."""
    ok = [t for t in timings if t.ok]
    if not ok:
        return 0.0
    span = max(t.finished_at for t in ok) - min(t.enqueued_at for t in ok)
    return sum(t.output_tokens for t in ok) / span if span > 0 else 0.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(timings: dict[str, list[RequestTiming]], targets: dict[str, int] | None = None) -> dict[str, Any]:
    """The figures of the three runs: interactive latency alone and mixed (and how many met
    ``targets``), and throughput."""
    alone, mixed = latency(timings["interactive"], targets), latency(timings["mixed_interactive"], targets)
    bulk_tps, mixed_tps = throughput(timings["bulk"]), throughput(timings["mixed_interactive"] + timings["mixed_bulk"])
    ratios = {f"{k}_p99": _ratio((mixed[k] or {}).get("p99"), (alone[k] or {}).get("p99")) for k in ("ttft", "tpot")}
    return {
        "latency_s": {"alone": alone, "mixed": mixed}, "mixed_over_alone": ratios,
        "throughput_tokens_per_s": {"bulk_alone": bulk_tps, "mixed": mixed_tps,
                                    "mixed_over_bulk_alone": _ratio(mixed_tps, bulk_tps)},
        "bulk_mixed_rows": sum(t.ok for t in timings["mixed_bulk"]),
    }


def phases(args: argparse.Namespace) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    """The three runs in order, each as (name, [(workload key, arrival seconds of each request)])."""
    n_i, rate = args.interactive_requests, args.interactive_rate
    later = [args.mixed_delay_s + t for t in poisson_arrivals(n_i, rate, args.seed + 1)]
    # Bulk alone first: its steps are then composed exactly as without targets (no interactive
    # request has been seen), the throughput baseline the mixed run is held to. The mixed run
    # next, for the same reason: its backlog starts as the first one did. Interactive alone last:
    # its requests, with no bulk work beside them, meet steps of their own whatever came before.
    return [("bulk alone", [("bulk", [0.0] * args.bulk_requests)]),
            ("mixed", [("mixed_bulk", [0.0] * args.bulk_requests), ("mixed_interactive", later)]),
            ("interactive alone", [("interactive", poisson_arrivals(n_i, rate, args.seed))])]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.compare == VLLM and not args.vllm_python:
        raise SystemExit("mixed_bench: --compare vllm needs --vllm-python PATH")
    if args.vllm_python and args.compare != VLLM:
        raise SystemExit("mixed_bench: --vllm-python applies to --compare vllm only")
    spec = resolve_model(args.model)
    if args.compare == VLLM and not (Path(spec.arg) / "config.json").is_file():
        raise SystemExit(f"mixed_bench: --compare vllm needs a checkpoint folder as --model, got {spec.arg!r}")
    work = workloads(spec, args)
    targets = None if args.no_targets else {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    result = {
        "model": spec.arg, "workers": args.workers, "targets": targets,
        "interactive": {"requests": args.interactive_requests, "rate": args.interactive_rate,
                        "prompt_len": args.interactive_prompt_len, "output_len": args.interactive_output_len},
        "bulk": {"requests": args.bulk_requests, "prompt_len": args.bulk_prompt_len,
                 "output_len": args.bulk_output_len},
        **summarize(_measure(args, spec, work), targets),
    }
    if args.compare == VLLM:
        from mqinfer.loadgen.vllm_mixed import compare

        result["vllm"] = compare(args, Path(spec.arg), work, phases(args), lambda t: summarize(t, targets))
        result["against_vllm"] = against(result, result["vllm"])
    return result


def against(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """Ours over vLLM's: the mixed run's interactive p99 TPOT and TTFT, and its total throughput."""
    if "error" in peer:
        return {}
    mine, theirs = ours["latency_s"]["mixed"], peer["latency_s"]["mixed"]
    return {f"mixed_interactive_{k}_p99": _ratio((mine[k] or {}).get("p99"), (theirs[k] or {}).get("p99"))
            for k in ("ttft", "tpot")} | {
        "mixed_throughput": _ratio(ours["throughput_tokens_per_s"]["mixed"], peer["throughput_tokens_per_s"]["mixed"])}


def _measure(args: argparse.Namespace, spec: ModelSpec, work: dict[str, list[dict[str, Any]]]
             ) -> dict[str, list[RequestTiming]]:
    """The three runs on one embedded server and one set of workers, after a warm-up request."""
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    with tempfile.TemporaryDirectory(prefix="mqinfer-mixed-") as tmp:
        scratch = Path(tmp)
        out = Path(args.out).resolve() if args.out else scratch / "out"
        out.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
        pool = WorkerPool(worker_argv(args, spec.arg, server.url, out), args.workers, out / "logs", out)
        producer = Producer(server.url, stream=STREAM)
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        timings: dict[str, list[RequestTiming]] = {}

        def phase(name: str, schedules: list[tuple[str, list[float]]]) -> None:
            jobs = [(key, f"{key}-{tag}") for key, _ in schedules]
            log(f"mixed bench: {name}: " + ", ".join(f"{len(work[key])} {key}" for key, _ in schedules))
            submit_all(server.url, [(work[key], arrivals, job) for (key, arrivals), (_, job) in zip(schedules, jobs)])
            for key, job in jobs:
                wait_done(producer.redis, job, len(work[key]), pool, args.timeout_s, f"{name}: {key}")
                timings[key], _ = read_results(out, job, work[key])

        try:
            pool.start()
            warm = {"id": "warmup", "prompt_token_ids": work["bulk"][0]["prompt_token_ids"][::-1], "max_tokens": 4,
                    "ignore_eos": True, "temperature": 0.0}
            producer.submit(warm, job_id=f"warmup-{tag}")
            log(f"mixed bench: starting {args.workers} worker(s), waiting for a warm-up request")
            wait_done(producer.redis, f"warmup-{tag}", 1, pool, args.timeout_s, "warm-up")
            for name, schedules in phases(args):
                phase(name, schedules)
        finally:
            pool.stop()
            producer.redis.close()
            server.stop()
    return timings


def format_report(result: dict[str, Any]) -> str:
    def ms(stats: dict[str, Any] | None, key: str) -> str:
        return "-" if stats is None else f"{stats[key] * 1000:.1f}"

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    targets = result["targets"]
    shown = "none" if targets is None else f"TTFT {targets['slo_ttft_ms']} ms, TPOT {targets['slo_tpot_ms']} ms"
    i, b = result["interactive"], result["bulk"]
    lines = [f"model {result['model']}, {result['workers']} worker(s); interactive {i['requests']} x "
             f"{i['prompt_len']}+{i['output_len']} tokens at {i['rate']:g}/s, targets {shown}; bulk {b['requests']} x "
             f"{b['prompt_len']}+{b['output_len']} tokens at once", "",
             "interactive latency, ms",
             f"{'run':<8}{'p50 TTFT':>11}{'p99 TTFT':>11}{'p50 TPOT':>11}{'p99 TPOT':>11}"]
    for name in ("alone", "mixed"):
        s = result["latency_s"][name]
        lines.append(f"{name:<8}{ms(s['ttft'], 'p50'):>11}{ms(s['ttft'], 'p99'):>11}"
                     f"{ms(s['tpot'], 'p50'):>11}{ms(s['tpot'], 'p99'):>11}")
    r = result["mixed_over_alone"]
    lines.append(f"{'ratio':<8}{'':>11}{x(r['ttft_p99']):>11}{'':>11}{x(r['tpot_p99']):>11}")
    met = _met(result["latency_s"])
    if met:
        lines.append(met)
    t = result["throughput_tokens_per_s"]
    lines += ["", "total throughput, output tokens/s",
              f"bulk alone {t['bulk_alone']:.1f}, mixed {t['mixed']:.1f} ({x(t['mixed_over_bulk_alone'])})"]
    peer = result.get("vllm")
    if peer is not None:
        lines += ["", f"vLLM {peer.get('vllm_version', '?')} (CPU, scheduling_policy=priority), same requests"]
        if "error" in peer:
            lines.append(f"failed: {peer['error'][-300:]}")
        else:
            for name in ("alone", "mixed"):
                s = peer["latency_s"][name]
                lines.append(f"{name:<8}{ms(s['ttft'], 'p50'):>11}{ms(s['ttft'], 'p99'):>11}"
                             f"{ms(s['tpot'], 'p50'):>11}{ms(s['tpot'], 'p99'):>11}")
            met = _met(peer["latency_s"])
            if met:
                lines.append(met)
            pt = peer["throughput_tokens_per_s"]
            a = result["against_vllm"]
            lines += [f"throughput: bulk alone {pt['bulk_alone']:.1f}, mixed {pt['mixed']:.1f}",
                      f"mqinfer over vLLM, mixed: interactive p99 TPOT {x(a['mixed_interactive_tpot_p99'])}, "
                      f"p99 TTFT {x(a['mixed_interactive_ttft_p99'])}, throughput {x(a['mixed_throughput'])}"]
    return "\n".join(lines)


def _met(latency_s: dict[str, Any]) -> str | None:
    """``met both targets: alone 30/30, mixed 29/30``, or None when the runs had no targets."""
    runs = [(name, latency_s[name]) for name in ("alone", "mixed")]
    if any("met_targets" not in stats for _, stats in runs):
        return None
    return "met both targets: " + ", ".join(f"{name} {stats['met_targets']}/{stats['count']}" for name, stats in runs)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
