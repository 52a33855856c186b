"""The dual-threshold dynamic batcher between stream ingest and the engine, fixed or adaptive.

Items wait here until one of two thresholds is met: ``max_batch`` items are waiting, or the
oldest has waited the wait threshold. That holds only while the engine is idle, where a bigger
first batch pays for itself. While the engine is busy, items are released at once, so that
they join the running batch at the next step (continuous batching) instead of waiting.

The wait threshold is either fixed (``max_wait_ms`` milliseconds) or ``"auto"``: then
:class:`AdaptiveWait` chooses it from the observed arrival rate and engine step time. Holding
the first item longer than about one step gains nothing (items arriving later would join the
running batch after one step anyway), and waiting is only worth it when more items are likely to
arrive meanwhile, so the wait is ``step_time * min(1, arrivals_per_step)`` within
``[min_wait_ms, max_wait_ms]``: near zero when load is light, about a step when it is heavy (and
the size threshold still releases a batch that fills sooner).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Release up to a microsecond early: a caller that slept exactly the advised time must not be
# told "not yet" because of float rounding (a unix-time float has ~0.25 us resolution).
_EARLY_S = 1e-6

AUTO = "auto"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class WaitStats:
    """What the adaptive wait sees and chooses, for metrics (all in seconds or per second)."""

    wait_s: float
    arrival_rate: float
    step_time_s: float | None


class AdaptiveWait:
    """Chooses the batcher's wait from the arrival rate (a sliding window) and the step time (EWMA).

    ``window_s``: how far back arrivals count toward the rate. ``step_alpha``: weight of the
    newest step time in its moving average. Before any step has been observed there is no basis
    for waiting, so the wait is ``min_wait_ms``.
    """

    def __init__(self, *, min_wait_ms: float = 0.0, max_wait_ms: float = 50.0, window_s: float = 1.0,
                 step_alpha: float = 0.2, max_tracked_arrivals: int = 100_000) -> None:
        if not _is_number(min_wait_ms) or min_wait_ms < 0:
            raise ValueError(f"min_wait_ms must be a finite number >= 0, got {min_wait_ms!r}")
        if not _is_number(max_wait_ms) or max_wait_ms < min_wait_ms:
            raise ValueError(f"max_wait_ms must be a finite number >= min_wait_ms ({min_wait_ms}), got {max_wait_ms!r}")
        if not _is_number(window_s) or window_s <= 0:
            raise ValueError(f"window_s must be a finite number > 0, got {window_s!r}")
        if not _is_number(step_alpha) or not 0 < step_alpha <= 1:
            raise ValueError(f"step_alpha must be in (0, 1], got {step_alpha!r}")
        self.min_wait_s = min_wait_ms / 1000.0
        self.max_wait_s = max_wait_ms / 1000.0
        self.window_s = float(window_s)
        self.step_alpha = float(step_alpha)
        # Arrival times inside the window, oldest first; bounded so a flood cannot grow it forever
        # (past the bound the rate is counted over a shorter span, which stays correct).
        self._arrivals: deque[float] = deque(maxlen=max_tracked_arrivals)
        self._step_s: float | None = None

    def on_arrival(self, now: float) -> None:
        self._arrivals.append(now)

    def on_step(self, seconds: float) -> None:
        if not _is_number(seconds) or seconds < 0:
            return  # a clock step backwards or a bogus value must not poison the average
        prev = self._step_s
        self._step_s = seconds if prev is None else prev + self.step_alpha * (seconds - prev)

    def arrival_rate(self, now: float) -> float:
        """Arrivals per second over the last ``window_s``."""
        arrivals = self._arrivals
        horizon = now - self.window_s
        while arrivals and arrivals[0] < horizon:
            arrivals.popleft()
        if not arrivals:
            return 0.0
        if len(arrivals) == arrivals.maxlen:
            span = now - arrivals[0]
            if span > 0:
                return len(arrivals) / span
        return len(arrivals) / self.window_s

    @property
    def step_time_s(self) -> float | None:
        return self._step_s

    def wait_s(self, now: float) -> float:
        """The wait threshold now; it only shrinks while nothing arrives (the rate decays)."""
        step = self._step_s
        rate = self.arrival_rate(now)
        if step is None or rate <= 0.0:
            return self.min_wait_s
        wait = step * min(1.0, rate * step)
        return min(self.max_wait_s, max(self.min_wait_s, wait))

    def stats(self, now: float) -> WaitStats:
        return WaitStats(self.wait_s(now), self.arrival_rate(now), self._step_s)


class DynamicBatcher(Generic[T]):
    """``max_wait_ms`` is a number of milliseconds or ``"auto"`` (then ``adaptive`` may hold an
    :class:`AdaptiveWait` with custom bounds; by default one with 0-50 ms is made)."""

    def __init__(
        self, max_batch: int = 64, max_wait_ms: float | str = 10.0, clock: Callable[[], float] = time.monotonic,
        *, adaptive: AdaptiveWait | None = None,
    ) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        is_auto = isinstance(max_wait_ms, str) and max_wait_ms.strip().lower() == AUTO
        if not is_auto and (not _is_number(max_wait_ms) or max_wait_ms < 0):
            raise ValueError(f"max_wait_ms must be a finite number >= 0 or 'auto', got {max_wait_ms!r}")
        if adaptive is not None and not is_auto:
            raise ValueError("adaptive= is only used with max_wait_ms='auto'")
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        self.max_batch = max_batch
        self.adaptive: AdaptiveWait | None = (adaptive or AdaptiveWait()) if is_auto else None
        self.max_wait_ms: float | str = AUTO if is_auto else float(max_wait_ms)
        self._max_wait_s = 0.0 if is_auto else max_wait_ms / 1000.0
        self._clock = clock
        # (arrival time, item), oldest first.
        self._queue: deque[tuple[float, T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, item: T) -> None:
        """Queue an item; its wait starts now (by the batcher's clock)."""
        now = self._clock()
        self._queue.append((now, item))
        if self.adaptive is not None:
            self.adaptive.on_arrival(now)

    def observe_step(self, seconds: float) -> None:
        """Report how long one engine step took (used by the adaptive wait; ignored when fixed)."""
        if self.adaptive is not None:
            self.adaptive.on_step(seconds)

    def wait_s(self) -> float:
        """The wait threshold in force now, in seconds."""
        if self.adaptive is None:
            return self._max_wait_s
        return self.adaptive.wait_s(self._clock())

    def stats(self) -> WaitStats:
        """The current wait, arrival rate and step time (a fixed batcher reports rate 0)."""
        if self.adaptive is None:
            return WaitStats(self._max_wait_s, 0.0, None)
        return self.adaptive.stats(self._clock())

    def poll(self, engine_idle: bool) -> list[T]:
        """Release the next batch (oldest first, at most ``max_batch``), or [] if none is due."""
        queue = self._queue
        if not queue:
            return []
        if engine_idle and len(queue) < self.max_batch and self._clock() + _EARLY_S < queue[0][0] + self.wait_s():
            return []
        return [queue.popleft()[1] for _ in range(min(len(queue), self.max_batch))]

    def time_until_release(self, engine_idle: bool) -> float | None:
        """Seconds until ``poll`` would release something if nothing else arrives; None if empty.

        The caller may block on its input for this long. (An adaptive wait only shrinks while
        nothing arrives, so sleeping this long is always enough.)
        """
        queue = self._queue
        if not queue:
            return None
        if not engine_idle or len(queue) >= self.max_batch:
            return 0.0
        return max(0.0, queue[0][0] + self.wait_s() - self._clock())

    def requeue(self, items: list[T]) -> None:
        """Put released items that could not start yet back at the front, in their order, due at
        once (their wait is over)."""
        for item in reversed(items):
            self._queue.appendleft((float("-inf"), item))

    def remove(self, item: T) -> bool:
        """Take one waiting item out (a cancelled request); False when it is not waiting here."""
        for i, (_, queued) in enumerate(self._queue):
            if queued == item:
                del self._queue[i]
                return True
        return False

    def drain(self) -> list[T]:
        """Take every waiting item out, oldest first, due or not (for shutdown)."""
        items = [item for _, item in self._queue]
        self._queue.clear()
        return items
