"""A bulk job's state in Redis: its hash, its lock, its in-flight map, and the fenced writes on them.

Every key of a job carries the job id as a hash tag (``mqinfer:job:{ID}...``). The hash
(:func:`mqinfer.schemas.keys.job_key`) holds the status, the settings and every counter; the lock
(``...:lock``) is held by the one rq task that advances the job now; the in-flight map
(``...:inflight``) maps each request id sent to the request stream and not yet collected to
``"<entry id> <index part>:<offset> <shard> <lane>"``: the shard is the request stream it was sent
to, which routing by prefix chooses from the prompt, so it cannot be derived from the id later (a
record without one, written before shards were recorded, means the shard of the id's hash); the
lane (:mod:`mqinfer.schemas.lanes`) is the lane of that shard's stream that holds the entry, left
out for the plain stream (and in records written before lanes); entry ids are unique only within
one stream, so looking an entry up needs both. The parts list (``...:parts``) names the spool files
of result rows whose cursor update was committed; the lanes set (``...:lanes``) names the job's
own lanes (``"<shard> <lane>"``), removed when the job ends.

Two rq tasks of one job never run at once: a task first takes the lock (``SET NX PX``, a lease
that a thread of the task keeps fresh) and only if the job's ``chain`` token is the one it
carries. Every write a task makes is *fenced*: a Lua script checks that the lock still holds the
task's token before it changes anything, so a task that lost its lease (its process stalled, a
sweeper started a new chain) can no longer change the job. Feeding (``XADD`` + in-flight entry +
cursor) and collecting (in-flight removal + counters + cursor + parts list) are each one script,
so a crash leaves either all of a step or none of it.

**Two servers** (``--jobs-redis``). rq does not run on Redis Cluster, so a fleet whose request
streams live on a cluster keeps its job state and rq queue on a separate plain server. Then the
job's hash, lock, in-flight map and parts list live on the *jobs* server, and its request streams,
done sets and result stream on the *data* server (the inference workers' ``--redis``). One script
cannot span two servers, so feeding becomes three ordered steps: (1) a fenced script notes the
requests in flight with no entry id yet (``"- <locator> <shard> <lane>"``) and moves the feed
cursor, (2) the entries are added to the data server's streams, (3) a fenced script records their
entry ids. A crash after (1) leaves requests in flight without an entry; the periodic reconcile of
the task finds them (an in-flight request with no entry and no row) and sends them. A crash after
(2) leaves entries whose ids were never recorded; if a later reconcile sends them again (to the
shard and lane noted in step 1, the stream of the first copy), the worker's idempotency record
turns the second copy into a duplicate, not a second computation. Collecting commits on the jobs
server first and trims the result stream after. The inference workers learn a job's status (to stop a cancelled
job's requests) from a small mirror hash under the same key name on the data server, written at
registration, cancel and the end of the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import redis

from mqinfer.ops.job_lanes import JOB_LANE_MODES
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as lane_scheme

log = logging.getLogger("mqinfer.jobs")

QUEUE_NAME = "mqinfer-jobs"
JOBS_INDEX = "mqinfer:jobs"  # sorted set: job id -> created_at, for `jobs list`
ACTIVE_JOBS = "mqinfer:jobs:active"  # set of jobs that are not in a final state, for the sweeper
SWEEP_LOCK = "mqinfer:jobs:sweep"
MIRROR_TTL_S = 7 * 24 * 3600  # how long a finished job's status mirror stays on the data server

VALIDATING = "validating"
FAILED = "failed"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"

STATUSES = (VALIDATING, FAILED, IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED, CANCELLING, CANCELLED)
ACTIVE_STATUSES = frozenset({VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING})
FINAL_STATUSES = frozenset({FAILED, COMPLETED, EXPIRED, CANCELLED})

# Hash fields that hold integers; everything else is text (floats are unix seconds or USD).
INT_FIELDS = frozenset({
    "max_in_flight", "chunk_size", "val_parts", "total", "invalid", "duplicates", "validated",
    "feed_part", "feed_offset", "fed", "refed", "skipped", "collected", "completed", "failed",
    "cancelled", "expired", "prompt_tokens", "output_tokens", "cost_rows", "dup_rows", "task_errors",
    "row_parts", "resumed_rows", "output_rows", "shards", "rows_cost_count", "max_lanes", "rerun",
    "budget_exceeded",
})


class LockLost(RuntimeError):
    """The task's lease on its job ended (another task may own the job now): it must stop."""


class StatusChanged(RuntimeError):
    """The job's status is not the one a transition expected (a cancel came in between)."""

    def __init__(self, status: str) -> None:
        super().__init__(f"job status changed to {status!r}")
        self.status = status


class JobNotFound(LookupError):
    """No job with this id is registered on this Redis."""


def lock_key(job_id: str) -> str:
    return f"mqinfer:job:{{{job_id}}}:lock"


def inflight_key(job_id: str) -> str:
    return f"mqinfer:job:{{{job_id}}}:inflight"


def parts_key(job_id: str) -> str:
    return f"mqinfer:job:{{{job_id}}}:parts"


def lanes_key(job_id: str) -> str:
    return f"mqinfer:job:{{{job_id}}}:lanes"


def _s(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def decode_hash(raw: dict) -> dict[str, object]:
    """A job hash as Python values: counters as int, the rest as str."""
    out: dict[str, object] = {}
    for key, value in raw.items():
        name, text = _s(key), _s(value)
        if name in INT_FIELDS:
            try:
                out[name] = int(text)
            except ValueError:
                out[name] = 0
        else:
            out[name] = text
    return out


# -- Lua -------------------------------------------------------------------------------------
# KEYS: hash, lock. ARGV: chain, token, lease_ms, now.
_ACQUIRE = """
if redis.call('HGET', KEYS[1], 'chain') ~= ARGV[1] then return 0 end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then
  redis.call('HSET', KEYS[1], 'beat', ARGV[4])
  return 1
end
return 2
"""

# KEYS: lock. ARGV: token, lease_ms.
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lock. ARGV: token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: hash, lock. ARGV: token, expected status ('' = any), number of set pairs, set pairs...,
# then increment pairs. Returns {1|0|-1, status before}.
_UPDATE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {-1, ''} end
local status = redis.call('HGET', KEYS[1], 'status') or ''
if ARGV[2] ~= '' and status ~= ARGV[2] then return {0, status} end
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
return {1, status}
"""

# KEYS: hash, lock, inflight, then the request streams the items go to. ARGV: token, feed_part,
# feed_offset, skipped, counter name, then (id, in-flight record "<locator> <shard>[ <lane>]",
# payload, index of its stream among those keys, from 0) quadruples. Returns how many were added,
# -1 if the lock is lost.
_FEED = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local n = 0
for i = 6, #ARGV, 4 do
  local eid = redis.call('XADD', KEYS[4 + tonumber(ARGV[i + 3])], '*', 'r', ARGV[i + 2], 'v', '1')
  redis.call('HSET', KEYS[3], ARGV[i], eid .. ' ' .. ARGV[i + 1])
  n = n + 1
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'feed_part', ARGV[2], 'feed_offset', ARGV[3]) end
redis.call('HINCRBY', KEYS[1], ARGV[5], n)
redis.call('HINCRBY', KEYS[1], 'skipped', ARGV[4])
return n
"""

# Two servers, step 1. KEYS: hash, lock, inflight. ARGV: token, feed_part, feed_offset, skipped,
# counter name, then (id, "<locator> <shard>[ <lane>]") pairs: noted in flight without an entry id
# ('-').
_FEED_PLAN = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local n = 0
for i = 6, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], '- ' .. ARGV[i + 1])
  n = n + 1
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'feed_part', ARGV[2], 'feed_offset', ARGV[3]) end
redis.call('HINCRBY', KEYS[1], ARGV[5], n)
redis.call('HINCRBY', KEYS[1], 'skipped', ARGV[4])
return n
"""

# Two servers, step 3. KEYS: lock, inflight. ARGV: token, then (id, in-flight record with its
# entry id, "<entry id> <locator> <shard>[ <lane>]") pairs; a request no longer in flight is left
# alone.
_FEED_IDS = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
return 1
"""

# KEYS: hash, lock, inflight, parts[, results stream: trimmed up to the cursor when given].
# ARGV: token, cursor, part name ('' = none),
# then (id, counter, prompt_tokens, output_tokens, cost_usd or '') quintuples.
# A row counts only if its id was in flight: later copies of a row (a request computed twice)
# are kept in the spool but counted once, as dup_rows.
_COLLECT = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local counted = 0
for i = 4, #ARGV, 5 do
  if redis.call('HDEL', KEYS[3], ARGV[i]) == 1 then
    redis.call('HINCRBY', KEYS[1], ARGV[i + 1], 1)
    redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[i + 2])
    redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[i + 3])
    if ARGV[i + 4] ~= '' then
      redis.call('HINCRBYFLOAT', KEYS[1], 'cost_usd', ARGV[i + 4])
      redis.call('HINCRBY', KEYS[1], 'cost_rows', 1)
    end
    counted = counted + 1
  else
    redis.call('HINCRBY', KEYS[1], 'dup_rows', 1)
  end
end
redis.call('HINCRBY', KEYS[1], 'collected', counted)
redis.call('HSET', KEYS[1], 'cursor', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'row_parts', 1)
end
if KEYS[5] then redis.call('XTRIM', KEYS[5], 'MINID', ARGV[2]) end
return counted
"""

# KEYS: hash. ARGV: now. Returns the status before ('' when there is no such job).
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
end
return status
"""

# KEYS: hash, lock. ARGV: expected chain, new chain, new task id, now.
# Starts a new chain only if the job is active, unlocked and still on the chain the sweeper saw.
_REKICK = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'failed' or status == 'completed' or status == 'expired'
   or status == 'cancelled' then return 0 end
if (redis.call('HGET', KEYS[1], 'chain') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'chain', ARGV[2], 'task', ARGV[3], 'beat', ARGV[4])
return 1
"""

# KEYS: hash, lock. ARGV: token, task id, now. Records the follow-up task of a live chain (the
# task that enqueues it succeeded, so the run of failed tasks ends).
_NEXT_TASK = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'task', ARGV[2], 'beat', ARGV[3], 'task_errors', '0')
return 1
"""


def entry_stream_key(streams: Sequence[str], shard: int, lane: str | None) -> str:
    """The key of lane ``lane`` (None: the plain stream) of shard ``shard`` among the job's shard
    streams ``streams`` (names)."""
    return keys.request_stream(lane_scheme.lane_stream(streams[shard], lane))


@dataclass(frozen=True)
class FeedItem:
    """One request to add to the stream: its id, where it sits in the spool index, its entry payload,
    and the request stream it goes to: a shard, and a lane of that shard's stream (None: the plain
    stream)."""

    id: str
    locator: str
    payload: bytes
    shard: int = 0  # index into the shard streams given to commit_feed
    lane: str | None = None

    @property
    def flight(self) -> str:
        """What the in-flight map keeps after the entry id: the spool locator, the shard, the lane."""
        return f"{self.locator} {self.shard}" + ("" if self.lane is None else f" {self.lane}")

    def stream_key(self, streams: Sequence[str]) -> str:
        """The key of the stream this item goes to, ``streams`` being the job's shard streams."""
        return entry_stream_key(streams, self.shard, self.lane)


class InFlight(NamedTuple):
    """A request in flight: its stream entry (``"-"`` when a two-server feed has not recorded one),
    where it sits in the spool index, its shard (None in a record that predates shards being
    recorded: then the shard of the id's hash) and the lane of the shard's stream that holds the
    entry (None: the plain stream, as for every record written before lanes)."""

    entry_id: str
    locator: str
    shard: int | None
    lane: str | None = None


@dataclass(frozen=True)
class CollectedRow:
    """What the collect commit needs of one row: its id, which counter it bumps, tokens, cost."""

    id: str
    counter: str
    prompt_tokens: int
    output_tokens: int
    cost_usd: float | None


class JobStore:
    """The Redis side of one job. ``client`` must not decode responses (rq needs bytes too).

    ``client`` is the jobs server (hash, lock, in-flight map, parts, rq queue); ``data`` is the
    server or cluster of the request streams and the result stream, when it is another one.
    """

    def __init__(self, client: redis.Redis, job_id: str, *, data=None) -> None:
        self.redis = client
        self.data = client if data is None else data
        self.split = self.data is not client
        self.job_id = job_id
        self.hash_key = keys.job_key(job_id)
        self.lock_key = lock_key(job_id)
        self.inflight_key = inflight_key(job_id)
        self.parts_key = parts_key(job_id)
        self.lanes_key = lanes_key(job_id)
        self.results_key = keys.job_results_stream(job_id)
        self._scripts = {name: client.register_script(src) for name, src in (
            ("acquire", _ACQUIRE), ("refresh", _REFRESH), ("release", _RELEASE), ("update", _UPDATE),
            ("feed", _FEED), ("feed_plan", _FEED_PLAN), ("feed_ids", _FEED_IDS), ("collect", _COLLECT), ("cancel", _CANCEL), ("rekick", _REKICK),
            ("next_task", _NEXT_TASK),
        )}

    # -- reading -----------------------------------------------------------------------------
    def load(self) -> dict[str, object]:
        raw = self.redis.hgetall(self.hash_key)
        if not raw:
            raise JobNotFound(f"no job {self.job_id!r} on this Redis (see `mqinfer jobs list`)")
        return decode_hash(raw)

    def exists(self) -> bool:
        return bool(self.redis.exists(self.hash_key))

    def status(self) -> str | None:
        value = self.redis.hget(self.hash_key, "status")
        return _s(value) if value is not None else None

    def inflight_count(self) -> int:
        return int(self.redis.hlen(self.inflight_key))

    def inflight(self) -> dict[str, InFlight]:
        """Request id -> (stream entry id, spool locator, shard, lane) of every request in flight."""
        out = {}
        for rid, value in self.redis.hgetall(self.inflight_key).items():
            entry_id, locator, shard, lane, *_ = _s(value).split(" ") + [""] * 3
            out[_s(rid)] = InFlight(entry_id, locator, int(shard) if shard else None,
                                    lane if lane and lane_scheme.valid_lane(lane) else None)
        return out

    def part_names(self) -> list[str]:
        return [_s(name) for name in self.redis.lrange(self.parts_key, 0, -1)]

    # -- registration (no lock: the job does not run yet) ---------------------------------------
    def register(self, fields: dict[str, object], *, parts: Sequence[str] = ()) -> None:
        """Create the job's hash, index entries and adopted spool parts in one transaction."""
        if self.split:
            self.data.delete(self.results_key)
            self.mirror(str(fields["status"]))
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.hash_key, self.inflight_key, self.parts_key, self.lock_key, self.lanes_key)
        if not self.split:
            pipe.delete(self.results_key)
        pipe.hset(self.hash_key, mapping={k: str(v) for k, v in fields.items()})
        if parts:
            pipe.rpush(self.parts_key, *parts)
        pipe.zadd(JOBS_INDEX, {self.job_id: float(fields["created_at"])})
        pipe.sadd(ACTIVE_JOBS, self.job_id)
        pipe.execute()

    def mirror(self, status: str) -> None:
        """Two servers: the job's status where the inference workers look for it (the data server)."""
        pipe = self.data.pipeline(transaction=False)
        pipe.hset(self.hash_key, mapping={"status": status, "mirror": "1"})
        if status in FINAL_STATUSES:
            pipe.expire(self.hash_key, MIRROR_TTL_S)
        else:
            pipe.persist(self.hash_key)
        pipe.execute()

    def cancel(self, now: float | None = None) -> str:
        """Ask for cancellation; returns the status the job had (``''`` when there is no such job)."""
        before = _s(self._scripts["cancel"](keys=[self.hash_key], args=[now or time.time()]))
        if self.split and before in (VALIDATING, IN_PROGRESS, CANCELLING):
            self.mirror(CANCELLING)
        return before

    # -- the lock ----------------------------------------------------------------------------
    def acquire(self, chain: str, token: str, lease_s: float) -> str:
        """``"ok"``, ``"busy"`` (another task holds the job) or ``"stale"`` (this chain was replaced)."""
        result = self._scripts["acquire"](keys=[self.hash_key, self.lock_key],
                                          args=[chain, token, _ms(lease_s), time.time()])
        return {1: "ok", 2: "busy"}.get(int(result), "stale")

    def refresh(self, token: str, lease_s: float) -> bool:
        return bool(self._scripts["refresh"](keys=[self.lock_key], args=[token, _ms(lease_s)]))

    def release(self, token: str) -> None:
        self._scripts["release"](keys=[self.lock_key], args=[token])

    def record_next_task(self, token: str, task_id: str) -> None:
        if not self._scripts["next_task"](keys=[self.hash_key, self.lock_key], args=[token, task_id, time.time()]):
            raise LockLost(f"job {self.job_id}: lease lost before the next task was recorded")

    def rekick(self, expected_chain: str, new_chain: str, task_id: str) -> bool:
        """Replace a dead chain (see :func:`mqinfer.ops.jobs.sweep`); True if this call did it."""
        return bool(self._scripts["rekick"](keys=[self.hash_key, self.lock_key],
                                            args=[expected_chain, new_chain, task_id, time.time()]))

    # -- fenced writes -----------------------------------------------------------------------
    def update(self, token: str, fields: dict[str, object] | None = None, *, incr: dict[str, int] | None = None,
               expect_status: str | None = None) -> str:
        """Set and increment hash fields if this task still holds the job (and, if given, the
        status is ``expect_status``). Returns the status before; raises LockLost or StatusChanged."""
        fields = fields or {}
        incr = incr or {}
        args: list[object] = [token, expect_status or "", len(fields)]
        for k, v in fields.items():
            args += [k, _text(v)]
        for k, v in incr.items():
            args += [k, int(v)]
        code, status = self._scripts["update"](keys=[self.hash_key, self.lock_key], args=args)
        code, status = int(code), _s(status)
        if code == -1:
            raise LockLost(f"job {self.job_id}: lease lost")
        if code == 0:
            raise StatusChanged(status)
        return status

    def commit_feed(self, token: str, streams: Sequence[str], items: Sequence[FeedItem], *,
                    feed_part: int | None, feed_offset: int | None, skipped: int = 0, counter: str = "fed") -> int:
        """Add ``items`` to the request streams (``item.shard`` indexes the job's shard streams
        ``streams``, by name; ``item.lane`` is a lane of that stream, registered by the caller), note
        them in flight and move the feed cursor: at once on one server, in three ordered steps on two."""
        head: list[object] = [token, "" if feed_part is None else feed_part,
                              "" if feed_offset is None else feed_offset, skipped, counter]
        targets = [item.stream_key(streams) for item in items]
        if not self.split:
            stream_keys = list(dict.fromkeys(targets))
            index = {key: n for n, key in enumerate(stream_keys)}
            args = list(head)
            for item, target in zip(items, targets):
                args += [item.id, item.flight, item.payload, index[target]]
            n = int(self._scripts["feed"](keys=[self.hash_key, self.lock_key, self.inflight_key, *stream_keys],
                                          args=args))
            if n < 0:
                raise LockLost(f"job {self.job_id}: lease lost before feeding")
            return n
        args = list(head)
        for item in items:
            args += [item.id, item.flight]
        n = int(self._scripts["feed_plan"](keys=[self.hash_key, self.lock_key, self.inflight_key], args=args))
        if n < 0:
            raise LockLost(f"job {self.job_id}: lease lost before feeding")
        if not items:
            return 0
        pipe = self.data.pipeline(transaction=False)
        for item, target in zip(items, targets):
            pipe.xadd(target, {"r": item.payload, "v": "1"})
        entry_ids = pipe.execute()
        args = [token]
        for item, entry_id in zip(items, entry_ids):
            args += [item.id, f"{_s(entry_id)} {item.flight}"]
        if int(self._scripts["feed_ids"](keys=[self.lock_key, self.inflight_key], args=args)) < 0:
            raise LockLost(f"job {self.job_id}: lease lost while feeding (the entries were sent)")
        return n

    def commit_collect(self, token: str, cursor: str, part_name: str | None, rows: Iterable[CollectedRow]) -> int:
        """Count collected rows, move the result cursor, record the spool part, trim the stream."""
        args: list[object] = [token, cursor, part_name or ""]
        for row in rows:
            args += [row.id, row.counter, row.prompt_tokens, row.output_tokens,
                     "" if row.cost_usd is None else repr(float(row.cost_usd))]
        job_keys = [self.hash_key, self.lock_key, self.inflight_key, self.parts_key]
        if not self.split:
            job_keys.append(self.results_key)
        n = int(self._scripts["collect"](keys=job_keys, args=args))
        if n < 0:
            raise LockLost(f"job {self.job_id}: lease lost before the collected rows were committed")
        if self.split:
            self.data.xtrim(self.results_key, minid=cursor)
        return n

    def note_lanes(self, lanes: Iterable[tuple[int, str]]) -> None:
        """Remember lanes of the job's own, as (shard, lane), to remove them when it ends."""
        members = [f"{shard} {lane}" for shard, lane in lanes]
        if members:
            self.redis.sadd(self.lanes_key, *members)

    def finish(self, token: str, fields: dict[str, object], *, expect_status: str | None) -> None:
        """Enter a final status: fenced hash update, then the job leaves the active set, its
        transient keys go (a worker's late row re-creates the result stream; it expires) and so do
        its own lanes (:meth:`remove_lanes`)."""
        self.update(token, fields, expect_status=expect_status)
        try:
            self.remove_lanes()
        except redis.RedisError as exc:  # the lanes are swept by the workers once idle anyway
            log.warning("job %s: could not remove its lanes: %s", self.job_id, exc)
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(ACTIVE_JOBS, self.job_id)
        pipe.delete(self.inflight_key, self.lanes_key)
        if not self.split:
            pipe.delete(self.results_key)
        pipe.execute()
        if self.split:
            self.data.delete(self.results_key)
            self.mirror(str(fields.get("status") or self.status()))

    def remove_lanes(self) -> int:
        """Remove the job's own lanes (``--lanes job`` or ``tenant,job``) that are empty with nothing
        pending, stream and registry entry; returns how many. A lane that still holds entries (a
        cancelled job's requests no worker has read yet) stays: the workers remove it once it has
        been empty and unused for a while, as any idle lane."""
        raw = self.redis.hmget(self.hash_key, "lanes", "stream", "shards")
        mode, stream, shards = (_s(v) if v is not None else "" for v in raw)
        if mode not in JOB_LANE_MODES or not stream:
            return 0
        streams = keys.shard_streams(stream, int(shards or 1))
        removed = 0
        for member in self.redis.smembers(self.lanes_key):
            shard, _, lane = _s(member).partition(" ")
            if not shard.isdigit() or int(shard) >= len(streams):
                continue
            removed += bool(lane_scheme.remove_lane(self.data, streams[int(shard)], lane))
        return removed


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _text(value: object) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)
