"""The worker loop's Redis backoff: calls skipped while Redis is away, retries spaced twice as far
each time, and Redis counted back only when a round trip to it succeeds."""

from __future__ import annotations

import logging

import redis

from mqinfer.workers.queue.reconnect import MAX_BACKOFF_S, Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_call_that_needs_no_redis_does_not_count_as_redis_back(caplog):
    clock = Clock()
    down = {"on": True}
    pings = []

    def ping():
        pings.append(clock.now)
        if down["on"]:
            raise redis.exceptions.ConnectionError("refused")

    def read():
        if down["on"]:
            raise redis.exceptions.ConnectionError("refused")
        return "entries"

    backoff = Backoff(clock=clock, busy=lambda: True, ping=ping)
    caplog.set_level(logging.INFO, logger="mqinfer.worker")
    assert backoff(read) is None and backoff.delay == 0.1
    # Skipped until the retry time, whatever the call.
    assert backoff(lambda: "no redis needed") is None and not pings
    delays = []
    for _ in range(8):
        clock.now = backoff.retry_at
        # An ack with nothing to ack touches no Redis: before it, the ping finds Redis still away.
        assert backoff(lambda: "nothing to ack") is None
        delays.append(backoff.delay)
    assert delays == [0.2, 0.4, 0.8, 1.6, 3.2, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert "reachable again" not in caplog.text
    down["on"] = False
    clock.now = backoff.retry_at
    assert backoff(read) == "entries" and backoff.delay == 0.0
    assert caplog.text.count("redis reachable again") == 1
    # Healthy again: no ping before each call.
    before = len(pings)
    assert backoff(read) == "entries" and len(pings) == before


def test_without_a_ping_a_success_ends_the_backoff():
    clock = Clock()
    backoff = Backoff(clock=clock, busy=lambda: True)

    def fail():
        raise redis.exceptions.TimeoutError("slow")

    assert backoff(fail) is None and backoff.delay == 0.1
    clock.now = backoff.retry_at
    assert backoff(lambda: 7) == 7 and backoff.delay == 0.0
