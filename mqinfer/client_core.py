"""The producer client's sans-IO core: every state and decision of ``Client`` and ``AsyncClient``.

The core never talks to Redis, never sleeps and takes no lock. Each operation (submit, backlog,
result, the next events of a stream, cancel, close) is a *plan*: a generator that yields
actions, plain data saying what to send, what to read or how long to wait, and receives each
action's result through ``send`` (or the error it raised through ``throw``) until it returns the
operation's value. The drivers, :class:`mqinfer.client.Client` (redis-py, threads) and
:class:`mqinfer.client_async.AsyncClient` (redis.asyncio), perform the actions; what a result
or an error means is decided here. Time comes from an injected clock, and every timeout is a
deadline on it, so tests drive a plan by hand without a server and without sleeping.

Reading replies is shared: many callers may wait at once, and one of them at a time (the one
holding the driver's *read turn*) reads the reply streams and sorts out what it read for all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
import redis.exceptions

from mqinfer.client_actions import (
    AddCancel,
    AddEntries,
    CreateGroup,
    DeleteStream,
    EndReadTurn,
    Plan,
    ReadBacklog,
    ReadReplies,
    RegisterLane,
    Sleep,
    TakeReadTurn,
)
from mqinfer.client_replies import ReplyBook, RequestKey
from mqinfer.schemas import errors, keys
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.schemas.routing import PrefixRouter
from mqinfer.schemas.replies import (
    CANCEL_TTL_S,
    Final,
    ReplyEvent,
    as_text,
    cancel_key,
    cancel_member,
    new_reply_stream,
    parse_reply,
)
from mqinfer.schemas.request import Request, request_from_obj
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import encode_entry

log = logging.getLogger("mqinfer.client")

T = TypeVar("T")
READ_COUNT = 1000  # reply messages per XREAD
MAX_BLOCK_S = 1.0  # longest blocking read, so that reply streams named meanwhile are read soon
UNLIMITED = 1 << 30  # room on a stream without backpressure


# -- errors ----------------------------------------------------------------------------------
class ClientError(Exception):
    """Base of the client's own errors (a bad request raises ``RequestError`` instead)."""


class BackpressureError(ClientError):
    """The request stream's backlog stayed over ``max_backlog``: nothing was sent."""

    def __init__(self, stream_key: str, backlog: int, limit: int, waited_s: float) -> None:
        waited = f" after waiting {waited_s:.1f}s" if waited_s > 0 else ""
        super().__init__(f"{stream_key} has a backlog of {backlog} requests (limit {limit}){waited}; "
                         "nothing was sent")
        self.stream_key = stream_key
        self.backlog = backlog
        self.limit = limit


class ResultTimeout(ClientError, TimeoutError):
    """No final row (or, for ``stream``, no message) arrived in time. The request may still run."""


class NoReplyStream(ClientError):
    """``result``/``stream`` for a request submitted without a reply stream."""


def as_request(obj: Request | dict[str, Any], job_id: str | None) -> Request:
    """A checked Request (RequestError names the field), stamped with ``job_id`` if given."""
    req = obj if isinstance(obj, Request) else request_from_obj(obj)
    if job_id is not None and req.job_id != job_id:
        req = msgspec.structs.replace(req, job_id=job_id)
    return req


def backlog_from(groups: list[dict] | None, xlen: int) -> int:
    """Unread (lag) plus read-but-unacked (pending) entries of the workers' group.

    Workers delete acked entries, so XLEN is the same number; it stands in when the server cannot
    compute the lag (it reports none after some deletions).
    """
    for g in groups or []:
        if as_text(g.get("name")) == keys.GROUP:
            lag = g.get("lag")
            if lag is None:
                return int(xlen)
            return int(lag) + int(g.get("pending") or 0)
    return int(xlen)


def wait_step(attempt: int) -> float:
    """Seconds between backlog checks while waiting for room: 50 ms, doubling up to 1 s."""
    return min(0.05 * (2 ** attempt), 1.0)


class ClientCore:
    """What a client knows and decides: settings, validation, sharding, backpressure, reply state.

    ``cluster`` (set by the driver once connected) makes reply reads one XREAD per stream, since
    one XREAD cannot span the slots of a Redis Cluster.
    """

    def __init__(self, *, stream: str = "requests", shards: int = 1, reply_to: str | None = None,
                 max_backlog: int | None = None, backpressure: str = "wait",
                 backpressure_timeout_s: float = 60.0, fmt: str = "msgpack", cancel_ttl_s: int = CANCEL_TTL_S,
                 cluster: bool = False, clock: Callable[[], float] = time.monotonic,
                 route: str = "prefix", lanes: str = lane_scheme.DEFAULT_LANES,
                 max_lanes: int = lane_scheme.DEFAULT_MAX_LANES,
                 prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> None:
        if backpressure not in ("wait", "raise"):
            raise ValueError(f"backpressure must be 'wait' or 'raise', got {backpressure!r}")
        if max_backlog is not None and max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1 or None, got {max_backlog}")
        if fmt not in ("msgpack", "json"):
            raise ValueError(f"fmt must be 'msgpack' or 'json', got {fmt!r}")
        if cancel_ttl_s < 1:
            raise ValueError(f"cancel_ttl_s must be >= 1, got {cancel_ttl_s}")
        if not stream or "{" in stream or "}" in stream:
            raise ValueError(f"invalid stream name {stream!r} (braces would break its hash tag)")
        self.lanes = lane_scheme.parse_lanes(lanes)
        self.max_lanes = lane_scheme.check_max_lanes(max_lanes)
        self.stream = stream
        self.streams = shard_streams(stream, shards)
        self.stream_keys = [keys.request_stream(s) for s in self.streams]
        self.router = PrefixRouter(len(self.streams), route=route, prefix_cache_scope=prefix_cache_scope)
        self.reply_to = reply_to or new_reply_stream()
        if not self.reply_to.startswith(keys.REPLY_PREFIX):
            raise ValueError(f"reply_to must start with {keys.REPLY_PREFIX!r}, got {self.reply_to!r}")
        self.max_backlog = max_backlog
        self.backpressure = backpressure
        self.backpressure_timeout_s = backpressure_timeout_s
        self.fmt = fmt
        self.cancel_ttl_s = cancel_ttl_s
        self.cluster = cluster
        self.clock = clock
        self.replies = ReplyBook()
        # (job_id, id) -> reply stream of requests submitted here with another than the client's
        # own (None: without one); the usual case stores nothing, so a long-lived client stays small.
        self._reply_of: dict[RequestKey, str | None] = {}
        self._cursors: dict[str, str] = {self.reply_to: "0-0"}  # last message read, per reply stream
        self._groups_made: set[str] = set()

    # -- requests ----------------------------------------------------------------------------
    def shard_of(self, request_id: str, job_id: str | None) -> int:
        """The shard of a request by its id alone: where it lives unless prefix routing moved it."""
        return shard_index(request_id, job_id, len(self.streams))

    def prepare(self, requests: Iterable[Request | dict[str, Any]], job_id: str | None,
                reply: bool) -> list[Request]:
        """Validate everything before anything is sent; RequestError names the request and field."""
        out: list[Request] = []
        seen: set[RequestKey] = set()
        for n, obj in enumerate(requests):
            try:
                req = as_request(obj, job_id)
            except RequestError as exc:
                where = f"request {exc.request_id!r}" if exc.request_id else f"request #{n}"
                raise RequestError(exc.code, f"{where}: {exc.message}", exc.request_id) from None
            if reply and req.reply_to is None:
                req = msgspec.structs.replace(req, reply_to=self.reply_to)
            key = (req.job_id, req.id)
            if key in seen:
                raise RequestError(errors.INVALID_REQUEST,
                                   f"request #{n}: id {req.id!r} appears twice in one submission - at `$.id`",
                                   req.id)
            seen.add(key)
            out.append(req)
        return out

    def submit(self, reqs: list[Request], chunk_size: int = 500) -> Plan[list[str]]:
        """Send prepared requests to their shards, ``chunk_size`` per round trip and never more
        than a shard has room for; returns their ids in order."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        groups: dict[int, list[Request]] = {}
        for req, shard in zip(reqs, self.router.assign(reqs)):
            groups.setdefault(shard, []).append(req)
        for shard, group in groups.items():
            by_lane: dict[str | None, list[Request]] = {}
            for req in group:
                by_lane.setdefault(lane_scheme.lane_name(self.lanes, req.tenant, req.job_id), []).append(req)
            for lane, lane_group in by_lane.items():
                stream_key = yield from self._lane_key(shard, lane)
                start = 0
                while start < len(lane_group):
                    room = yield from self._room(stream_key)
                    chunk = lane_group[start:start + min(chunk_size, room)]
                    self.remember(chunk)  # before sending: a quick reply must not be forgotten
                    yield AddEntries(stream_key, [encode_entry(req, fmt=self.fmt) for req in chunk])
                    start += len(chunk)
        return [r.id for r in reqs]

    def _lane_key(self, shard: int, lane: str | None) -> Plan[str]:
        """The stream key of a lane of a shard, registered (bounded by ``max_lanes``) and with its
        group; a new lane's notice goes to the plain stream, waking a worker blocked reading."""
        stream = self.streams[shard]
        plain_key = self.stream_keys[shard]
        yield from self._ensure_group(plain_key)
        if lane is None:
            return plain_key
        used, fresh = yield RegisterLane(
            lane_scheme.registry_key(stream), lane_scheme.registry_version_key(stream), lane, self.max_lanes,
            lane_scheme.shared_lane(lane, self.max_lanes), lane_scheme.shared_count(self.max_lanes))
        stream_key = keys.request_stream(lane_scheme.lane_stream(stream, as_text(used)))
        yield from self._ensure_group(stream_key)
        if int(fresh):
            yield AddEntries(plain_key, [{lane_scheme.NOTICE_FIELD: as_text(used)}])
        return stream_key

    def remember(self, reqs: list[Request]) -> None:
        """Note where the replies of requests about to be sent will come."""
        for req in reqs:
            key = (req.job_id, req.id)
            self.replies.forget(key)  # the same request sent again: what came for the old one is void
            if req.reply_to == self.reply_to:
                self._reply_of.pop(key, None)
                continue
            self._reply_of[key] = req.reply_to
            if req.reply_to is not None and req.reply_to not in self._cursors:
                self._cursors[req.reply_to] = "0-0"

    def _ensure_group(self, stream_key: str) -> Plan[None]:
        if stream_key in self._groups_made:
            return
        try:
            yield CreateGroup(stream_key, keys.GROUP)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups_made.add(stream_key)

    # -- backpressure ------------------------------------------------------------------------
    def backlog(self, shard: int = 0, *, tenant: str = lane_scheme.DEFAULT_TENANT,
                job_id: str | None = None) -> Plan[int]:
        """Requests not yet finished in the stream (of one shard) that a request of ``tenant`` and
        ``job_id`` goes to: its lane's (see ``lanes``), or the plain stream's. Unread plus read and
        unacked."""
        if not 0 <= shard < len(self.stream_keys):
            raise ValueError(f"shard must be in 0..{len(self.stream_keys) - 1}, got {shard}")
        lane = lane_scheme.lane_name(self.lanes, tenant, job_id)
        return (yield from self._backlog(keys.request_stream(lane_scheme.lane_stream(self.streams[shard], lane))))

    def _backlog(self, stream_key: str) -> Plan[int]:
        try:
            groups, xlen = yield ReadBacklog(stream_key)
        except redis.exceptions.ResponseError:  # no such stream yet
            return 0
        return backlog_from(groups, xlen)

    def _room(self, stream_key: str) -> Plan[int]:
        """How many requests may be sent to this stream (a lane, or the plain stream) now: waits
        for room, or raises. Each lane has its own backlog limit, so one tenant's backlog holds
        back only that tenant's producers."""
        limit = self.max_backlog
        if limit is None:
            return UNLIMITED
        started = self.clock()
        attempt = 0
        while True:
            backlog = yield from self._backlog(stream_key)
            if backlog < limit:
                return limit - backlog
            waited = self.clock() - started
            if self.backpressure == "raise" or waited >= self.backpressure_timeout_s:
                raise BackpressureError(stream_key, backlog, limit, waited)
            yield Sleep(min(wait_step(attempt), self.backpressure_timeout_s - waited))
            attempt += 1

    # -- replies -----------------------------------------------------------------------------
    def reply_stream_for(self, key: RequestKey) -> str:
        """Where the request's replies come; NoReplyStream if it was sent without one."""
        if key in self._reply_of:
            stream = self._reply_of[key]
            if stream is None:
                raise NoReplyStream(f"request {key[1]!r} was submitted without a reply stream (reply=False)")
            return stream
        return self.reply_to  # submitted elsewhere with this client's reply stream, presumably

    @property
    def cursors(self) -> dict[str, str]:
        """Where the next read starts: the last message read, per reply stream."""
        return dict(self._cursors)

    def deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self.clock() + timeout

    def result(self, request_id: str, job_id: str | None, timeout: float | None) -> Plan[ResultRow]:
        """Wait for a request's final row (choice 0's, with n > 1 choices); ResultTimeout after
        ``timeout`` seconds (None: never)."""
        final = yield from self._final(request_id, job_id, timeout)
        return final.row

    def choices(self, request_id: str, job_id: str | None, timeout: float | None) -> Plan[list[ResultRow]]:
        """Wait for a request's final message: every choice's row, in index order."""
        final = yield from self._final(request_id, job_id, timeout)
        return final.rows

    def _final(self, request_id: str, job_id: str | None, timeout: float | None) -> Plan[Final]:
        key = (job_id, request_id)
        self.reply_stream_for(key)
        return (yield from self._wait(lambda: self.replies.final(key), self.deadline(timeout),
                                      f"no result for request {request_id!r} within {timeout}s"))

    def event_stream(self, request_id: str, job_id: str | None, timeout: float | None) -> "EventStream":
        return EventStream(self, (job_id, request_id), timeout)

    def _wait(self, ready: Callable[[], T], deadline: float | None, what: str) -> Plan[T]:
        """Until ``ready()`` gives something: take the read turn, read, sort out, try again."""
        while True:
            value = ready()
            if value:
                return value
            remaining = None if deadline is None else deadline - self.clock()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(what)
            if not (yield TakeReadTurn(remaining)):
                raise ResultTimeout(what)
            value = ready()  # whoever read before this turn may have brought it
            if not value:
                block_s = MAX_BLOCK_S if deadline is None else min(deadline - self.clock(), MAX_BLOCK_S)
                if block_s > 0:
                    yield from self._read_replies(block_s)
            yield EndReadTurn()
            if value:
                return value

    def _read_replies(self, block_s: float) -> Plan[None]:
        """Read what arrived on the reply streams (blocking up to ``block_s``) and sort it out."""
        cursors = self.cursors
        if self.cluster and len(cursors) > 1:  # one XREAD cannot span slots: read each, then wait
            got = 0
            for stream_key, cursor in cursors.items():
                got += self.dispatch((yield ReadReplies({stream_key: cursor}, READ_COUNT, None)))
            if not got:
                yield Sleep(min(block_s, 0.05))
            return
        self.dispatch((yield ReadReplies(cursors, READ_COUNT, max(1, int(block_s * 1000)))))

    def dispatch(self, response) -> int:
        """Sort an XREAD response into per-request events; returns how many messages it held."""
        n = 0
        for stream_key, messages in response or []:
            stream_key = as_text(stream_key)
            for msg_id, fields in messages:
                self._cursors[stream_key] = as_text(msg_id)
                n += 1
                try:
                    event = parse_reply(fields)
                except ValueError as exc:
                    log.warning("skipping reply message %s on %s: %s", as_text(msg_id), stream_key, exc)
                    continue
                self.replies.add(event)
        return n

    def forget(self, request_id: str, job_id: str | None = None) -> None:
        key = (job_id, request_id)
        self.replies.forget(key)
        self._reply_of.pop(key, None)

    # -- cancel and close --------------------------------------------------------------------
    def cancel(self, request_id: str, job_id: str | None) -> Plan[None]:
        """Add the request to its stream's cancel set (the script stamps the server's time); with
        prefix routing, where the request went depends on its prompt, so to every shard's set."""
        if self.router.by_prefix:
            shards = range(len(self.streams))
        else:
            shards = [self.shard_of(request_id, job_id)]
        for shard in shards:
            yield AddCancel(cancel_key(self.streams[shard]), cancel_member(request_id, job_id), self.cancel_ttl_s)

    def close(self, delete_reply_stream: bool) -> Plan[None]:
        """Delete the reply stream; if that fails it expires on its own."""
        if not delete_reply_stream:
            return
        try:
            yield DeleteStream(self.reply_to)
        except redis.exceptions.RedisError:
            pass


class EventStream:
    """The state of one ``stream`` call: a request's events, batch by batch, up to its Final."""

    def __init__(self, core: ClientCore, key: RequestKey, timeout: float | None) -> None:
        self.core = core
        self.key = key
        self.timeout = timeout
        self.checked = False
        self.done = False

    def next_batch(self) -> Plan[list[ReplyEvent]]:
        """The events that came since the last batch, waiting up to ``timeout`` for the first;
        the batch that holds the Final ends with it, and after it every batch is empty."""
        if self.done:
            return []
        core = self.core
        if not self.checked:
            core.reply_stream_for(self.key)
            self.checked = True
        events = yield from core._wait(lambda: core.replies.take(self.key), core.deadline(self.timeout),
                                       f"no message for request {self.key[1]!r} within {self.timeout}s")
        self.done = isinstance(events[-1], Final)
        return events
