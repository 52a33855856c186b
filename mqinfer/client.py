"""The producer client: submit requests, get their tokens and result rows back, cancel them. No torch.

Three layers, one module, because they share one wire protocol:

- :class:`Producer` (low level): validate and ``XADD`` requests, pipelined. ``mqinfer submit``,
  ``mqinfer run`` and bulk jobs use it.
- :class:`Client` (blocking) and :class:`AsyncClient` (asyncio): ``submit``, ``submit_many``,
  ``result``, ``stream``, ``cancel``, with backpressure and typed errors. A client owns a reply
  stream ``mqinfer:reply:<uuid>`` and sets it as the ``reply_to`` of what it submits, so workers
  send each request's tokens and final row there.

The reply and cancel protocols are in :mod:`mqinfer.schemas.replies`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgspec
import redis

from mqinfer.schemas import errors, keys
from mqinfer.schemas.connection import connect, connect_redis, is_cluster
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.schemas.replies import (
    CANCEL_SCRIPT,
    CANCEL_TTL_S,
    Delta,
    Final,
    ReplyEvent,
    ReplyWriter,
    Restart,
    cancel_key,
    cancel_member,
    new_reply_stream,
    as_text,
    parse_reply,
)
from mqinfer.schemas.request import Request, request_from_obj
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import encode_entry

log = logging.getLogger("mqinfer.client")


__all__ = [
    "AsyncClient", "BackpressureError", "CANCEL_SCRIPT", "Client", "ClientError", "Delta", "Final",
    "NoReplyStream", "Producer", "ReplyWriter", "RequestError", "Restart", "ResultTimeout", "cancel_key",
    "cancel_member", "new_reply_stream", "parse_reply",
]


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


class _Replies:
    """Reply events of many requests, read from shared streams, sorted out per request.

    Deltas from an attempt older than the latest restart, or from another worker than the one
    that restarted the request, are stale (a worker that lost its entry and has not noticed yet)
    and are dropped. Finals are kept (the last ``keep_finals``) so ``result`` can be asked again.
    """

    def __init__(self, keep_finals: int = 10_000) -> None:
        self._events: dict[tuple[str | None, str], deque[ReplyEvent]] = {}
        self._current: dict[tuple[str | None, str], tuple[int, str | None]] = {}
        self._finals: OrderedDict[tuple[str | None, str], Final] = OrderedDict()
        self.keep_finals = keep_finals

    def add(self, event: ReplyEvent) -> None:
        key = (event.job_id, event.id)
        if key in self._finals:
            return  # the request is over; a late duplicate changes nothing
        attempt, worker = self._current.get(key, (0, None))
        if isinstance(event, Restart):
            if event.attempt < attempt:
                return
            self._current[key] = (event.attempt, event.worker)
        elif isinstance(event, Delta):
            if event.attempt < attempt or (worker is not None and event.worker != worker):
                return
            if event.attempt > attempt:
                self._current[key] = (event.attempt, worker)
        else:
            self._finals[key] = event
            while len(self._finals) > self.keep_finals:
                self._finals.popitem(last=False)
            self._current.pop(key, None)
        self._events.setdefault(key, deque()).append(event)

    def take(self, key: tuple[str | None, str]) -> list[ReplyEvent]:
        """Events of one request not yet taken, oldest first (ends with its Final once there)."""
        events = self._events.get(key)
        if not events:
            return []
        out = list(events)
        events.clear()
        if isinstance(out[-1], Final):
            del self._events[key]
        return out

    def final(self, key: tuple[str | None, str]) -> Final | None:
        final = self._finals.get(key)
        if final is not None:
            self._events.pop(key, None)  # result() wants the row only: drop the buffered deltas
        return final

    def forget(self, key: tuple[str | None, str]) -> None:
        self._events.pop(key, None)
        self._current.pop(key, None)
        self._finals.pop(key, None)


# -- the low-level producer ------------------------------------------------------------------
def _as_request(obj: Request | dict[str, Any], job_id: str | None) -> Request:
    req = obj if isinstance(obj, Request) else request_from_obj(obj)
    if job_id is not None and req.job_id != job_id:
        req = msgspec.structs.replace(req, job_id=job_id)
    return req


class Producer:
    """Adds requests to ``mqinfer:{stream}``; ``client`` may be an existing redis.Redis."""

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests",
                 client: redis.Redis | None = None, fmt: str = "msgpack") -> None:
        if client is None and redis_url is None:
            raise ValueError("Producer needs a redis_url or a client")
        self.redis = client if client is not None else connect(redis_url)
        self.stream = stream
        self.stream_key = keys.request_stream(stream)
        self.fmt = fmt

    def ensure_group(self) -> None:
        """Create the workers' consumer group at the stream's start, so nothing added is missed."""
        try:
            self.redis.xgroup_create(self.stream_key, keys.GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None) -> str:
        """Validate and add one request; returns its stream entry id."""
        req = _as_request(request, job_id)
        self.ensure_group()
        entry_id = self.redis.xadd(self.stream_key, encode_entry(req, fmt=self.fmt))
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                    chunk_size: int = 500) -> int:
        """Validate and add many requests, ``chunk_size`` per round trip; returns how many were added.

        Every request of a chunk is validated before the chunk is sent.
        """
        self.ensure_group()
        sent = 0
        chunk: list[Request] = []

        def send() -> None:
            nonlocal sent
            pipe = self.redis.pipeline(transaction=False)
            for req in chunk:
                pipe.xadd(self.stream_key, encode_entry(req, fmt=self.fmt))
            pipe.execute()
            sent += len(chunk)
            chunk.clear()

        for obj in requests:
            chunk.append(_as_request(obj, job_id))
            if len(chunk) >= chunk_size:
                send()
        if chunk:
            send()
        return sent


# -- the client ------------------------------------------------------------------------------
def _backlog_from(groups: list[dict] | None, xlen: int) -> int:
    """Unread (lag) plus read-but-unacked (pending) entries of the workers' group.

    Workers delete acked entries, so XLEN is the same number; it stands in when the server cannot
    compute the lag (it reports none after some deletions).
    """
    for g in groups or []:
        if as_text(g.get("name")) == keys.GROUP:
            lag = g.get("lag")
            if lag is None:
                return xlen
            return int(lag) + int(g.get("pending") or 0)
    return xlen


class _ClientCore:
    """What the blocking and asyncio clients share: settings, validation, sharding, reply state."""

    def __init__(self, *, stream: str, shards: int, reply_to: str | None, max_backlog: int | None,
                 backpressure: str, backpressure_timeout_s: float, fmt: str, cancel_ttl_s: int) -> None:
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
        self.stream = stream
        self.streams = shard_streams(stream, shards)
        self.stream_keys = [keys.request_stream(s) for s in self.streams]
        self.reply_to = reply_to or new_reply_stream()
        if not self.reply_to.startswith(keys.REPLY_PREFIX):
            raise ValueError(f"reply_to must start with {keys.REPLY_PREFIX!r}, got {self.reply_to!r}")
        self.max_backlog = max_backlog
        self.backpressure = backpressure
        self.backpressure_timeout_s = backpressure_timeout_s
        self.fmt = fmt
        self.cancel_ttl_s = cancel_ttl_s
        self.replies = _Replies()
        # (job_id, id) -> reply stream of requests submitted here with another than the client's
        # own (None: without one); the usual case stores nothing, so a long-lived client stays small.
        self._reply_of: dict[tuple[str | None, str], str | None] = {}
        self._cursors: dict[str, str] = {self.reply_to: "0-0"}
        self._groups_made: set[str] = set()

    def shard_of(self, request_id: str, job_id: str | None) -> int:
        return shard_index(request_id, job_id, len(self.streams))

    def prepare(self, requests: Iterable[Request | dict[str, Any]], job_id: str | None,
                reply: bool) -> list[Request]:
        """Validate everything before anything is sent; RequestError names the request and field."""
        out: list[Request] = []
        seen: set[tuple[str | None, str]] = set()
        for n, obj in enumerate(requests):
            try:
                req = _as_request(obj, job_id)
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

    def remember(self, reqs: list[Request]) -> None:
        for req in reqs:
            key = (req.job_id, req.id)
            self.replies.forget(key)  # the same request sent again: what came for the old one is void
            if req.reply_to == self.reply_to:
                self._reply_of.pop(key, None)
                continue
            self._reply_of[key] = req.reply_to
            if req.reply_to is not None and req.reply_to not in self._cursors:
                self._cursors[req.reply_to] = "0-0"

    def reply_stream_for(self, key: tuple[str | None, str]) -> str:
        if key in self._reply_of:
            stream = self._reply_of[key]
            if stream is None:
                raise NoReplyStream(f"request {key[1]!r} was submitted without a reply stream (reply=False)")
            return stream
        return self.reply_to  # submitted elsewhere with this client's reply stream, presumably

    def by_shard(self, reqs: list[Request]) -> dict[int, list[Request]]:
        groups: dict[int, list[Request]] = {}
        for req in reqs:
            groups.setdefault(self.shard_of(req.id, req.job_id), []).append(req)
        return groups

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


def _wait_step(attempt: int) -> float:
    return min(0.05 * (2 ** attempt), 1.0)


class Client:
    """A blocking producer client (thread-safe).

    ``Client(url)`` submits to ``mqinfer:{requests}``; ``shards=N`` spreads requests over the
    streams ``requests-0 .. requests-{N-1}`` by a hash of their id (``cluster=True`` for a Redis
    Cluster, ``url`` being any node). ``max_backlog`` turns on backpressure: a submission waits
    (``backpressure="wait"``, up to ``backpressure_timeout_s``) or raises ``BackpressureError``
    (``"raise"``) while the stream holds more unfinished requests than that.

    Requests get this client's reply stream as ``reply_to`` unless they name their own or are
    submitted with ``reply=False``; ``result`` and ``stream`` read it. Replies a caller never asks
    for stay buffered until :meth:`forget`; read them as they come when submitting a lot (the
    reply stream is capped at about 100,000 messages).
    """

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests", shards: int = 1,
                 cluster: bool = False, client: redis.Redis | None = None, reply_to: str | None = None,
                 max_backlog: int | None = None, backpressure: str = "wait",
                 backpressure_timeout_s: float = 60.0, fmt: str = "msgpack",
                 cancel_ttl_s: int = CANCEL_TTL_S) -> None:
        if client is None and redis_url is None:
            raise ValueError("Client needs a redis_url or a client")
        self._core = _ClientCore(stream=stream, shards=shards, reply_to=reply_to, max_backlog=max_backlog,
                                 backpressure=backpressure, backpressure_timeout_s=backpressure_timeout_s,
                                 fmt=fmt, cancel_ttl_s=cancel_ttl_s)
        self._owns_redis = client is None
        self.redis = client if client is not None else connect_redis(redis_url, cluster=cluster)
        self._cluster = is_cluster(self.redis)
        self._state_lock = threading.Lock()  # reply state and cursors
        self._read_lock = threading.Lock()  # one thread reads the reply streams at a time
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)

    @property
    def reply_to(self) -> str:
        return self._core.reply_to

    @property
    def stream_keys(self) -> list[str]:
        return list(self._core.stream_keys)

    # -- submitting --------------------------------------------------------------------------
    def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None, reply: bool = True) -> str:
        """Validate and send one request; returns its id."""
        return self.submit_many([request], job_id=job_id, reply=reply)[0]

    def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                    reply: bool = True, chunk_size: int = 500) -> list[str]:
        """Validate every request, then send them pipelined, ``chunk_size`` per round trip.

        Returns their ids in order. A bad request raises ``RequestError`` before anything is sent.
        """
        core = self._core
        reqs = core.prepare(requests, job_id, reply)
        for shard, group in core.by_shard(reqs).items():
            self._ensure_group(shard)
            start = 0
            while start < len(group):
                room = self._room(shard)
                chunk = group[start:start + min(chunk_size, room)]
                with self._state_lock:
                    core.remember(chunk)
                pipe = self.redis.pipeline(transaction=False)
                for req in chunk:
                    pipe.xadd(core.stream_keys[shard], encode_entry(req, fmt=core.fmt))
                pipe.execute()
                start += len(chunk)
        return [r.id for r in reqs]

    def _ensure_group(self, shard: int) -> None:
        key = self._core.stream_keys[shard]
        if key in self._core._groups_made:
            return
        try:
            self.redis.xgroup_create(key, keys.GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._core._groups_made.add(key)

    def backlog(self, shard: int = 0) -> int:
        """Requests of one stream not yet finished: unread plus read and unacked."""
        key = self._core.stream_keys[shard]
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(key)
        pipe.xlen(key)
        try:
            groups, xlen = pipe.execute()
        except redis.exceptions.ResponseError:  # no such stream yet
            return 0
        return _backlog_from(groups, xlen)

    def _room(self, shard: int) -> int:
        """How many requests may be sent to this shard now (waits or raises when none)."""
        core = self._core
        limit = core.max_backlog
        if limit is None:
            return 1 << 30
        started = time.monotonic()
        attempt = 0
        while True:
            backlog = self.backlog(shard)
            if backlog < limit:
                return limit - backlog
            waited = time.monotonic() - started
            if core.backpressure == "raise" or waited >= core.backpressure_timeout_s:
                raise BackpressureError(core.stream_keys[shard], backlog, limit, waited)
            time.sleep(min(_wait_step(attempt), max(0.0, core.backpressure_timeout_s - waited)))
            attempt += 1

    # -- replies -----------------------------------------------------------------------------
    def _pump(self, block_s: float) -> None:
        """Read what arrived on the reply streams (blocking up to ``block_s``) and sort it out.

        Called with the read lock held; the state lock is taken only to sort out what was read,
        so submitting and looking up results never wait behind a blocking read.
        """
        core = self._core
        with self._state_lock:
            cursors = dict(core._cursors)
        if self._cluster and len(cursors) > 1:  # one XREAD cannot span slots: read each, then wait
            responses = [self.redis.xread({key: cursor}, count=1000) for key, cursor in cursors.items()]
            with self._state_lock:
                got = sum(core.dispatch(r) for r in responses)
            if not got:
                time.sleep(min(block_s, 0.05))
            return
        response = self.redis.xread(cursors, count=1000, block=max(1, int(block_s * 1000)))
        with self._state_lock:
            core.dispatch(response)

    def _wait(self, ready, deadline: float | None, what: str):
        """Until ``ready()`` gives something: whoever holds the read lock reads for every thread."""
        while True:
            with self._state_lock:
                value = ready()
            if value:
                return value
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(what)
            if not self._read_lock.acquire(timeout=-1 if remaining is None else remaining):
                raise ResultTimeout(what)
            try:
                with self._state_lock:
                    value = ready()  # another thread may have read it meanwhile
                if value:
                    return value
                remaining = 1.0 if deadline is None else deadline - time.monotonic()
                if remaining > 0:
                    self._pump(min(remaining, 1.0))
            finally:
                self._read_lock.release()

    def result(self, request_id: str, timeout: float | None = 60.0, *, job_id: str | None = None) -> ResultRow:
        """Wait for a request's final row (its result row, as in the results dataset).

        Raises ``ResultTimeout`` after ``timeout`` seconds (None: wait forever).
        """
        key = (job_id, request_id)
        self._core.reply_stream_for(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        final = self._wait(lambda: self._core.replies.final(key), deadline,
                           f"no result for request {request_id!r} within {timeout}s")
        return final.row

    def stream(self, request_id: str, timeout: float | None = 60.0, *,
               job_id: str | None = None) -> Iterator[ReplyEvent]:
        """The request's events as they come: ``Delta``s, a ``Restart`` if it was redelivered (drop
        what came before), and last its ``Final``. ``timeout`` bounds the wait for each event."""
        key = (job_id, request_id)
        self._core.reply_stream_for(key)
        while True:
            deadline = None if timeout is None else time.monotonic() + timeout
            events = self._wait(lambda: self._core.replies.take(key), deadline,
                                f"no message for request {request_id!r} within {timeout}s")
            for event in events:
                yield event
                if isinstance(event, Final):
                    return

    def cancel(self, request_id: str, *, job_id: str | None = None) -> None:
        """Ask workers to stop the request: it ends with finish_reason ``cancelled`` (unless it
        finished first). Takes effect within about a second wherever the request is."""
        core = self._core
        shard = core.shard_of(request_id, job_id)
        self._cancel(keys=[cancel_key(core.streams[shard])],
                     args=[cancel_member(request_id, job_id), core.cancel_ttl_s])

    def forget(self, request_id: str, *, job_id: str | None = None) -> None:
        """Drop what is buffered for a request whose replies nobody will read."""
        with self._state_lock:
            self._core.forget(request_id, job_id)

    def close(self, delete_reply_stream: bool = True) -> None:
        if delete_reply_stream:
            try:
                self.redis.delete(self._core.reply_to)
            except redis.exceptions.RedisError:
                pass  # it expires on its own
        if self._owns_redis:
            self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of :class:`Client` (same arguments, coroutine methods; ``stream`` is an
    async iterator). Many coroutines may wait on results at once: one of them reads the reply
    stream at a time and sorts out what it reads for all."""

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests", shards: int = 1,
                 cluster: bool = False, client=None, reply_to: str | None = None,
                 max_backlog: int | None = None, backpressure: str = "wait",
                 backpressure_timeout_s: float = 60.0, fmt: str = "msgpack",
                 cancel_ttl_s: int = CANCEL_TTL_S) -> None:
        if client is None and redis_url is None:
            raise ValueError("AsyncClient needs a redis_url or a client")
        self._core = _ClientCore(stream=stream, shards=shards, reply_to=reply_to, max_backlog=max_backlog,
                                 backpressure=backpressure, backpressure_timeout_s=backpressure_timeout_s,
                                 fmt=fmt, cancel_ttl_s=cancel_ttl_s)
        self._owns_redis = client is None
        if client is None:
            client = _async_connect(redis_url, cluster)
        self.redis = client
        import redis.asyncio.cluster

        self._cluster = isinstance(client, redis.asyncio.cluster.RedisCluster)
        self._read_lock = asyncio.Lock()
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)

    @property
    def reply_to(self) -> str:
        return self._core.reply_to

    async def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None,
                     reply: bool = True) -> str:
        return (await self.submit_many([request], job_id=job_id, reply=reply))[0]

    async def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                          reply: bool = True, chunk_size: int = 500) -> list[str]:
        core = self._core
        reqs = core.prepare(requests, job_id, reply)
        for shard, group in core.by_shard(reqs).items():
            await self._ensure_group(shard)
            start = 0
            while start < len(group):
                room = await self._room(shard)
                chunk = group[start:start + min(chunk_size, room)]
                core.remember(chunk)
                pipe = self.redis.pipeline(transaction=False)
                for req in chunk:
                    pipe.xadd(core.stream_keys[shard], encode_entry(req, fmt=core.fmt))
                await pipe.execute()
                start += len(chunk)
        return [r.id for r in reqs]

    async def _ensure_group(self, shard: int) -> None:
        key = self._core.stream_keys[shard]
        if key in self._core._groups_made:
            return
        try:
            await self.redis.xgroup_create(key, keys.GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._core._groups_made.add(key)

    async def backlog(self, shard: int = 0) -> int:
        key = self._core.stream_keys[shard]
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(key)
        pipe.xlen(key)
        try:
            groups, xlen = await pipe.execute()
        except redis.exceptions.ResponseError:
            return 0
        return _backlog_from(groups, xlen)

    async def _room(self, shard: int) -> int:
        core = self._core
        limit = core.max_backlog
        if limit is None:
            return 1 << 30
        started = time.monotonic()
        attempt = 0
        while True:
            backlog = await self.backlog(shard)
            if backlog < limit:
                return limit - backlog
            waited = time.monotonic() - started
            if core.backpressure == "raise" or waited >= core.backpressure_timeout_s:
                raise BackpressureError(core.stream_keys[shard], backlog, limit, waited)
            await asyncio.sleep(min(_wait_step(attempt), max(0.0, core.backpressure_timeout_s - waited)))
            attempt += 1

    async def _pump(self, block_s: float) -> None:
        core = self._core
        cursors = dict(core._cursors)
        if self._cluster and len(cursors) > 1:
            got = 0
            for key, cursor in cursors.items():
                got += core.dispatch(await self.redis.xread({key: cursor}, count=1000))
            if not got:
                await asyncio.sleep(min(block_s, 0.05))
            return
        core.dispatch(await self.redis.xread(cursors, count=1000, block=max(1, int(block_s * 1000))))

    async def _wait(self, ready, deadline: float | None, what: str):
        """Until ``ready()`` gives something: whoever holds the read lock reads for everyone."""
        while True:
            value = ready()
            if value:
                return value
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(what)
            try:
                await asyncio.wait_for(self._read_lock.acquire(), remaining)
            except asyncio.TimeoutError:
                raise ResultTimeout(what) from None
            try:
                value = ready()  # another coroutine may have read it meanwhile
                if value:
                    return value
                remaining = 1.0 if deadline is None else deadline - time.monotonic()
                if remaining > 0:
                    await self._pump(min(remaining, 1.0))
            finally:
                self._read_lock.release()

    async def result(self, request_id: str, timeout: float | None = 60.0, *,
                     job_id: str | None = None) -> ResultRow:
        key = (job_id, request_id)
        self._core.reply_stream_for(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        final = await self._wait(lambda: self._core.replies.final(key), deadline,
                                 f"no result for request {request_id!r} within {timeout}s")
        return final.row

    async def stream(self, request_id: str, timeout: float | None = 60.0, *,
                     job_id: str | None = None) -> AsyncIterator[ReplyEvent]:
        key = (job_id, request_id)
        self._core.reply_stream_for(key)
        while True:
            deadline = None if timeout is None else time.monotonic() + timeout
            events = await self._wait(lambda: self._core.replies.take(key), deadline,
                                      f"no message for request {request_id!r} within {timeout}s")
            for event in events:
                yield event
                if isinstance(event, Final):
                    return

    async def cancel(self, request_id: str, *, job_id: str | None = None) -> None:
        core = self._core
        shard = core.shard_of(request_id, job_id)
        await self._cancel(keys=[cancel_key(core.streams[shard])],
                           args=[cancel_member(request_id, job_id), core.cancel_ttl_s])

    def forget(self, request_id: str, *, job_id: str | None = None) -> None:
        self._core.forget(request_id, job_id)

    async def close(self, delete_reply_stream: bool = True) -> None:
        if delete_reply_stream:
            try:
                await self.redis.delete(self._core.reply_to)
            except redis.exceptions.RedisError:
                pass
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _async_connect(url: str, cluster: bool):
    import redis.asyncio
    import redis.asyncio.cluster

    from mqinfer.schemas.connection import redact

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix") or (cluster and scheme == "unix"):
        raise ValueError(f"unsupported Redis URL {redact(url)!r} for the asyncio client")
    if cluster:
        return redis.asyncio.cluster.RedisCluster.from_url(url, socket_connect_timeout=10)
    return redis.asyncio.Redis.from_url(url, socket_connect_timeout=10, health_check_interval=30)
