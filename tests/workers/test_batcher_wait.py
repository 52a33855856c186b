"""The batcher's max wait, held by an idle worker against a real Redis server: a lone request
starts when its wait ends, not when the server's timer next ticks."""

from __future__ import annotations

import random
import statistics
import time

from tests.workers.harness import WorkerHarness, request, submit

MAX_WAIT_S = 0.15
REQUESTS = 9


class WallClock:
    """The harness's clock interface on the real time: the wait is real here."""

    def __call__(self) -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        pass


def test_an_idle_worker_starts_a_lone_request_when_its_max_wait_ends(redis_url, redis_client, tmp_path):
    # A server ends a blocked read that nothing woke at its next tick (every 100 ms), so a worker
    # that blocked for the whole max wait started a lone request 0-100 ms late (50 on average);
    # each request here is sent at a random point of the tick, and the mean of nine such lateness
    # figures falls below 25 ms by chance about once in 500 runs.
    h = WorkerHarness(redis_url, tmp_path / "out", clock=WallClock(), max_wait_ms=int(1000 * MAX_WAIT_S)).start()
    h.worker.ingest.block_reads = True  # wait for arrivals as a serving worker does
    phase = random.Random(7)
    try:
        for k in range(REQUESTS):
            time.sleep(phase.uniform(0.0, 0.1))
            submit(redis_client, request(f"lone-{k}", max_tokens=1))
            h.until(lambda: len(h.results()) == k + 1, max_turns=100_000, what=f"request {k}'s row")
    finally:
        h.stop()
    # From the entry's arrival at the server (its id's time) to the step that started it.
    lateness = [(r["started_at"] - r["enqueued_at"]).total_seconds() - MAX_WAIT_S for r in h.results()]
    assert min(lateness) > -0.005, "a lone request started before its max wait ended"
    assert statistics.mean(lateness) < 0.025, [round(1000 * x, 1) for x in lateness]
