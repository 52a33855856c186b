"""Per-tenant rate limits held across workers, measured through the real pipeline.

Runs an embedded server and ``--workers`` ``mqinfer worker`` processes (``bench_pool``), all with
the same ``--tenant-limits``. Each limited tenant offers ``--overload`` times its token limit for
``--duration-s`` seconds (requests of ``--prompt-len`` prompt tokens and ``--max-tokens`` output
tokens, evenly spaced); an unlimited tenant (``--free-rate`` requests per second, 0 = none) runs
beside them. Every request carries a deadline ``--deadline-s`` after the submission ends, so the
backlog a limit builds up ends as ``rate_limited`` rows instead of running on.

A request's tokens are what its tenant's bucket charges: prompt tokens + ``max_tokens``. Reported
per tenant, as a table on stdout and with ``--json FILE`` as JSON: the configured limit, the
offered rate, and the achieved rate: the tokens of the requests whose first engine step
(``started_at``) falls in the measuring window, divided by the window. The window starts
``--skip-s`` seconds after the first submission (past the first second's burst) and ends with the
submission; the error is the achieved rate against the limit. Also: how many requests each worker
started, and how many ended ``rate_limited``.

``python -m mqinfer.loadgen.ratelimit_bench --help``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_options import positive_int, run_scenario
from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, wait_done, worker_argv
from mqinfer.workers.tenant_limits import TenantLimit, format_tenant_limits, parse_tenant_limits

FREE = "free"


def _limits(text: str) -> dict[str, TenantLimit]:
    try:
        limits = parse_tenant_limits(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not limits:
        raise argparse.ArgumentTypeError("give at least one tenant=tokens_per_s")
    if FREE in limits:
        raise argparse.ArgumentTypeError(f"{FREE!r} is the unlimited tenant's name; name the limited ones otherwise")
    return limits


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.ratelimit_bench",
        description="Per-tenant rate limits (--tenant-limits) held across several workers: each limited tenant "
                    "offers more than its limit for a while; reports achieved against configured tokens/s.")
    g = p.add_argument_group("workload")
    g.add_argument("--limits", type=_limits, default=_limits("gold=400,silver=150"), metavar="T=TOK[:REQ],...",
                   help="The workers' --tenant-limits (default: gold=400,silver=150).")
    g.add_argument("--overload", type=_non_negative_float, default=2.0, metavar="X",
                   help="Each limited tenant offers X times its token limit (default: 2).")
    g.add_argument("--free-rate", type=_non_negative_float, default=2.0, metavar="R",
                   help=f"Requests per second of the unlimited tenant {FREE!r} beside them, 0 = none (default: 2).")
    g.add_argument("--duration-s", type=_non_negative_float, default=60.0, metavar="S",
                   help="How long requests are submitted (default: 60).")
    g.add_argument("--skip-s", type=_non_negative_float, default=5.0, metavar="S",
                   help="The measuring window starts this long after the first submission (default: 5).")
    g.add_argument("--deadline-s", type=_non_negative_float, default=2.0, metavar="S",
                   help="Each request's deadline: this long after the submission ends (default: 2).")
    g.add_argument("--prompt-len", type=positive_int, default=16, metavar="N", help="Prompt tokens (default: 16).")
    g.add_argument("--max-tokens", type=positive_int, default=16, metavar="N",
                   help="Output tokens of each request, generated in full (default: 16).")

    g = p.add_argument_group("run")
    g.add_argument("--model", default="tiny", metavar="M", help="The workers' --model (default: tiny).")
    g.add_argument("--workers", type=positive_int, default=2, metavar="N", help="Worker processes (default: 2).")
    g.add_argument("--num-threads", type=positive_int, default=1, metavar="N",
                   help="Model threads per worker (default: 1).")
    g.add_argument("--out", default=None, metavar="DIR", help="Keep the workers' output here (default: a temp dir).")
    g.add_argument("--timeout-s", type=float, default=600.0, metavar="S", help="Give up after this long.")
    g.add_argument("--json", default=None, metavar="FILE", help="Write every figure as JSON.")
    return p


def _schedule(limits: dict[str, TenantLimit], args: argparse.Namespace) -> list[tuple[float, dict[str, Any]]]:
    """(offset in seconds, request) for every request of the run, in submission order."""
    cost = args.prompt_len + args.max_tokens
    plan: list[tuple[float, dict[str, Any]]] = []
    rates = {t: args.overload * spec.tokens_per_s / cost for t, spec in limits.items()}
    if args.free_rate > 0:
        rates[FREE] = args.free_rate
    for k, (tenant, rate) in enumerate(rates.items()):
        if rate <= 0:
            continue
        for i in range(int(args.duration_s * rate)):
            prompt = [(7 * k + 3 * i + j) % 250 + 1 for j in range(args.prompt_len)]
            plan.append((i / rate, {"id": f"{tenant}-{i}", "tenant": tenant, "prompt_token_ids": prompt,
                                    "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}))
    plan.sort(key=lambda item: item[0])
    return plan


def _submit(url: str, plan: list[tuple[float, dict[str, Any]]], job_id: str, deadline: float, t0: float,
            errors: list[BaseException]) -> None:
    from mqinfer.client import Producer

    producer = Producer(url, stream=STREAM)
    try:
        for at, request in plan:
            delay = t0 + at - time.time()
            if delay > 0:
                time.sleep(delay)
            producer.submit({**request, "deadline": deadline}, job_id=job_id)
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)
    finally:
        producer.redis.close()


def _rows(out: Path, job_id: str) -> list[dict[str, Any]]:
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    table = ds.dataset(out / "results", format="parquet", partitioning="hive").to_table(
        filter=pc.field("job_id") == job_id,
        columns=["id", "tenant", "finish_reason", "error_code", "prompt_tokens", "started_at", "worker"])
    return table.to_pylist()


def measure(rows: list[dict[str, Any]], limits: dict[str, TenantLimit], args: argparse.Namespace,
            window: tuple[float, float]) -> dict[str, Any]:
    """Per tenant: the limit, the offered and the achieved tokens/s in ``window`` (unix seconds)."""
    cost = args.prompt_len + args.max_tokens
    start, end = window
    tenants: dict[str, Any] = {}
    names = list(limits) + ([FREE] if args.free_rate > 0 else [])
    for tenant in names:
        mine = [r for r in rows if r["tenant"] == tenant]
        started = [r for r in mine if r["started_at"] is not None]
        in_window = [r for r in started if start <= r["started_at"].timestamp() < end]
        achieved = len(in_window) * cost / (end - start)
        spec = limits.get(tenant)
        tenants[tenant] = {
            "limit_tokens_per_s": spec.tokens_per_s if spec else None,
            "limit_requests_per_s": spec.requests_per_s if spec else None,
            "offered_tokens_per_s": (args.overload * spec.tokens_per_s if spec else args.free_rate * cost),
            "achieved_tokens_per_s": achieved,
            "error": (achieved / spec.tokens_per_s - 1.0) if spec else None,
            "requests": len(mine), "ran": len(started),
            "rate_limited": sum(1 for r in mine if r["error_code"] == "rate_limited"),
            "expired": sum(1 for r in mine if r["finish_reason"] == "expired"),
            "by_worker": {w: sum(1 for r in in_window if r["worker"] == w)
                          for w in sorted({r["worker"] for r in in_window})},
        }
    return tenants


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    limits = args.limits
    plan = _schedule(limits, args)
    if not plan:
        raise SystemExit("nothing to submit: raise --duration-s or the rates")
    with tempfile.TemporaryDirectory(prefix="mqinfer-ratelimit-") as tmp:
        scratch = Path(tmp)
        out = Path(args.out).resolve() if args.out else scratch / "out"
        out.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
        engine = argparse.Namespace(dtype="auto", device="auto", quantization="none", kv_cache_dtype="auto",
                                    idle_exit_s=600, max_num_seqs=None, max_num_batched_tokens=None,
                                    num_kv_blocks=None, block_size=None, max_batch=None, max_wait_ms=None,
                                    num_threads=args.num_threads)
        argv = worker_argv(engine, args.model, server.url, out) + ["--tenant-limits", format_tenant_limits(limits)]
        pool = WorkerPool(argv, args.workers, out / "logs", out)
        producer = Producer(server.url, stream=STREAM)
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        job_id = f"ratelimit-{tag}"
        try:
            pool.start()
            warm = {"id": "warmup", "prompt_token_ids": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
            producer.submit(warm, job_id=f"warmup-{tag}")
            log(f"ratelimit: starting {args.workers} worker(s), waiting for a warm-up request")
            wait_done(producer.redis, f"warmup-{tag}", 1, pool, args.timeout_s, "warm-up")
            time.sleep(1.0)  # every worker joined and reading
            log(f"ratelimit: {len(plan)} requests over {args.duration_s:g}s, limits "
                f"{format_tenant_limits(limits)}, {args.overload:g}x offered")
            t0 = time.time() + 0.5
            deadline = t0 + args.duration_s + args.deadline_s
            errors: list[BaseException] = []
            thread = threading.Thread(target=_submit, args=(server.url, plan, job_id, deadline, t0, errors),
                                      name="ratelimit-submit", daemon=True)
            thread.start()
            thread.join()
            if errors:
                raise RuntimeError(f"submitting failed: {errors[0]}")
            wait_done(producer.redis, job_id, len(plan), pool, args.timeout_s, "ratelimit")
        finally:
            pool.stop()
            producer.redis.close()
            server.stop()
        rows = _rows(out, job_id)
    window = (t0 + args.skip_s, t0 + args.duration_s)
    return {
        "model": args.model, "workers": args.workers, "tenant_limits": format_tenant_limits(limits),
        "overload": args.overload, "duration_s": args.duration_s, "window_s": window[1] - window[0],
        "request_tokens": args.prompt_len + args.max_tokens, "rows": len(rows), "submitted": len(plan),
        "tenants": measure(rows, limits, args, window),
    }


def format_report(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}, {result['workers']} worker(s), --tenant-limits {result['tenant_limits']}, "
             f"{result['request_tokens']} tokens a request, limited tenants offer {result['overload']:g}x their "
             f"limit for {result['duration_s']:g}s; measured over {result['window_s']:g}s "
             f"({result['rows']}/{result['submitted']} rows)",
             "",
             f"{'tenant':<10}{'limit':>9}{'offered':>10}{'achieved':>10}{'error':>9}{'ran':>7}{'limited':>9}"
             "  started per worker (window)"]
    for name, t in result["tenants"].items():
        limit = "-" if t["limit_tokens_per_s"] is None else f"{t['limit_tokens_per_s']:g}"
        error = "-" if t["error"] is None else f"{t['error']:+.1%}"
        workers = ", ".join(f"{w}: {n}" for w, n in t["by_worker"].items())
        lines.append(f"{name:<10}{limit:>9}{t['offered_tokens_per_s']:>10.0f}{t['achieved_tokens_per_s']:>10.1f}"
                     f"{error:>9}{t['ran']:>7}{t['rate_limited']:>9}  {workers}")
    lines.append("(tokens/s; a request's tokens = prompt + max_tokens, counted at its first engine step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
