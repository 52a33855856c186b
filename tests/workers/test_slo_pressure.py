"""Latency targets under KV pressure, through a real worker (the in-process harness: the tiny model
in float32, real Parquet rows, the embedded server): with a KV cache far too small for the bulk
backlog and swap preemption, bulk sequences are swapped to host memory and back while interactive
requests run, no interactive request is ever preempted, nothing is lost or repeated, and every
greedy output equals that of a roomy cache."""

from __future__ import annotations

from mqinfer.workers.config import EngineConfig
from tests.workers.harness import WorkerHarness, submit
from tests.workers.test_slo_worker import backlog, chats


def run_pressured(redis_url, redis_client, out, engine: EngineConfig) -> tuple[dict[str, list[int]], dict]:
    """The backlog, then six interactive requests beside it; every row's output tokens, and what
    the scheduler did (preemptions, swaps, interactive requests ever preempted)."""
    redis_client.flushall()
    w = WorkerHarness(redis_url, out, engine=engine, max_batch=64).start()
    scheduler = w.worker.engine.scheduler
    preempted_interactive: set[str] = set()

    def watch(done):
        def predicate():
            preempted_interactive.update(r.request_id for r in scheduler._requests.values()
                                         if r.interactive and r.num_preemptions)
            return done()
        return predicate

    for obj in backlog():
        submit(redis_client, obj)
    w.until(watch(lambda: scheduler.num_running >= 2), what="the backlog running")
    w.turn(12)
    for obj in chats(targets=True):
        submit(redis_client, obj)
    w.until(watch(lambda: len(w.results()) == 30), max_turns=5000, what="every row")
    rows = w.results()
    stats = {"preemptions": scheduler.num_preemptions_total, "swaps": scheduler.num_swaps_total,
             "planned": scheduler.slo.num_planned_steps, "preempted_interactive": preempted_interactive}
    w.stop()
    w.worker.redis.close()
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30  # none lost, none twice
    assert all(r["finish_reason"] == "length" for r in rows), [r["finish_reason"] for r in rows]
    return {r["id"]: r["output_token_ids"] for r in rows}, stats


def test_bulk_is_swapped_under_kv_pressure_and_outputs_equal_a_roomy_cache(redis_url, redis_client, tmp_path):
    roomy, roomy_stats = run_pressured(redis_url, redis_client, tmp_path / "roomy",
                                       EngineConfig(num_threads=1, dtype="float32"))
    # 40 blocks of 8 tokens (320 slots) for 24 bulk requests of 45 to 120 tokens and the six chats
    # (up to 5 blocks each: they fit together, so only bulk sequences have to give way).
    small = EngineConfig(num_threads=1, dtype="float32", num_kv_blocks=40, block_size=8,
                         preemption_mode="swap", swap_space_gib=0.25)
    pressured, stats = run_pressured(redis_url, redis_client, tmp_path / "small", small)
    assert roomy_stats["preemptions"] == 0
    assert stats["swaps"] > 0 and stats["planned"] > 0, stats
    assert stats["swaps"] == stats["preemptions"], stats  # the host pool held every victim's KV
    assert not stats["preempted_interactive"], stats
    assert pressured == roomy
