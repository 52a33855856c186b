"""The producer client's reply book: reply events of many requests, sorted out per request.

Part of the client's sans-IO core (:mod:`mqinfer.client_core`): it only keeps state. Events come
from shared reply streams in the order workers wrote them; this book decides which of them a
caller gets to see, for which request, and in what order.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from mqinfer.schemas.replies import Delta, Final, ReplyEvent, Restart

RequestKey = tuple[str | None, str]  # (job_id, id): what identifies a request


class ReplyBook:
    """Reply events of many requests, read from shared streams, sorted out per request.

    Deltas from an attempt older than the latest restart, or from another worker than the one
    that restarted the request, are stale (a worker that lost its entry and has not noticed yet)
    and are dropped. Finals are kept (the last ``keep_finals``) so ``result`` can be asked again.
    """

    def __init__(self, keep_finals: int = 10_000) -> None:
        if keep_finals < 1:
            raise ValueError(f"keep_finals must be >= 1, got {keep_finals}")
        self._events: dict[RequestKey, deque[ReplyEvent]] = {}
        # The attempt whose deltas count, and the worker that announced it (None before a restart:
        # the first attempt's worker is whoever sends).
        self._current: dict[RequestKey, tuple[int, str | None]] = {}
        self._finals: OrderedDict[RequestKey, Final] = OrderedDict()
        self.keep_finals = keep_finals

    def add(self, event: ReplyEvent) -> bool:
        """File one event under its request; False when it was dropped as stale or late."""
        key = (event.job_id, event.id)
        if key in self._finals:
            return False  # the request is over; a late duplicate changes nothing
        attempt, worker = self._current.get(key, (0, None))
        if isinstance(event, Restart):
            if event.attempt < attempt:
                return False
            self._current[key] = (event.attempt, event.worker)
        elif isinstance(event, Delta):
            if event.attempt < attempt or (worker is not None and event.worker != worker):
                return False
            if event.attempt > attempt:
                self._current[key] = (event.attempt, worker)
        else:
            self._finals[key] = event
            while len(self._finals) > self.keep_finals:
                self._finals.popitem(last=False)
            self._current.pop(key, None)
        self._events.setdefault(key, deque()).append(event)
        return True

    def take(self, key: RequestKey) -> list[ReplyEvent]:
        """Events of one request not yet taken, oldest first (ends with its Final once there)."""
        events = self._events.get(key)
        if not events:
            return []
        out = list(events)
        events.clear()
        if isinstance(out[-1], Final):
            del self._events[key]
        return out

    def final(self, key: RequestKey) -> Final | None:
        """The request's Final if it came; its buffered deltas are dropped then (``result``
        wants the row only)."""
        final = self._finals.get(key)
        if final is not None:
            self._events.pop(key, None)
        return final

    def forget(self, key: RequestKey) -> None:
        """Drop everything about one request (it was sent again, or nobody will read it)."""
        self._events.pop(key, None)
        self._current.pop(key, None)
        self._finals.pop(key, None)

    def buffered(self, key: RequestKey) -> int:
        """How many events of the request wait to be taken."""
        return len(self._events.get(key, ()))
