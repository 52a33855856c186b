"""The batcher's max wait, held by an idle worker against a real Redis server: a lone request
starts when its wait ends, not when the server's timer next ticks.

A server ends a blocked read that nothing woke at its next timer tick (every 100 ms), so a worker
must never let the server hold a read past the moment something it holds comes due. The first
test checks that rule on every read, on the harness's clock; the second measures the lateness it
saves on the wall clock, a timing test that a busy machine's scheduling delays can fail, hence
among the slow ones (``pytest -m slow``) to run on a quiet machine."""

from __future__ import annotations

import random
import time

import pytest

from mqinfer.workers.queue.ingest import SERVER_TICK_S
from tests.workers.harness import WorkerHarness, request, submit

MAX_WAIT_S = 0.15
REQUESTS = 15
# A request counts as late when it started this long after its max wait ended.
LATE_S = 0.040


class WallClock:
    """The harness's clock interface on the real time: the wait is real here."""

    def __call__(self) -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        pass


def test_no_read_blocks_on_the_server_past_what_the_worker_holds_comes_due(redis_url, redis_client, tmp_path):
    h = WorkerHarness(redis_url, tmp_path / "out", max_wait_ms=350).start()
    ingest = h.worker.ingest
    ingest.block_reads = True  # wait for arrivals as a serving worker does
    reads = []  # (block ms, seconds until something held comes due), at each read
    real = ingest.redis.xreadgroup

    def spy(*args, block=None, **kwargs):
        reads.append((block, ingest._until_due()))
        return real(*args, block=block, **kwargs)

    ingest.redis.xreadgroup = spy
    try:
        submit(redis_client, request("held", max_tokens=1))
        h.until(lambda: h.results(), max_turns=100_000, what="the held request's row")
    finally:
        h.stop()
    held = [(block, due) for block, due in reads if due is not None and due > 0]
    # With 350 ms ahead a read may block for 250: the server's late end still comes before the
    # request is due (from under two ticks ahead reads do not block, and the loop naps instead).
    # A read that blocked for the whole wait would exceed that by a tick, 100 ms; the 25 ms
    # allowed is for the time between the worker's reckoning and this spy's.
    assert all(block is None or block <= 1000 * (due - SERVER_TICK_S) + 25 for block, due in held), reads
    assert any(block for block, due in held if due >= 2 * SERVER_TICK_S), reads


@pytest.mark.slow
def test_an_idle_worker_starts_a_lone_request_when_its_max_wait_ends(redis_url, redis_client, tmp_path):
    # A server ends a blocked read that nothing woke at its next tick (every 100 ms), so a worker
    # that blocked for the whole max wait started a lone request 0-100 ms late, more than LATE_S
    # late six times in ten; each request here is sent at a random point of the tick, and at most
    # two of fifteen such requests are that late by chance about once in 3,500 runs. Counting the
    # late ones rather than averaging keeps a busy machine's one or two slow wake-ups from
    # deciding the test.
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
    late = [x for x in lateness if x > LATE_S]
    assert len(late) <= 2, [round(1000 * x, 1) for x in lateness]
