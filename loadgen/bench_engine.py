"""The engine side of ``mqinfer bench`` (``loadgen/bench.py``): one run of mqinfer through the real
pipeline (an embedded server, the producer, ``--workers`` worker processes, the results written),
offline or as the online sweep, its reruns as a comparison's variant (``--compare``), and the
alternating rounds of ``--rounds``. ``run_engine`` is also what ``mqinfer plan`` and ``gpu_bench``
run the pipeline with.
"""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqinfer.config import ENGINE_OPTIONS
from mqinfer.loadgen.bench_model import ModelSpec
from mqinfer.loadgen.bench_offline import overhead_share, run_offline, speculation_summary
from mqinfer.loadgen.bench_online import OnlinePoint, half_rate, request_rate, run_online
from mqinfer.loadgen.bench_options import (
    GLOBAL_SCOPE, HALF, INPUT_ORDER, OTHER_LAYOUT, UNQUANTIZED, UNSPECULATIVE,
)
from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, worker_argv, worker_wait_setting
from mqinfer.loadgen.metrics import RequestTiming, RunSummary, summarize
from mqinfer.loadgen.prefix_cache import describe as describe_hits
from mqinfer.loadgen.prefix_cache import prefix_cache_report
from mqinfer.schemas.keys import shard_streams


@dataclass
class EngineRun:
    offline: RunSummary | None
    online: list[OnlinePoint]
    timings: list[RequestTiming]  # offline only
    outputs: dict[str, list[int]]  # offline only
    half_rate: float | None = None  # the rate `--rate half` stood for
    overhead: dict[str, Any] | None = None  # offline only: see overhead_share
    prefix_cache: dict[str, Any] | None = None  # offline only: see loadgen/prefix_cache.py
    routing: dict[str, Any] | None = None  # offline with --shards > 1: the work per shard, the spill
    speculation: dict[str, Any] | None = None  # offline with --speculative: see speculation_summary


def _with_wait(args: argparse.Namespace, max_wait_ms: float | str | None) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_wait_ms": max_wait_ms})


def run_engine(args: argparse.Namespace, spec: ModelSpec, requests: list[dict[str, Any]], scratch: Path
               ) -> EngineRun:
    """One offline run, or the online sweep (after an offline run for `--rate half`; once per
    `--compare-wait` setting), through the real pipeline."""
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    out = Path(args.out).resolve() if args.out else scratch / "out"
    out.mkdir(parents=True, exist_ok=True)
    server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
    shards = getattr(args, "shards", 1)
    streams = shard_streams(STREAM, shards) if shards > 1 else None
    if streams:
        from mqinfer.client import Client

        producer = Client(server.url, stream=STREAM, shards=shards, route=args.route,
                          prefix_cache_scope=args.prefix_cache_scope)
    else:
        producer = Producer(server.url, stream=STREAM)
    tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    waits = args.compare_wait or [args.max_wait_ms]

    def pool(wait: float | str | None, log_dir: Path) -> WorkerPool:
        return WorkerPool(worker_argv(_with_wait(args, wait), spec.arg, server.url, out), args.workers, log_dir, out,
                          streams)

    try:
        if args.mode == "offline":
            workers = pool(waits[0], out / "logs")
            job_id = f"bench-{tag}"
            timings, outputs = run_offline(args, requests, producer, workers, out, job_id)
            block_size = args.block_size or next(o.default for o in ENGINE_OPTIONS if o.name == "block_size")
            hits = prefix_cache_report(requests, out, job_id, block_size)
            log(describe_hits(hits))
            routing = None
            if streams:
                router = producer.router
                routing = {"shards": shards, "route": args.route, "load": list(router.load),
                           "spilled": router.spilled, "routed": router.routed}
                log(f"routing {args.route}: work per shard {router.load}, {router.spilled} of {router.routed} "
                    "requests spilled over")
            summaries = workers.busy_summaries()
            return EngineRun(summarize(timings), [], timings, outputs, overhead=overhead_share(summaries),
                             prefix_cache=hits, routing=routing, speculation=speculation_summary(summaries))
        offline, timings, outputs, half = None, [], {}, None
        if HALF in args.rate:
            # Its own workers, stopped before the online runs: they start with an empty prefix cache.
            timings, outputs = run_offline(args, requests, producer, pool(waits[0], out / "logs" / "offline"), out,
                                           f"bench-{tag}")
            offline = summarize(timings)
            half = half_rate(offline)
            log(f"--rate half: offline {offline.num_requests - offline.num_errors} requests over "
                f"{offline.span_s:.2f}s = {request_rate(offline):.3g} req/s; online at {half:g} req/s")
        rates = [half if r == HALF else r for r in args.rate]
        points: list[OnlinePoint] = []
        for w, wait in enumerate(waits):
            setting = worker_wait_setting(wait)
            log_dir = out / "logs" if len(waits) == 1 else out / "logs" / f"wait-{setting}"
            points += run_online(args, spec, requests, server.url, producer, pool(wait, log_dir), out, f"{tag}-w{w}",
                                 rates, setting)
        return EngineRun(offline, points, timings, outputs, half)
    finally:
        if streams:
            producer.close(delete_reply_stream=False)
        else:
            producer.redis.close()
        server.stop()


def variant_args(args: argparse.Namespace, variant: str | None, folder: str) -> argparse.Namespace:
    """The arguments of an offline rerun of mqinfer: with ``variant``'s one change (None: as
    given), writing under ``--out``'s ``folder`` when there is an ``--out``."""
    change = {UNQUANTIZED: {"quantization": "none", "kv_cache_dtype": "auto"},
              UNSPECULATIVE: {"speculative": "none"},
              INPUT_ORDER: {"order": "input", "route": "id"},
              OTHER_LAYOUT: other_layout(args),
              GLOBAL_SCOPE: {"prefix_cache_scope": "global"},
              None: {}}[variant]
    return argparse.Namespace(**{**vars(args), **change, "mode": "offline", "rate": [], "compare_wait": None,
                                 "out": str(Path(args.out) / folder) if args.out else None})


def other_layout(args: argparse.Namespace) -> dict[str, Any]:
    """The workers and threads of the other CPU layout than ``args``' (resolved counts): one worker
    with all their threads when there were several workers, else one single-threaded worker per
    thread of the one."""
    cores = args.workers * (args.num_threads or 1)
    if args.workers > 1:
        return {"workers": 1, "num_threads": cores}
    return {"workers": cores, "num_threads": 1}


def more_rounds(args: argparse.Namespace, spec: ModelSpec, requests: list[dict[str, Any]], scratch: Path,
                 variant: str, first: tuple[float, float]) -> dict[str, Any]:
    """Rounds 2..R of mqinfer against ``variant``, alternating which runs first; ``first`` is
    round 1's (mqinfer, variant) throughput. Every round's figures, their ratios and the median."""
    import statistics

    pairs = [first]
    for r in range(1, args.rounds):
        order = [variant, None] if r % 2 else [None, variant]
        got: dict[str | None, float] = {}
        for which in order:
            folder = f"round-{r + 1}-{which or 'mqinfer'}"
            log(f"round {r + 1} of {args.rounds}: {which or 'mqinfer'}")
            run = run_engine(variant_args(args, which, folder), spec, requests, scratch / folder)
            got[which] = run.offline.throughput
        pairs.append((got[None], got[variant]))
        log(f"round {r + 1}: mqinfer {got[None]:.1f} tok/s, {variant} {got[variant]:.1f} tok/s")
    ratios = [ours / other if other else 0.0 for ours, other in pairs]
    return {"order": ["mqinfer first" if r % 2 == 0 else f"{variant} first" for r in range(len(pairs))],
            "mqinfer_tok_s": [p[0] for p in pairs], "variant_tok_s": [p[1] for p in pairs],
            "ratios": ratios, "median_ratio": statistics.median(ratios)}


__all__ = ["EngineRun", "more_rounds", "other_layout", "run_engine", "variant_args"]
