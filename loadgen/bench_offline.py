"""The offline run of `mqinfer bench`: every request submitted before any worker reads.

As `mqinfer run` does, the workers are started first and the requests submitted once every one
has joined its consumer group (before it loads the model): a worker that is ready first then
leaves the others their share of the backlog instead of taking it whole while they load.

Throughput counts the tokens the requests asked for over first started -> last finished, read
back from the result rows; ``overhead_share`` turns the workers' busy-time lines into the share of
their time spent outside the model's forward pass.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_pool import STREAM, WorkerPool, log, read_results, wait_done
from mqinfer.loadgen.metrics import RequestTiming
from mqinfer.run_progress import wait_for_workers
from mqinfer.schemas import keys


def overhead_share(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The overhead: the share of the workers' busy time outside the model's forward pass,
    with the time by phase (engine phases plus ``other``: ingest, batcher, sinks, acks, replies)."""
    busy = sum(float(s.get("busy_s") or 0.0) for s in summaries)
    if busy <= 0:
        return None
    phases: dict[str, float] = {}
    for s in summaries:
        for name, value in (s.get("phases_s") or {}).items():
            phases[name] = phases.get(name, 0.0) + float(value)
        phases["other"] = phases.get("other", 0.0) + float(s.get("other_s") or 0.0)
    forward = phases.get("forward", 0.0)
    return {"workers": len(summaries), "busy_s": busy, "phases_s": phases,
            "outside_forward_share": 1.0 - forward / busy}


def speculation_summary(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Speculative decoding's totals over the workers' exit summaries: tokens proposed, accepted
    and emitted in checking steps, request-steps that checked proposals, with the acceptance rate
    and tokens per checking step; None when no worker speculated."""
    found = [s["speculation"] for s in summaries if s.get("speculation")]
    if not found:
        return None
    total = {name: sum(int(s.get(name) or 0) for s in found)
             for name in ("proposed_tokens", "accepted_tokens", "emitted_tokens", "num_checks", "steps")}
    proposed, checks = total["proposed_tokens"], total["num_checks"]
    return {"proposer": found[0].get("proposer"), "workers": len(found), **total,
            "acceptance": total["accepted_tokens"] / proposed if proposed else None,
            "tokens_per_check": total["emitted_tokens"] / checks if checks else None}


def run_offline(args: argparse.Namespace, requests: list[dict[str, Any]], producer, pool: WorkerPool, out: Path,
                job_id: str) -> tuple[list[RequestTiming], dict[str, list[int]]]:
    """The workers started, every request submitted once all have joined their groups; stopped
    when all are done (their busy time summaries are then in ``pool.busy_summaries()``)."""
    try:
        log(f"mqinfer offline: starting {args.workers} worker(s)")
        pool.start()
        wait_for_workers(producer.redis, [keys.request_stream(s) for s in pool.streams or [STREAM]], keys.GROUP,
                         pool.procs)
        feed = requests
        if getattr(args, "order", "input") == "prefix":
            # Prefix-tree order, as `mqinfer run` feeds a job (the bench's prompts are token ids).
            feed = sorted(requests, key=lambda r: tuple(r["prompt_token_ids"]))
        if pool.streams:
            producer.submit_many(feed, job_id=job_id, reply=False)
        else:
            producer.submit_many(feed, job_id=job_id)
        log(f"mqinfer offline: {len(requests)} requests submitted"
            + (f" in {args.order} order" if getattr(args, "order", None) else ""))
        wait_done(producer.redis, job_id, len(requests), pool, args.timeout_s, "mqinfer offline")
    finally:
        pool.stop()
    return read_results(out, job_id, requests)
