"""Prefix-cache hits of a job against the ideal, from the workers' cost rows.

A request's prompt can be found in the prefix cache in whole KV blocks, and never its last token
(the engine computes at least one token to get the first output's logits): at most
``(len(prompt) - 1) // block_size`` blocks. The ideal computes each distinct block, a block being
identified by every token up to its end, once and finds it cached every other time:

- ``ideal_once``: once in the whole job (one worker, or routing that sends every prefix to one);
- ``ideal_per_worker``: once per worker that served a request needing it (what routing-blind
  placement can reach at best).

``hit_tokens`` is what the workers report: the sum of ``cached_prompt_tokens`` over the job's
request cost rows (one per request; at-least-once duplicates count once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence


def ideal_hit_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """Prompt tokens found in the cache when each distinct cacheable block is computed once."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    hits = 0
    for prompt in prompts:
        parent = -1  # the block chain so far, as the index of its last block in `seen`
        for k in range((len(prompt) - 1) // block_size):
            key = (parent, tuple(prompt[k * block_size:(k + 1) * block_size]))
            found = seen.get(key)
            if found is None:
                found = seen[key] = len(seen)
            else:
                hits += block_size
            parent = found
    return hits


def prefix_cache_report(requests: list[dict[str, Any]], out: Path, job_id: str, block_size: int) -> dict[str, Any]:
    """Hit tokens of ``job_id`` (cost rows under ``out/costs``) against both ideals."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    costs = out / "costs"
    if not costs.exists():
        raise RuntimeError(f"the workers wrote no cost rows under {costs}")
    table = ds.dataset(costs, format="parquet", partitioning="hive").to_table(
        columns=["kind", "id", "worker", "cached_prompt_tokens"],
        filter=(pc.field("job_id") == job_id) & (pc.field("kind") == "request"))
    worker_of: dict[str, str] = {}
    hits = 0
    for rid, worker, cached in zip(table.column("id").to_pylist(), table.column("worker").to_pylist(),
                                   table.column("cached_prompt_tokens").to_pylist()):
        if rid in worker_of:
            continue
        worker_of[rid] = worker
        hits += int(cached or 0)
    prompts = {r["id"]: r["prompt_token_ids"] for r in requests}
    by_worker: dict[str, list[Sequence[int]]] = {}
    for rid, worker in worker_of.items():
        if rid in prompts:
            by_worker.setdefault(worker, []).append(prompts[rid])
    ideal_once = ideal_hit_tokens(prompts.values(), block_size)
    ideal_per_worker = sum(ideal_hit_tokens(p, block_size) for p in by_worker.values())
    prompt_tokens = sum(len(p) for p in prompts.values())
    return {
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hits,
        "ideal_once": ideal_once,
        "ideal_per_worker": ideal_per_worker,
        "share_of_ideal_once": hits / ideal_once if ideal_once else None,
        "share_of_ideal_per_worker": hits / ideal_per_worker if ideal_per_worker else None,
        "requests_per_worker": sorted(len(p) for p in by_worker.values()),
    }


def describe(report: dict[str, Any]) -> str:
    """One line for the bench's log."""
    def pct(x):
        return "n/a" if x is None else f"{100.0 * x:.1f}%"

    return (f"prefix cache: {report['hit_tokens']} of {report['prompt_tokens']} prompt tokens found cached; "
            f"{pct(report['share_of_ideal_per_worker'])} of the ideal per worker ({report['ideal_per_worker']}), "
            f"{pct(report['share_of_ideal_once'])} of the ideal once per job ({report['ideal_once']})")


__all__ = ["describe", "ideal_hit_tokens", "prefix_cache_report"]
