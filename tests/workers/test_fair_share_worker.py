"""Fair share between tenants through a real worker (the in-process harness: real engine with the
tiny model, the embedded server): a light tenant's requests queued behind a heavy tenant's flood
reach the engine while it is full, and start ahead of the heavy requests waiting there."""

from __future__ import annotations

import pytest

from mqinfer.workers.config import EngineConfig
from tests.workers.harness import WorkerHarness, pending, read_as, request, submit


@pytest.fixture
def worker(redis_url, tmp_path):
    # Four requests run at once and at most four are read at a time: the worker keeps reading
    # into a waiting queue of max(4, 2 x 4) = 8 requests while its engine is full.
    h = WorkerHarness(redis_url, tmp_path / "out", max_batch=4,
                      engine=EngineConfig(num_threads=1, max_num_seqs=4)).start()
    yield h
    h.worker.redis.close()


def test_a_light_tenant_behind_a_flood_starts_ahead_of_the_flood_waiting_in_the_engine(worker, redis_client):
    heavy = [submit(redis_client, request(f"h{i}", max_tokens=8, tenant="heavy")) for i in range(16)]
    light = [submit(redis_client, request(f"l{i}", max_tokens=8, tenant="light")) for i in range(3)]
    assert len(heavy) == 16 and len(light) == 3
    # Each turn is one engine step and 10 ms on the worker's clock, so start times tell steps apart.
    worker.until(lambda: len(worker.results()) == 19, max_turns=400, advance_s=0.01, what="every row")
    rows = {r["id"]: r for r in worker.results()}
    assert all(r["finish_reason"] == "length" and r["tenant"] == ("light" if r["id"][0] == "l" else "heavy")
               for r in rows.values())
    light_started = max(rows[f"l{i}"]["started_at"] for i in range(3))
    overtaken = sorted(f"h{i}" for i in range(16) if rows[f"h{i}"]["started_at"] > light_started)
    # The light requests were read while the engine ran four heavy requests and held more waiting;
    # they then went first. Read only once nothing waits, or admitted first come first served,
    # they would start after every heavy request.
    assert len(overtaken) >= 3, overtaken
    # started_at is when a request first runs: the overtaken heavy requests joined the engine's
    # waiting queue before the light ones did, and started after them.
    assert all(r["started_at"] <= r["first_token_at"] for r in rows.values())


def test_a_drain_finishes_what_runs_and_hands_back_what_waits_in_the_engine(worker, redis_client):
    """Requests read into the engine's waiting queue have never run: a draining worker hands them
    back at once with the rest, instead of computing them before it may exit."""
    entries = [submit(redis_client, request(f"r{i}", max_tokens=20)) for i in range(10)]
    worker.until(lambda: worker.worker.engine.scheduler.num_waiting >= 4, what="requests waiting in the engine")
    scheduler = worker.worker.engine.scheduler
    running = [e for e in entries if worker.running(e) and scheduler.get_request(e).status.name == "RUNNING"]
    assert len(running) == 4
    held = set(worker.worker.ownership.inflight)  # read by this worker: running, waiting or batched
    assert len(held - set(running)) >= 4
    worker.stop()
    # Only what ran has rows; what waited is pending again, claimable at once by another worker
    # without counting a delivery; what was never read is still unread.
    assert sorted(r["id"] for r in worker.results()) == sorted(f"r{entries.index(e)}" for e in running)
    handed_back = pending(redis_client)
    assert set(handed_back) == held - set(running)
    assert all(p["consumer"] == "mqinfer-handback" and p["delivered"] == 0 for p in handed_back.values())
    assert sorted(read_as(redis_client, "another")) == sorted(set(entries) - held)
