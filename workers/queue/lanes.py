"""Lanes as a worker reads them (the key scheme is :mod:`mqinfer.schemas.lanes`).

A worker reads the plain stream and every lane in the registry (``--lanes none``: the plain
stream only). Entry ids are unique only within one stream, so inside the worker an entry of a lane
is known by its *qualified* id, ``<entry id>@<lane>`` (the plain stream's entries keep their bare
id); everything that talks to Redis splits it again (:func:`split`).

Which lanes a read takes from: each lane has a virtual counter of the service its entries were
given, divided by its weight (the ``--tenant-weights`` weight of the lane's tenant; 1 until the
worker has read one of its requests). Reading an entry charges its lane the entry's expected
tokens (``PROMPT_TOKEN_WEIGHT`` per prompt token plus ``OUTPUT_TOKEN_WEIGHT`` per ``max_tokens``,
the scheduler's weights), corrected by the tokens it actually generated once it finishes. A read
of ``room`` entries is shared out one entry at a time to the backlogged lane whose counter (plus
what this read already gave it) is smallest: start-time fair queuing over the lanes, the queue's
side of the scheduler's fair share. A lane that comes back after having nothing unread gets its
counter lifted to the smallest counter of the backlogged lanes, so idling earns no credit.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from mqinfer.scheduler.fair import OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as scheme
from mqinfer.workers.queue.entries import text

log = logging.getLogger("mqinfer.worker")

# Separates an entry id from its lane in a qualified id (lane names never hold it).
SEP = "@"
# How often a worker looks at the registry's version (a new lane's notice wakes one at once).
REGISTRY_CHECK_S = 0.25
# A lane no producer used for this long and whose stream is empty is removed from the registry.
LANE_IDLE_S = 3600.0
# How often (at most) one worker of the stream sweeps idle lanes.
SWEEP_EVERY_S = 60.0


def qualify(entry_id: str, lane: str | None) -> str:
    """The worker's id of an entry of ``lane`` (None: the plain stream)."""
    return entry_id if lane is None else f"{entry_id}{SEP}{lane}"


def split(qid: str) -> tuple[str, str | None]:
    """(entry id in its stream, lane or None) of a qualified id."""
    entry_id, sep, lane = qid.partition(SEP)
    return entry_id, (lane if sep else None)


def lane_of(qid: str) -> str | None:
    return split(qid)[1]


def by_lane(qids) -> dict[str | None, list[str]]:
    """Qualified ids grouped by lane, in their order."""
    groups: dict[str | None, list[str]] = {}
    for qid in qids:
        groups.setdefault(lane_of(qid), []).append(qid)
    return groups


def share_group(qid: str) -> str | None:
    """The engine's fair-share group of an entry: its lane when that is one job's lane (so that
    jobs share the running slots as they share the reads), else None (its tenant's group)."""
    lane = lane_of(qid)
    return lane if scheme.is_job_lane(lane) else None


def stream_of(base_stream: str, lane: str | None) -> str:
    """The stream name of a lane (the plain stream for None)."""
    return scheme.lane_stream(base_stream, lane)


def key_of(base_stream: str, lane: str | None) -> str:
    """The stream key of a lane."""
    return keys.request_stream(scheme.lane_stream(base_stream, lane))


def expected_service(prompt_tokens: int, max_tokens: int) -> float:
    """Service charged to a lane when one of its entries is read (before its weight)."""
    return PROMPT_TOKEN_WEIGHT * prompt_tokens + OUTPUT_TOKEN_WEIGHT * max_tokens


@dataclass(slots=True)
class Lane:
    name: str | None
    key: str
    counter: float = 0.0
    tenant: str | None = None
    # Entries unread at the last look, and whether that was more than none.
    unread: int = 0
    backlogged: bool = False
    # Moving average of the service charged per entry read (for sharing out a read).
    per_entry: float = 0.0
    claim_cursor: str = "0-0"
    # Entries read from this lane, and their expected service (for the per-lane metrics).
    read_entries: int = 0
    read_service: float = 0.0
    gap_reported: str | None = field(default=None)


class LaneSet:
    """The lanes one worker reads, their counters, and how a read is shared out among them."""

    def __init__(self, redis_client, stream: str, group: str, *, enabled: bool, max_lanes: int,
                 weight_of: Callable[[str], float], clock: Callable[[], float] = time.time) -> None:
        self.redis = redis_client
        self.stream = stream
        self.group = group
        self.enabled = enabled
        self.max_lanes = max_lanes
        self.weight_of = weight_of
        self.clock = clock
        self.plain = Lane(None, key_of(stream, None))
        self.lanes: dict[str | None, Lane] = {None: self.plain}
        self._version: bytes | None = None
        self._last_check = float("-inf")
        self._last_sweep = float("-inf")
        self._unregister = redis_client.register_script(scheme.UNREGISTER_SCRIPT)
        self._drop_empty = redis_client.register_script(scheme.DROP_EMPTY_SCRIPT)
        self._groups_made: set[str] = set()

    # -- which lanes ----------------------------------------------------------------------------
    @property
    def multi(self) -> bool:
        """More than the plain stream to read."""
        return len(self.lanes) > 1

    def __iter__(self):
        return iter(list(self.lanes.values()))

    def get(self, name: str | None) -> Lane | None:
        return self.lanes.get(name)

    def refresh(self, now: float, *, force: bool = False) -> bool:
        """Re-read the registry if its version moved (looked at every ``REGISTRY_CHECK_S``); True
        when the set of lanes changed."""
        if not self.enabled or (not force and now - self._last_check < REGISTRY_CHECK_S):
            return False
        self._last_check = now
        version = self.redis.get(scheme.registry_version_key(self.stream))
        if version == self._version and not force:
            return False
        self._version = version
        members = self.redis.zrange(scheme.registry_key(self.stream), 0, -1)
        names = [m for m in (text(x) for x in members) if scheme.valid_lane(m)][: self.max_lanes]
        changed = False
        floor = self._floor()
        for name in names:
            if name not in self.lanes:
                self.lanes[name] = Lane(name, key_of(self.stream, name), counter=floor)
                changed = True
        for name in [n for n in self.lanes if n is not None and n not in names]:
            del self.lanes[name]
            changed = True
        if changed:
            log.info("reading %d lanes of %s", len(self.lanes), self.plain.key)
        return changed

    def ensure_group(self, lane: Lane) -> None:
        """Make a lane's group (at the stream's start) where it is missing. A lane gone from the
        registry was removed (its stream deleted as empty): it is dropped from this worker's set
        instead, so that the worker does not make its stream again."""
        if lane.name is not None and self.enabled and \
                self.redis.zscore(scheme.registry_key(self.stream), lane.name) is None:
            self.lanes.pop(lane.name, None)
            return
        try:
            self.redis.xgroup_create(lane.key, self.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- fair share ---------------------------------------------------------------------------
    def _floor(self) -> float:
        """The smallest counter among backlogged lanes (0 when none is)."""
        backlogged = [lane.counter for lane in self.lanes.values() if lane.backlogged]
        return min(backlogged) if backlogged else min((lane.counter for lane in self.lanes.values()), default=0.0)

    def weight(self, lane: Lane) -> float:
        return self.weight_of(lane.tenant) if lane.tenant is not None else 1.0

    def observe(self, unread: dict[str | None, int]) -> None:
        """Each lane's count of unread entries, as just read; a lane that had none and has some now
        is lifted to the floor of the lanes that were backlogged all along."""
        was = {name for name, lane in self.lanes.items() if lane.backlogged}
        floor = min((self.lanes[n].counter for n in was), default=None)
        for name, count in unread.items():
            lane = self.lanes.get(name)
            if lane is None:
                continue
            lane.unread = count
            backlogged = count > 0
            if backlogged and not lane.backlogged and floor is not None:
                lane.counter = max(lane.counter, floor)
            lane.backlogged = backlogged

    def share_out(self, room: int, only: set[str | None] | None = None) -> list[tuple[Lane, int]]:
        """How many entries to read from each backlogged lane (of those named in ``only``, when
        given): ``room`` shared one at a time to the lane with the smallest counter counting what
        this read already gave it."""
        heap = []
        for n, lane in enumerate(self.lanes.values()):
            if lane.unread > 0 and (only is None or lane.name in only):
                heap.append((lane.counter, n, lane))
        heapq.heapify(heap)
        taken: dict[int, int] = {}
        lanes: dict[int, Lane] = {}
        left = room
        while heap and left > 0:
            counter, n, lane = heapq.heappop(heap)
            got = taken.get(n, 0) + 1
            taken[n] = got
            lanes[n] = lane
            left -= 1
            if got < lane.unread:
                step = (lane.per_entry or 1.0) / self.weight(lane)
                heapq.heappush(heap, (counter + step, n, lane))
        return [(lanes[n], count) for n, count in taken.items()]

    def charge(self, name: str | None, tenant: str, service: float) -> None:
        """An entry of lane ``name`` was read: its lane is charged its expected service."""
        lane = self.lanes.get(name)
        if lane is None:
            return
        if lane.tenant is None:
            lane.tenant = tenant
        lane.counter += service / self.weight(lane)
        lane.per_entry = service if not lane.per_entry else 0.8 * lane.per_entry + 0.2 * service
        lane.read_entries += 1
        lane.read_service += service

    def settle(self, name: str | None, service_delta: float) -> None:
        """A request finished: its lane's charge is corrected by what it really generated."""
        lane = self.lanes.get(name)
        if lane is not None:
            lane.counter = max(0.0, lane.counter + service_delta / self.weight(lane))

    # -- idle lanes -----------------------------------------------------------------------------
    def sweep(self, now: float, consumer: str) -> int:
        """Remove lanes no producer has used for ``LANE_IDLE_S`` whose streams are empty with nothing
        pending (one worker of the stream does it, at most every ``SWEEP_EVERY_S``); how many."""
        if not self.enabled or now - self._last_sweep < SWEEP_EVERY_S:
            return 0
        self._last_sweep = now
        lock = f"mqinfer:{{{self.stream}}}:lanes:sweep"
        if not self.redis.set(lock, consumer, nx=True, ex=int(SWEEP_EVERY_S)):
            return 0
        cutoff = time.time() - LANE_IDLE_S
        idle = self.redis.zrangebyscore(scheme.registry_key(self.stream), "-inf", cutoff)
        removed = 0
        for name in (text(m) for m in idle):
            if scheme.remove_lane(self.redis, self.stream, name, self.group, cutoff=cutoff,
                           unregister=self._unregister, drop_empty=self._drop_empty):
                removed += 1
        return removed
