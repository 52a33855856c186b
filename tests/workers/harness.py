"""An in-process worker for tests: a real :class:`Worker` (real engine with the tiny model, real
Parquet sinks) against the embedded Redis server of ``tests/conftest.py``, on a clock the test
moves, driven one loop iteration at a time. No subprocess and no sleeping: what the loop does
after a given number of turns, and at a given time, is what the test asserts.

Redis keeps its own time for entries' idle times (``XPENDING``, ``XAUTOCLAIM``); a test makes an
entry look idle with ``XCLAIM ... IDLE ms`` (:func:`set_idle`) instead of waiting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mqinfer.ops.metrics import WorkerMetrics
from mqinfer.schemas import keys
from mqinfer.workers.config import EngineConfig, WorkerConfig
from mqinfer.workers.queue.worker import Worker
from tests.helpers import FakeClock, rows

STREAM = keys.request_stream("requests")
GROUP = keys.GROUP


class WorkerHarness:
    """``config``: WorkerConfig fields (the harness defaults: no batcher wait, a 1 s claim idle
    time, a 0.5 s flush interval, one model thread)."""

    def __init__(self, redis_url: str, out: Path, *, consumer: str = "harness-1", clock: FakeClock | None = None,
                 budget_guard=None, **config) -> None:
        self.clock = clock or FakeClock(time.time())
        self.out = Path(out)
        settings = dict(consumer=consumer, max_wait_ms=0, claim_idle_ms=1000, flush_interval_s=0.5,
                        engine=EngineConfig(num_threads=1))
        settings.update(config)
        self.metrics = WorkerMetrics()
        self.worker = Worker(WorkerConfig(redis_url=redis_url, out_dir=self.out, **settings), metrics=self.metrics,
                             budget_guard=budget_guard, clock=self.clock)

    @property
    def consumer(self) -> str:
        return self.worker.consumer

    def start(self) -> "WorkerHarness":
        self.worker.start()
        self.worker.ingest.block_reads = False  # the test drives the loop: never wait for entries
        return self

    def turn(self, n: int = 1, *, advance_s: float = 0.0) -> None:
        """``n`` loop iterations, the clock moved ``advance_s`` before each."""
        for _ in range(n):
            self.clock.advance(advance_s)
            self.worker.iteration()

    def until(self, predicate, *, max_turns: int = 500, advance_s: float = 0.0, what: str = "condition"):
        """Turn until ``predicate()`` holds; returns its value."""
        for _ in range(max_turns):
            value = predicate()
            if value:
                return value
            self.turn(advance_s=advance_s)
        raise AssertionError(f"not reached within {max_turns} iterations: {what}")

    def stop(self) -> None:
        """What SIGTERM leads to: drain, then the exit summary."""
        self.worker.drain()
        self.worker.close()

    def running(self, entry_id: str) -> bool:
        """The engine holds the entry's request."""
        return self.worker.engine.scheduler.get_request(entry_id) is not None

    def results(self) -> list[dict]:
        return rows(self.out / "results")

    def costs(self) -> list[dict]:
        return rows(self.out / "costs")


def request(rid: str, max_tokens: int = 4, **fields) -> dict:
    return {"id": rid, "prompt_token_ids": [256, 10, 11, 12], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **fields}


def submit(client, obj: dict) -> str:
    """XADD one request as a JSON stream entry; its entry id."""
    entry_id = client.xadd(STREAM, {"json": json.dumps(obj), "v": "1"})
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def pending(client) -> dict[str, dict]:
    """Every pending entry of the group: entry id -> {consumer, idle ms, times delivered}."""
    out = {}
    for p in client.xpending_range(STREAM, GROUP, "-", "+", 1000):
        out[p["message_id"].decode()] = {"consumer": p["consumer"].decode(), "idle": p["time_since_delivered"],
                                         "delivered": p["times_delivered"]}
    return out


def read_as(client, consumer: str, count: int = 10) -> list[str]:
    """Deliver new entries to ``consumer`` (a worker that then dies without acking)."""
    got = client.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count) or []
    return [e.decode() for _, entries in got for e, _ in entries]


def set_idle(client, consumer: str, entry_id: str, idle_ms: int, *, delivered: int | None = None) -> None:
    """Make a pending entry of ``consumer`` look idle for ``idle_ms`` (and delivered ``delivered``
    times), without counting a delivery."""
    client.xclaim(STREAM, GROUP, consumer, 0, [entry_id], idle=idle_ms, retrycount=delivered, justid=True)
