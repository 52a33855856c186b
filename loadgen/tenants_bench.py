"""Fair share between tenants, measured through the real pipeline: a light tenant alone, then
beside a heavy tenant that offers ``--heavy-factor`` times its load.

Runs an embedded server and ``mqinfer worker`` processes (``bench_pool``), with the tenant
weights given by ``--tenant-weights``. Two runs on the same workers:

1. **alone**: the light tenant's requests arrive as a Poisson process at ``--light-rate``;
2. **flood**: the same requests again (prompts salted, so that nothing is a prefix-cache hit from
   the first run) at the same rate, while the heavy tenant's arrive at ``--heavy-factor`` times
   that rate (or, with ``--heavy-burst``, all at once before the first light one).

Reported, as a table on stdout and with ``--json FILE`` as JSON: the light tenant's queueing
delay (``started_at - enqueued_at`` of its result rows: from the stream to the first engine step
that runs it) at p50 / p99 / max, alone and with the flood; and for the flood run each tenant's
share of the tokens served while both had requests in the system, beside its weight's share and
the max-min fair share of that window's capacity (a tenant that asks for less than its weight's
share is owed only what it asks; the rest goes to the others by weight). A tenant's demand is
counted as the tokens of its requests that were in the system during the window, so a tenant
not backlogged throughout is owed somewhat more than it could have taken.

``python -m mqinfer.loadgen.tenants_bench --help``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_model import ModelSpec, resolve_model
from mqinfer.loadgen.bench_online import submit_on_schedule, poisson_arrivals, unshared_prompts
from mqinfer.loadgen.bench_options import (
    add_worker_engine_options, parse_length_range, parse_worker_count, positive_int, run_scenario,
)
from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, read_results, wait_done, worker_argv
from mqinfer.loadgen.metrics import RequestTiming, percentiles
from mqinfer.loadgen.workload import fit_to_context, uniform_workload
from mqinfer.scheduler.config import format_tenant_weights, parse_tenant_weights

LIGHT, HEAVY = "light", "heavy"


def tenant_weights(text: str) -> dict[str, float]:
    """``--tenant-weights`` (``tenant=w,...``) for argparse: the weights, or an argparse error."""
    try:
        return parse_tenant_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.tenants_bench",
        description="A light tenant's queueing delay alone and beside a heavy tenant offering N times its load, "
                    "and each tenant's share of the tokens served against its weight, through the real pipeline.")
    g = p.add_argument_group("workload")
    g.add_argument("--model", default=None, metavar="M",
                   help="`tiny`, a checkpoint folder, or a .gguf file (default: the standard benchmark checkpoint).")
    g.add_argument("--light-requests", type=positive_int, default=50, metavar="N",
                   help="The light tenant's requests in each run (default: 50).")
    g.add_argument("--light-rate", type=positive_float, default=0.5, metavar="R",
                   help="The light tenant's arrivals per second, a Poisson process (default: 0.5).")
    g.add_argument("--heavy-factor", type=positive_int, default=10, metavar="K",
                   help="The heavy tenant offers K times the light one's load: K times its requests, at K "
                        "times its rate (default: 10).")
    g.add_argument("--heavy-burst", action="store_true",
                   help="Submit the heavy tenant's requests all at once before the first light one, instead "
                        "of at K times the light rate.")
    g.add_argument("--prompt-len", type=parse_length_range, default=(32, 256), metavar="LO,HI",
                   help="Prompt lengths, uniform, for both tenants (default: 32,256).")
    g.add_argument("--output-len", type=parse_length_range, default=(16, 128), metavar="LO,HI",
                   help="Output lengths, uniform, for both tenants (default: 16,128).")
    g.add_argument("--seed", type=int, default=0, help="Workload and arrival seed (default: 0).")
    g.add_argument("--tenant-weights", type=tenant_weights, default={}, metavar="T=W,...",
                   help="The workers' --tenant-weights, e.g. light=1,heavy=1 (default: every tenant weight 1).")

    g = p.add_argument_group("run")
    g.add_argument("--workers", type=parse_worker_count, default=1, metavar="N|auto", help="Worker processes (default: 1).")
    g.add_argument("--out", default=None, metavar="DIR", help="Keep the workers' output here (default: a temp dir).")
    g.add_argument("--timeout-s", type=float, default=3600.0, metavar="S", help="Give up on a run after this long.")
    g.add_argument("--idle-exit-s", type=float, default=600.0, metavar="S",
                   help="Workers exit after this long with nothing to do (default: 600).")
    g.add_argument("--json", default=None, metavar="FILE", help="Write every figure as JSON.")

    add_worker_engine_options(p)
    return p


def tenant_requests(spec: ModelSpec, args: argparse.Namespace, tenant: str, n: int, seed: int) -> list[dict[str, Any]]:
    reqs = uniform_workload(n, prompt_len=args.prompt_len, output_len=args.output_len, vocab_size=spec.vocab_size,
                            seed=seed, id_prefix=tenant, min_token_id=spec.min_token_id)
    return [{**fit_to_context(r, spec.max_model_len), "tenant": tenant} for r in reqs]


def queue_delays(timings: list[RequestTiming]) -> dict[str, Any] | None:
    """Percentiles of started_at - enqueued_at over the requests that ran."""
    stats = percentiles(t.started_at - t.enqueued_at for t in timings if t.ok)
    return None if stats is None else {k: getattr(stats, k) for k in ("p50", "p90", "p99", "mean", "max", "count")}


def _tokens(request: dict[str, Any]) -> int:
    return len(request["prompt_token_ids"]) + int(request["max_tokens"])


def served_in(timings: list[RequestTiming], requests: list[dict[str, Any]], start: float, end: float) -> float:
    """Tokens (prompt + output) served in [start, end]: each request's spread evenly over its
    started_at..finished_at and counted for the part inside the window."""
    total = 0.0
    for t, r in zip(timings, requests):
        if not t.ok:
            continue
        span = t.finished_at - t.started_at
        tokens = t.prompt_tokens + t.output_tokens
        if span <= 0:
            total += tokens if start <= t.finished_at <= end else 0
            continue
        overlap = min(end, t.finished_at) - max(start, t.started_at)
        if overlap > 0:
            total += tokens * overlap / span
    return total


def in_system(timings: list[RequestTiming], requests: list[dict[str, Any]], start: float, end: float) -> float:
    """Tokens (prompt + output asked for) of the requests in the system at some time in [start, end]."""
    return float(sum(_tokens(r) for t, r in zip(timings, requests) if t.enqueued_at <= end and t.finished_at >= start))


def max_min_fair(demand: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Shares of a unit capacity, each tenant's demand given as a fraction of that capacity: by
    weight, except that a tenant asking less than its weighted share gets what it asks and the
    rest is shared again by weight among the others."""
    shares = {t: 0.0 for t in demand}
    left = dict(demand)
    capacity = 1.0
    while left and capacity > 1e-12:
        total_w = sum(weights[t] for t in left)
        offer = {t: capacity * weights[t] / total_w for t in left}
        sated = [t for t in left if left[t] <= offer[t]]
        if not sated:
            for t in left:
                shares[t] += offer[t]
            break
        for t in sated:
            shares[t] += left[t]
            capacity -= left[t]
            del left[t]
    return shares


@dataclass
class _Workloads:
    """Both tenants' requests: the light tenant's for each run and the heavy tenant's flood."""
    light: list[dict[str, Any]]  # the alone run's
    light_again: list[dict[str, Any]]  # the flood run's: the same lengths, no prompt block shared with the first run
    heavy: list[dict[str, Any]]
    n_light: int
    n_heavy: int


@dataclass
class _Pipeline:
    """The running server, a producer on it, the workers, and where their results land."""
    url: str
    producer: Any  # mqinfer.client.Producer
    pool: WorkerPool
    out: Path
    tag: str  # makes this run's job ids unique


@dataclass
class _Timings:
    """The result rows of both runs and how long each took."""
    alone: list[RequestTiming]
    alone_s: float
    flood_light: list[RequestTiming]
    flood_heavy: list[RequestTiming]
    flood_s: float


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mqinfer.layout import choose_layout

    spec = resolve_model(args.model)
    workers, threads, why = choose_layout({"workers": args.workers, "num_threads": args.num_threads,
                                           "device": args.device, "shards": 1, "model": spec.arg})
    if args.workers == "auto":
        log(f"--workers auto: {workers} worker(s) x {threads or 'default'} thread(s) ({why})")
    args.workers, args.num_threads = workers, threads
    weights = dict(args.tenant_weights)
    weight_of = {t: weights.get(t, 1.0) for t in (LIGHT, HEAVY)}
    n_light = args.light_requests
    n_heavy = n_light * args.heavy_factor
    light = tenant_requests(spec, args, LIGHT, n_light, args.seed)
    heavy = tenant_requests(spec, args, HEAVY, n_heavy, args.seed + 1)
    work = _Workloads(light, unshared_prompts(light, 1, spec.vocab_size, spec.min_token_id), heavy, n_light, n_heavy)
    timings = _measure(args, spec, weights, work)
    window, tenants = _tenant_shares(work, timings, weight_of)
    return {
        "model": spec.arg, "workers": args.workers, "tenant_weights": format_tenant_weights(weight_of),
        "light_rate": args.light_rate, "heavy_factor": args.heavy_factor, "heavy_burst": args.heavy_burst,
        "prompt_len": list(args.prompt_len), "output_len": list(args.output_len), "seed": args.seed,
        "light_queue_delay_s": {"alone": queue_delays(timings.alone), "flood": queue_delays(timings.flood_light)},
        "heavy_queue_delay_s": queue_delays(timings.flood_heavy),
        "run_s": {"alone": timings.alone_s, "flood": timings.flood_s}, "contention_window_s": window,
        "tenants": tenants,
    }


def _measure(args: argparse.Namespace, spec: ModelSpec, weights: dict[str, float], work: _Workloads) -> _Timings:
    """Both runs on one embedded server and one set of workers (with the tenant weights), after a
    warm-up request."""
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    with tempfile.TemporaryDirectory(prefix="mqinfer-tenants-") as tmp:
        scratch = Path(tmp)
        out = Path(args.out).resolve() if args.out else scratch / "out"
        out.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
        argv = worker_argv(args, spec.arg, server.url, out)
        if weights:
            argv += ["--tenant-weights", format_tenant_weights(weights)]
        pool = WorkerPool(argv, args.workers, out / "logs", out)
        producer = Producer(server.url, stream=STREAM)
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        pipeline = _Pipeline(server.url, producer, pool, out, tag)
        try:
            pool.start()
            warm = {"id": "warmup", "prompt_token_ids": work.light[0]["prompt_token_ids"][::-1], "max_tokens": 4,
                    "ignore_eos": True, "temperature": 0.0}
            producer.submit(warm, job_id=f"warmup-{tag}")
            log(f"tenants: starting {args.workers} worker(s), waiting for a warm-up request")
            wait_done(producer.redis, f"warmup-{tag}", 1, pool, args.timeout_s, "warm-up")
            alone, alone_s = _run_alone(args, pipeline, work)
            flood_light, flood_heavy, flood_s = _run_flood(args, pipeline, work)
        finally:
            pool.stop()
            producer.redis.close()
            server.stop()
    return _Timings(alone, alone_s, flood_light, flood_heavy, flood_s)


def _run_alone(args: argparse.Namespace, pipeline: _Pipeline, work: _Workloads) -> tuple[list[RequestTiming], float]:
    """The light tenant's requests alone at ``--light-rate``: their result rows and the run's seconds."""
    job = f"alone-{pipeline.tag}"
    log(f"tenants alone: {work.n_light} light requests at {args.light_rate:g} req/s")
    t0 = time.time()
    submit_all(pipeline.url, [(work.light, poisson_arrivals(work.n_light, args.light_rate, args.seed), job)])
    wait_done(pipeline.producer.redis, job, work.n_light, pipeline.pool, args.timeout_s, "alone")
    alone_s = time.time() - t0
    alone, _ = read_results(pipeline.out, job, work.light)
    return alone, alone_s


def _run_flood(args: argparse.Namespace, pipeline: _Pipeline, work: _Workloads
               ) -> tuple[list[RequestTiming], list[RequestTiming], float]:
    """The light tenant's requests again beside the heavy tenant's (at ``--heavy-factor`` times the
    rate, or all at once with ``--heavy-burst``): each tenant's result rows and the run's seconds."""
    jobs = {LIGHT: f"light-{pipeline.tag}", HEAVY: f"heavy-{pipeline.tag}"}
    n_light, n_heavy = work.n_light, work.n_heavy
    schedules = [(work.light_again, poisson_arrivals(n_light, args.light_rate, args.seed + 2), jobs[LIGHT])]
    if args.heavy_burst:
        log(f"tenants flood: {n_heavy} heavy requests at once, then {n_light} light at {args.light_rate:g} "
            "req/s")
        pipeline.producer.submit_many(work.heavy, job_id=jobs[HEAVY])
    else:
        rate = args.light_rate * args.heavy_factor
        log(f"tenants flood: {n_heavy} heavy requests at {rate:g} req/s beside {n_light} light at "
            f"{args.light_rate:g} req/s")
        schedules.append((work.heavy, poisson_arrivals(n_heavy, rate, args.seed + 3), jobs[HEAVY]))
    t0 = time.time()
    submit_all(pipeline.url, schedules)
    wait_done(pipeline.producer.redis, jobs[LIGHT], n_light, pipeline.pool, args.timeout_s, "flood: light")
    wait_done(pipeline.producer.redis, jobs[HEAVY], n_heavy, pipeline.pool, args.timeout_s, "flood: heavy")
    flood_s = time.time() - t0
    flood_light, _ = read_results(pipeline.out, jobs[LIGHT], work.light_again)
    flood_heavy, _ = read_results(pipeline.out, jobs[HEAVY], work.heavy)
    return flood_light, flood_heavy, flood_s


def _tenant_shares(work: _Workloads, timings: _Timings, weight_of: dict[str, float]
                   ) -> tuple[float, dict[str, dict[str, Any]]]:
    """The contention window's length and, per tenant, its weight, offered, fair and served shares."""
    flood_light, flood_heavy, light_again, heavy = timings.flood_light, timings.flood_heavy, work.light_again, work.heavy
    # Shares while both tenants had requests in the system: from the later first arrival to the
    # earlier last finish.
    start = max(min(t.enqueued_at for t in flood_light), min(t.enqueued_at for t in flood_heavy))
    end = min(max(t.finished_at for t in flood_light), max(t.finished_at for t in flood_heavy))
    served = {LIGHT: served_in(flood_light, light_again, start, end),
              HEAVY: served_in(flood_heavy, heavy, start, end)}
    offered = {LIGHT: float(sum(map(_tokens, light_again))), HEAVY: float(sum(map(_tokens, heavy)))}
    total_served = sum(served.values()) or 1.0
    total_offered = sum(offered.values())
    # Each tenant's demand on the window's capacity (the tokens served in it): the tokens of its
    # requests that were in the system then. A backlogged tenant asks for more than all of it.
    demand = {LIGHT: in_system(flood_light, light_again, start, end), HEAVY: in_system(flood_heavy, heavy, start, end)}
    fair = max_min_fair({t: demand[t] / total_served for t in demand}, weight_of)
    total_w = sum(weight_of.values())
    window = max(0.0, end - start)
    tenants = {
        t: {"weight": weight_of[t], "weight_share": weight_of[t] / total_w,
            "offered_share": offered[t] / total_offered, "fair_share": fair[t],
            "served_share": served[t] / total_served,
            "tokens_per_s": served[t] / window if window > 0 else None,
            "requests": work.n_light if t == LIGHT else work.n_heavy}
        for t in (LIGHT, HEAVY)
    }
    return window, tenants


def submit_all(url: str, schedules: list[tuple[list[dict[str, Any]], list[float], str]]) -> None:
    """Each (requests, arrival offsets, job id) on its own thread and connection, all from one start."""
    from mqinfer.client import Producer

    producers = [Producer(url, stream=STREAM) for _ in schedules]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=submit_on_schedule, args=(prod, reqs, arrivals, job, [], errors),
                                name=f"tenants-submit-{job}", daemon=True)
               for prod, (reqs, arrivals, job) in zip(producers, schedules)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prod in producers:
        prod.redis.close()
    if errors:
        raise RuntimeError(f"submitting failed: {errors[0]}")


def format_report(result: dict[str, Any]) -> str:
    def ms(stats: dict[str, Any] | None, key: str) -> str:
        return "-" if stats is None else f"{stats[key] * 1000:.0f}"

    delays = result["light_queue_delay_s"]
    lines = [f"model {result['model']}, {result['workers']} worker(s), weights {result['tenant_weights']}, "
             f"light {result['light_rate']:g} req/s, heavy {result['heavy_factor']}x"
             + (" (burst)" if result["heavy_burst"] else ""),
             "",
             "light tenant queueing delay (started_at - enqueued_at), ms",
             f"{'run':<8}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for run_name in ("alone", "flood"):
        s = delays[run_name]
        lines.append(f"{run_name:<8}{ms(s, 'p50'):>10}{ms(s, 'p90'):>10}{ms(s, 'p99'):>10}{ms(s, 'max'):>10}")
    lines += ["",
              f"token shares while both tenants were in the system ({result['contention_window_s']:.1f} s)",
              f"{'tenant':<8}{'weight':>8}{'offered':>10}{'fair':>10}{'served':>10}{'tok/s':>10}"]
    for name, t in result["tenants"].items():
        rate = "-" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.0f}"
        lines.append(f"{name:<8}{t['weight']:>8g}{t['offered_share']:>10.1%}{t['fair_share']:>10.1%}"
                     f"{t['served_share']:>10.1%}{rate:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
