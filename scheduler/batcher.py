"""The dual-threshold dynamic batcher between stream ingest and the engine.

Items wait here until one of two thresholds is met: ``max_batch`` items are waiting, or the
oldest has waited ``max_wait_ms``. That holds only while the engine is idle, where a bigger
first batch pays for itself. While the engine is busy, items are released at once, so that
they join the running batch at the next step (continuous batching) instead of waiting.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Release up to a microsecond early: a caller that slept exactly the advised time must not be
# told "not yet" because of float rounding (a unix-time float has ~0.25 us resolution).
_EARLY_S = 1e-6


class DynamicBatcher(Generic[T]):
    def __init__(
        self, max_batch: int = 64, max_wait_ms: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if (
            not isinstance(max_wait_ms, (int, float))
            or isinstance(max_wait_ms, bool)
            or not math.isfinite(max_wait_ms)
            or max_wait_ms < 0
        ):
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {max_wait_ms!r}")
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        self.max_batch = max_batch
        self.max_wait_ms = float(max_wait_ms)
        self._max_wait_s = max_wait_ms / 1000.0
        self._clock = clock
        # (arrival time, item), oldest first.
        self._queue: deque[tuple[float, T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, item: T) -> None:
        """Queue an item; its wait starts now (by the batcher's clock)."""
        self._queue.append((self._clock(), item))

    def poll(self, engine_idle: bool) -> list[T]:
        """Release the next batch (oldest first, at most ``max_batch``), or [] if none is due."""
        queue = self._queue
        if not queue:
            return []
        if engine_idle and len(queue) < self.max_batch and self._clock() + _EARLY_S < queue[0][0] + self._max_wait_s:
            return []
        return [queue.popleft()[1] for _ in range(min(len(queue), self.max_batch))]

    def time_until_release(self, engine_idle: bool) -> float | None:
        """Seconds until ``poll`` would release something if nothing else arrives; None if empty.

        The caller may block on its input for this long.
        """
        queue = self._queue
        if not queue:
            return None
        if not engine_idle or len(queue) >= self.max_batch:
            return 0.0
        return max(0.0, queue[0][0] + self._max_wait_s - self._clock())

    def drain(self) -> list[T]:
        """Take every waiting item out, oldest first, due or not (for shutdown)."""
        items = [item for _, item in self._queue]
        self._queue.clear()
        return items
