"""Watching the streams while a step runs, for a request with latency targets.

The worker reads its streams between engine steps. A bulk step can take half a second or more (a
full prompt step of a large backlog), and a request with latency targets that arrives during it
would wait for all of it before it is even read: its time to first token alone, some tens of
milliseconds, becomes the rest of that step plus its own. While a step runs, :class:`ArrivalWatch`
waits on the same streams on a thread of its own (``XREAD BLOCK`` from the entry ids of the moment
the step began, on the server's clock: it only looks, the consumer group does not move) and sets :attr:`ArrivalWatch.arrived` when an entry with
latency targets arrives (its own ``slo_ttft_ms`` / ``slo_tpot_ms``, or its tenant's
``--tenant-slos``); a producer's notice of a new lane adds that lane to the watch, whose first
request comes right after it. The engine asks that flag before each decoder layer of a step that
moves no interactive request along and gives the step up when it is set (workers/engine/core.py);
the worker then reads the streams the watch named in :attr:`ArrivalWatch.flagged` first, whatever
its fair share of the backlog (workers/queue/ingest.py), and schedules the request at once, in a
step planned for its targets (scheduler/slo.py).

What it costs: one blocking read on another connection per step, and one given-up step per
arrival at most. Each step's watch starts at the moment the step began (less ``MARGIN_MS`` for the
error of the clocks' offset, which the watch measures with ``TIME``), so an entry is seen during
the step it arrived in, or by the worker's own read after it; and a watch never looks again at an
entry an earlier watch looked at, so the request that gave one step up does not give up the next
one too, the step that starts it.

Not used with a Redis cluster (one XREAD cannot span the lanes' hash slots).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import redis

from mqinfer.schemas.lanes import NOTICE_FIELD, valid_lane
from mqinfer.schemas.stream import decode_entry
from mqinfer.workers.queue.consumer_group import is_notice
from mqinfer.workers.queue.entries import text
from mqinfer.workers.queue.slo import LatencyTargets

log = logging.getLogger("mqinfer.worker")

# How long one blocking read waits: a watch that is disarmed (its step ended) is noticed by then.
BLOCK_MS = 50
# Entries one read returns at most (the first interactive one is enough).
COUNT = 64
# After a failed read (the server is away), the watch waits this long before the next.
RETRY_S = 0.5
# A watch starts at entries this much older than its step's start on the server's clock.
MARGIN_MS = 50
# How often the offset between this host's clock and the server's is measured again.
CLOCK_CHECK_S = 60.0


class ArrivalWatch:
    """A thread that watches streams for interactive arrivals while it is armed.

    ``keys``: the stream keys to watch (read at each ``arm``, on the caller's thread);
    ``interactive``: what an entry's fields call for: True to give a bulk step up, False for
    nothing, or the stream key of a new lane (a notice) to watch as well.
    """

    def __init__(self, redis_client, keys: Callable[[], list[str]], interactive: Callable[[Mapping], bool | str],
                 block_ms: int = BLOCK_MS, margin_ms: int = MARGIN_MS) -> None:
        self._redis = redis_client
        self._keys = keys
        self._interactive = interactive
        self._block_ms = block_ms
        self._margin_ms = margin_ms
        # Per stream, the last entry a watch looked at: the next watch starts after it.
        self._looked: dict[str, tuple[int, int]] = {}
        # Set when an interactive entry arrived during the current watch; the engine reads it. The
        # stream keys it arrived on, for the worker's read after the step.
        self.arrived = threading.Event()
        self.flagged: set[str] = set()
        self._armed = threading.Event()
        # The current watch's moment, and where it starts on each stream (``_start``).
        self._since = "0-0"
        self._starts: dict[str, str] = {}
        # The server's clock less this host's (seconds), and when it was measured (never: -inf).
        self._offset_s = 0.0
        self._offset_at = float("-inf")
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False
        # Entries looked at, and interactive arrivals seen among them (a watch counts at most one).
        self.num_entries = 0
        self.num_seen = 0
        self._thread = threading.Thread(target=self._watch, name="mqinfer-arrivals", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Start a watch from this moment (before a step)."""
        watched = list(self._keys())
        since_ms = int((time.time() + self._offset_s) * 1000) - self._margin_ms
        with self._lock:  # a read of the watch before this one adds nothing to this one's results
            self._since = f"{max(since_ms, 0)}-0"
            self._starts = {key: self._start(key) for key in watched}
            self.arrived.clear()
            self.flagged = set()
            self._generation += 1
        self._armed.set()

    def disarm(self) -> list[str]:
        """End the watch (after the step); what arrives now is the worker's own read's. Returns
        the streams on which interactive requests arrived during it."""
        self._armed.clear()
        with self._lock:
            return list(self.flagged)

    def close(self) -> None:
        self._closed = True
        self._armed.set()
        self._thread.join(timeout=2 * self._block_ms / 1000.0 + 1.0)

    def _watch(self) -> None:
        generation, ids = -1, {}
        try:
            self._measure_offset()
        except (redis.exceptions.RedisError, OSError) as exc:  # measured again at the first watch
            log.debug("arrival watch: %s", exc)
        while True:
            self._armed.wait()
            if self._closed:
                return
            with self._lock:
                if generation != self._generation:
                    generation = self._generation
                    ids = dict(self._starts)
            if not ids:
                self._armed.clear()
                continue
            try:
                if time.monotonic() - self._offset_at >= CLOCK_CHECK_S:
                    self._measure_offset()
                response = self._redis.xread(ids, count=COUNT, block=self._block_ms)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.debug("arrival watch: %s", exc)
                self._armed.clear()
                threading.Event().wait(RETRY_S)
                continue
            with self._lock:
                if generation == self._generation and self._armed.is_set():
                    self._take(response or [], ids)
                # else an older watch's read: the next one starts from its own moment

    def _take(self, response: list, ids: dict[str, str]) -> None:
        """Look at what one read returned (under the lock, for the current watch)."""
        flagged = self.flagged
        for key, entries in response:
            key = text(key)
            for entry_id, fields in entries:
                ids[key] = text(entry_id)
                self._looked[key] = _parse_id(ids[key])
                self.num_entries += 1
                verdict = self._interactive(fields)
                if isinstance(verdict, str):
                    ids.setdefault(verdict, self._start(verdict))
                elif verdict:
                    flagged.add(key)
                    if not self.arrived.is_set():
                        self.num_seen += 1
                        self.arrived.set()

    def _start(self, key: str) -> str:
        """Where a watch of ``key`` starts (under the lock): at the watch's moment, or after the
        last entry an earlier watch looked at there, whichever is later."""
        looked = self._looked.get(key)
        if looked is None or looked < _parse_id(self._since):
            return self._since
        return f"{looked[0]}-{looked[1]}"

    def _measure_offset(self) -> None:
        """The server's clock less this host's, from the quickest of three ``TIME`` round trips
        (its error is at most half that round trip)."""
        best = None
        for _ in range(3):
            t0 = time.time()
            seconds, micros = self._redis.time()
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, seconds + micros / 1e6 - (t0 + t1) / 2)
        self._offset_s = best[1]
        self._offset_at = time.monotonic()


def _parse_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``milliseconds-sequence``) as a pair that orders as the ids do."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# What the names of both target fields begin with.
_TARGET_NAME = b"slo_t"


def _raw(value) -> bytes:
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)


def interactive_entry(targets: LatencyTargets, max_entry_bytes: int,
                      lane_key: Callable[[str], str]) -> Callable[[Mapping], bool | str]:
    """What a stream entry calls for (``ArrivalWatch``'s ``interactive``): True for a request with
    latency targets of its own or its tenant's; the stream key of the lane a notice announces
    (``lane_key`` of its name); False for the rest. An entry that does not decode is the worker's
    read's to refuse, not a reason to stop a step."""

    by_tenant = bool(targets.tenant_slos)

    def interactive(fields: Mapping) -> bool | str:
        if is_notice(fields):
            name = next((text(v) for k, v in fields.items() if text(k) == NOTICE_FIELD), "")
            return lane_key(name) if valid_lane(name) else False
        # Without tenant defaults only a request's own target fields make it interactive, and their
        # names stand verbatim in a JSON or msgpack payload: most bulk entries need no decoding.
        if not by_tenant and not any(_TARGET_NAME in _raw(v) for v in fields.values()):
            return False
        try:
            request = decode_entry(fields, max_entry_bytes=max_entry_bytes)
        except Exception:  # noqa: BLE001 - any bad entry: the worker's read reports it
            return False
        ttft_ms, tpot_ms = targets.of(request)
        return ttft_ms is not None or tpot_ms is not None

    return interactive
