"""KV tiers in a worker: cost rows count the prefix tokens each tier served, Prometheus shows the
tiers' counters, and a worker restarted on the same disk tier computes no shared prefix again."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from mqinfer.workers.config import EngineConfig
from tests.workers.harness import WorkerHarness, submit

BLOCK = 16


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def workload(seed: int = 1) -> list[dict]:
    """Four requests per prefix over five 64-token prefixes, round robin: with 14 KV blocks no prefix is
    still cached when it comes back."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(4 * BLOCK)] for _ in range(5)]
    return [{"id": f"q{i}", "job_id": "tiers", "prompt_token_ids": prefixes[i % 5] + [rng.randrange(256), i % 256],
             "max_tokens": 3, "temperature": 0, "ignore_eos": True} for i in range(20)]


def start(redis_url, out, consumer, disk):
    engine = EngineConfig(num_threads=1, kv_cache_dtype="int8", num_kv_blocks=14, max_num_seqs=2, max_model_len=256,
                          kv_host_cache_gib=0.01, kv_disk_cache=str(disk))
    return WorkerHarness(redis_url, out, consumer=consumer, engine=engine, max_batch=2).start()


def drain(h: WorkerHarness, ids: set[str]) -> list[dict]:
    h.until(lambda: ids <= {r["id"] for r in h.results()}, max_turns=3000, advance_s=0.01, what="every row")
    h.stop()
    return [c for c in h.costs() if c["kind"] == "request" and c["id"] in ids]


def test_cost_rows_and_metrics_count_prefix_tokens_per_tier(redis_url, redis_client, tmp_path):
    requests = workload()
    h = start(redis_url, tmp_path / "out", "tiers-1", tmp_path / "kv")
    for r in requests:
        submit(redis_client, r)
    costs = {c["id"]: c for c in drain(h, {r["id"] for r in requests})}
    later = [f"q{i}" for i in range(5, 20)]
    # Every later request found its prefix, in the device cache or (evicted there) in the host tier.
    assert all(costs[i]["cached_prompt_tokens"] == 4 * BLOCK for i in later)
    assert all(costs[f"q{i}"]["cached_prompt_tokens"] == 0 for i in range(5))
    host = sum(c["host_cached_tokens"] for c in costs.values())
    assert host >= 5 * BLOCK and host % (4 * BLOCK) == 0
    assert all(c["disk_cached_tokens"] == 0 and c["shared_cached_tokens"] == 0 for c in costs.values())
    text = generate_latest(h.metrics.registry).decode()
    assert f'mqinfer_kv_tier_hits_total{{tier="host"}} {host / BLOCK}' in text
    assert f'mqinfer_kv_tier_prefix_tokens_total{{tier="host"}} {float(host)}' in text
    assert 'mqinfer_kv_tier_rejected_blocks_total{reason="corrupt",tier="disk"} 0.0' in text
    assert 'mqinfer_kv_tier_stored_blocks{tier="disk"} 20.0' in text

    # A new worker on the same disk tier (a restart): every prefix comes from disk, outputs unchanged.
    before = {r["id"]: r["output_token_ids"] for r in h.results()}
    again = [dict(r, job_id="tiers-again") for r in requests]
    h2 = start(redis_url, tmp_path / "out2", "tiers-2", tmp_path / "kv")
    for r in again:
        submit(redis_client, r)
    costs2 = {c["id"]: c for c in drain(h2, {r["id"] for r in again})}
    assert all(c["cached_prompt_tokens"] == 4 * BLOCK for c in costs2.values())
    assert sum(c["disk_cached_tokens"] for c in costs2.values()) == 5 * 4 * BLOCK  # each prefix read once
    assert {r["id"]: r["output_token_ids"] for r in h2.results()} == before
