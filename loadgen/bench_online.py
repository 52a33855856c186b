"""The online run of `mqinfer bench`: Poisson arrivals at an offered rate against running workers.

Workers start first and each is warmed with one request; requests then arrive as a Poisson process at
``--rate`` per second (several rates make a sweep), and TTFT / TPOT / e2e are measured from each
entry's enqueue time. Each point is checked against the latency goal, p99 TTFT <= max wait + 3 engine
steps (``point_budget``), an engine step being the point's own TPOT p50. Owns ``OnlinePoint``,
the budget, the rate arithmetic of ``--rate half`` and the seeded arrival times.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_model import ModelSpec
from mqinfer.loadgen.bench_options import AUTO
from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, read_results, wait_done
from mqinfer.loadgen.metrics import RequestTiming, RunSummary, TtftBudget, summarize, ttft_budget
from mqinfer.loadgen.workload import MIN_TOKEN_ID

BUDGET_STEPS = 3  # the latency goal: p99 TTFT <= max wait + 3 engine steps
# After a warm-up request that reached an already warm worker (another was still starting), the
# next one waits this long.
WARMUP_PAUSE_S = 0.2
# The warm-up gives up after this long (or the run's --timeout-s, if shorter): a worker that has
# not read a request by then is not starting, it is stuck.
WARMUP_LIMIT_S = 300.0


@dataclass
class OnlinePoint:
    rate: float  # offered load, requests per second
    summary: RunSummary
    submit_lag_p99_s: float  # how late the submitter was against the Poisson schedule
    timings: list[RequestTiming] = field(repr=False, default_factory=list)
    max_wait_ms: float | str | None = None  # the workers' batcher wait (ms or "auto"); None: unknown
    budget: TtftBudget | None = None  # the latency goal; None without a TTFT or a step to measure it by


def wait_label(setting: float | str | None) -> str:
    if setting is None:
        return "?"
    return AUTO if setting == AUTO else f"{float(setting):g} ms"


def wait_budget_s(setting: float | str) -> tuple[float, str]:
    """The wait counted in the TTFT budget (seconds) and how it was chosen. For ``auto`` that is
    the upper bound the adaptive batcher may choose: the worker builds its ``AdaptiveWait`` with
    the default bounds."""
    if setting == AUTO:
        from mqinfer.scheduler.batcher import AdaptiveWait

        bound = AdaptiveWait().max_wait_s
        return bound, f"{bound * 1000:g} [auto: the adaptive batcher's upper bound]"
    return float(setting) / 1000.0, f"{float(setting):g}"


def point_budget(summary: RunSummary, setting: float | str) -> TtftBudget | None:
    """The latency goal for one online point: its p99 TTFT against the max wait plus three engine
    steps, a step being the point's TPOT p50 (one decode step of a running request, measured under
    the same load). None when no request produced a first token or a second one."""
    if summary.ttft is None or summary.tpot is None:
        return None
    return ttft_budget(summary.ttft.p99, wait_budget_s(setting)[0], summary.tpot.p50, BUDGET_STEPS)


def request_rate(summary: RunSummary) -> float:
    """A run's request throughput: requests finished without error / span (0 when none)."""
    done = summary.num_requests - summary.num_errors
    return done / summary.span_s if done > 0 and summary.span_s > 0 else 0.0


def half_rate(offline: RunSummary) -> float:
    """Half an offline run's request throughput, to 3 significant digits."""
    rate = request_rate(offline)
    if rate <= 0:
        raise RuntimeError("--rate half: the offline run measured no throughput to take half of")
    return float(f"{rate / 2:.3g}")


def unshared_prompts(requests: list[dict[str, Any]], salt: int, vocab_size: int,
                     min_token_id: int = MIN_TOKEN_ID) -> list[dict[str, Any]]:
    """The requests with each prompt's first token id shifted by ``salt`` within the prompt ids
    (``min_token_id`` up to, not including, ``vocab_size``).

    Prefix-cache block hashes are chained from the first block, so the points of a sweep on the
    same workers, each with its own salt, share no cached prompt blocks (without this, every point
    after the first found about 95% of its prompt tokens cached, and its TTFT was flattered),
    while the requests of one point still share what they shared before (a shared prefix).
    Salt 0 returns the requests unchanged.
    """
    span = vocab_size - min_token_id
    if salt % span == 0:
        return requests
    out = []
    for r in requests:
        ids = list(r["prompt_token_ids"])
        ids[0] = min_token_id + (ids[0] - min_token_id + salt) % span
        out.append({**r, "prompt_token_ids": ids})
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives, at ``rate`` per second."""
    import numpy as np

    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


def submit_on_schedule(producer, requests: list[dict[str, Any]], arrivals: list[float], job_id: str,
                        lags: list[float], errors: list[BaseException]) -> None:
    try:
        t0 = time.monotonic()
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            producer.submit(req, job_id=job_id)
            lags.append(max(0.0, time.monotonic() - (t0 + at)))
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def warm_workers(producer, pool: WorkerPool, out: Path, prompt: list[int], tag: str, workers: int,
                 timeout_s: float) -> None:
    """One warm-up request at a time until every worker has run one (a worker's first steps run
    cold, and the online figures are about warm workers). Workers blocked on the stream are woken
    in the order they blocked, so each request usually reaches one that has not served yet; one
    still starting lets a warm one take the request, so after such a try the next waits
    WARMUP_PAUSE_S. It gives up after WARMUP_LIMIT_S (or ``timeout_s``), saying how many were warmed."""
    # Reversed, so that it shares no cached prefix blocks with the measured requests.
    warm = {"id": "warmup", "prompt_token_ids": prompt[::-1], "max_tokens": 8, "ignore_eos": True,
            "temperature": 0.0}
    served: set[str] = set()
    limit_s = min(timeout_s, WARMUP_LIMIT_S)
    deadline = time.monotonic() + limit_s
    attempt = 0
    while time.monotonic() < deadline:
        job_id = f"bench-warmup-{tag}-{attempt}"
        producer.submit(warm, job_id=job_id)
        wait_done(producer.redis, job_id, 1, pool, timeout_s, "warm-up")
        new = workers_of(out, job_id) - served
        served |= new
        if len(served) >= workers:
            return
        attempt += 1
        if not new:
            time.sleep(WARMUP_PAUSE_S)
    log(f"mqinfer online: {len(served)} of {workers} workers ran a warm-up request within {limit_s:g}s; "
        "the others start cold")


def workers_of(out: Path, job_id: str) -> set[str]:
    """The workers that wrote rows of ``job_id`` under ``out/results``."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    table = ds.dataset(out / "results", format="parquet", partitioning="hive").to_table(
        columns=["worker"], filter=pc.field("job_id") == job_id)
    return {w for w in table.column("worker").to_pylist() if w}


def run_online(args: argparse.Namespace, spec: ModelSpec, requests: list[dict[str, Any]], url: str, producer,
               pool: WorkerPool, out: Path, tag: str, rates: list[float], setting: float | str) -> list[OnlinePoint]:
    """Warm each worker with one request, then one Poisson run per rate (prompts salted per rate:
    ``unshared_prompts``); the workers are stopped at the end."""
    from mqinfer.client import Producer

    try:
        pool.start()
        log(f"mqinfer online: starting {args.workers} worker(s) (max wait {wait_label(setting)}), "
            "waiting for a warm-up request on each")
        warm_workers(producer, pool, out, requests[0]["prompt_token_ids"], tag, args.workers, args.timeout_s)
        points = []
        for k, rate in enumerate(rates):
            job_id = f"bench-{tag}-r{k}"
            arrivals = poisson_arrivals(len(requests), rate, args.seed + k)
            lags: list[float] = []
            errors: list[BaseException] = []
            submitter = Producer(url, stream=STREAM)
            salted = unshared_prompts(requests, k, spec.vocab_size, spec.min_token_id)
            thread = threading.Thread(target=submit_on_schedule, name="bench-submitter",
                                      args=(submitter, salted, arrivals, job_id, lags, errors), daemon=True)
            log(f"mqinfer online: {len(requests)} requests at {rate:g} req/s (about {arrivals[-1]:.0f}s of arrivals)")
            thread.start()
            try:
                wait_done(producer.redis, job_id, len(requests), pool, args.timeout_s, f"online {rate:g} req/s")
            finally:
                thread.join(timeout=5)
                submitter.redis.close()
            if errors:
                raise RuntimeError(f"submitting at {rate:g} req/s failed: {errors[0]}")
            # Rows are durable before their id joins the done set, so they can be read while workers run.
            timings, _ = read_results(out, job_id, requests)
            lag = sorted(lags)
            summary = summarize(timings)
            points.append(OnlinePoint(rate, summary, lag[int(0.99 * (len(lag) - 1))] if lag else 0.0, timings,
                                      setting, point_budget(summary, setting)))
        return points
    finally:
        pool.stop()
