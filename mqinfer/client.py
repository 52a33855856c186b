"""The producer client: submit requests, get their tokens and result rows back, cancel them. No torch.

Three layers that share one wire protocol:

- :class:`Producer` (low level): validate and ``XADD`` requests, pipelined. ``mqinfer submit``,
  ``mqinfer run`` and bulk jobs use it.
- :class:`Client` (blocking) and :class:`AsyncClient` (asyncio): ``submit``, ``submit_many``,
  ``result``, ``stream``, ``cancel``, with backpressure and typed errors. A client owns a reply
  stream ``mqinfer:reply:<uuid>`` and sets it as the ``reply_to`` of what it submits, so workers
  send each request's tokens and final row there.

Both clients are drivers of one sans-IO core (:mod:`mqinfer.client_core`), which holds their
state and makes every decision; they only perform the Redis calls it asks for. The reply and
cancel protocols are in :mod:`mqinfer.schemas.replies`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import redis

from mqinfer.client_actions import (
    AddCancel,
    AddEntries,
    CreateGroup,
    DeleteStream,
    EndReadTurn,
    Plan,
    ReadBacklog,
    RegisterLane,
    ReadReplies,
    Sleep,
    TakeReadTurn,
)
from mqinfer.client_async import AsyncClient
from mqinfer.client_core import (
    BackpressureError,
    ClientCore,
    ClientError,
    NoReplyStream,
    ResultTimeout,
    as_request,
)
from mqinfer.schemas import keys
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE
from mqinfer.schemas.connection import connect, connect_redis, is_cluster
from mqinfer.schemas.errors import RequestError
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
    parse_reply,
)
from mqinfer.schemas.request import Request
from mqinfer.schemas.routing import tier_homes_from
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import encode_entry

__all__ = [
    "AsyncClient", "BackpressureError", "CANCEL_SCRIPT", "Client", "ClientError", "Delta", "Final",
    "NoReplyStream", "Producer", "ReplyWriter", "RequestError", "Restart", "ResultTimeout", "cancel_key",
    "cancel_member", "new_reply_stream", "parse_reply",
]

T = TypeVar("T")


# -- the low-level producer ------------------------------------------------------------------
class Producer:
    """Adds requests to ``mqinfer:{stream}`` or to their lanes (``lanes``, as for :class:`Client`);
    ``client`` may be an existing redis.Redis."""

    # A lane registered this recently is not registered again (the registry's "last used" time
    # need not be exact: workers drop a lane only after an hour unused and empty).
    REREGISTER_S = 60.0

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests",
                 client: redis.Redis | None = None, fmt: str = "msgpack", lanes: str = lane_scheme.DEFAULT_LANES,
                 max_lanes: int = lane_scheme.DEFAULT_MAX_LANES) -> None:
        if client is None and redis_url is None:
            raise ValueError("Producer needs a redis_url or a client")
        self.redis = client if client is not None else connect(redis_url)
        self.stream = stream
        self.stream_key = keys.request_stream(stream)
        self.fmt = fmt
        self.lanes = lane_scheme.parse_lanes(lanes)
        self.max_lanes = lane_scheme.check_max_lanes(max_lanes)
        self._register = self.redis.register_script(lane_scheme.REGISTER_SCRIPT)
        # lane -> (stream key it maps to, when registered)
        self._lane_keys: dict[str, tuple[str, float]] = {}
        self._group_ready = False

    def ensure_group(self, stream_key: str | None = None) -> None:
        """Create the workers' consumer group at the stream's start, so nothing added is missed."""
        try:
            self.redis.xgroup_create(stream_key or self.stream_key, keys.GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @property
    def lane_keys(self) -> list[str]:
        """The stream keys of the lanes this producer has written to, sorted."""
        return sorted({key for key, _ in self._lane_keys.values()})

    def stream_key_for(self, req: Request) -> str:
        """The stream key ``req`` goes to: its lane's (registered, with its group), or the plain one."""
        if not self._group_ready:
            self.ensure_group()
            self._group_ready = True
        lane = lane_scheme.lane_name(self.lanes, req.tenant, req.job_id)
        if lane is None:
            return self.stream_key
        cached = self._lane_keys.get(lane)
        now = time.monotonic()
        if cached is not None and now - cached[1] < self.REREGISTER_S:
            return cached[0]
        used = lane_scheme.register_lane(self.redis, self.stream, lane, self.max_lanes, script=self._register)
        stream_key = keys.request_stream(lane_scheme.lane_stream(self.stream, used))
        self._lane_keys[lane] = (stream_key, now)
        return stream_key

    def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None) -> str:
        """Validate and add one request; returns its stream entry id."""
        req = as_request(request, job_id)
        entry_id = self.redis.xadd(self.stream_key_for(req), encode_entry(req, fmt=self.fmt))
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                    chunk_size: int = 500) -> int:
        """Validate and add many requests, ``chunk_size`` per round trip; returns how many were added.

        Every request of a chunk is validated before the chunk is sent.
        """
        sent = 0
        chunk: list[Request] = []

        def send() -> None:
            nonlocal sent
            targets = [self.stream_key_for(req) for req in chunk]
            pipe = self.redis.pipeline(transaction=False)
            for req, stream_key in zip(chunk, targets):
                pipe.xadd(stream_key, encode_entry(req, fmt=self.fmt))
            pipe.execute()
            sent += len(chunk)
            chunk.clear()

        for obj in requests:
            chunk.append(as_request(obj, job_id))
            if len(chunk) >= chunk_size:
                send()
        if chunk:
            send()
        return sent


# -- the blocking client ---------------------------------------------------------------------
class Client:
    """A blocking producer client (thread-safe).

    ``Client(url)`` submits to ``mqinfer:{requests}``; ``shards=N`` spreads requests over the
    streams ``requests-0 .. requests-{N-1}`` (``cluster=True`` for a Redis Cluster, ``url`` being
    any node): by their leading prompt tokens, so that requests sharing a prefix meet on one shard's
    workers, within a balance slack (``route="prefix"``, see ``mqinfer.schemas.routing``), or by a
    hash of their id (``route="id"``); ``prefix_cache_scope`` is the workers' (``tenant`` by default,
    as theirs), so that a prefix group holds only requests that can share its KV. ``max_backlog``
    turns on backpressure: a submission waits (``backpressure="wait"``, up to
    ``backpressure_timeout_s``) or raises ``BackpressureError`` (``"raise"``) while the stream holds
    more unfinished requests than that.

    Requests get this client's reply stream as ``reply_to`` unless they name their own or are
    submitted with ``reply=False``; ``result`` and ``stream`` read it. Replies a caller never asks
    for stay buffered until :meth:`forget`; read them as they come when submitting a lot (the
    reply stream is capped at about 100,000 messages).
    """

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests", shards: int = 1,
                 cluster: bool = False, client: redis.Redis | None = None, reply_to: str | None = None,
                 max_backlog: int | None = None, backpressure: str = "wait",
                 backpressure_timeout_s: float = 60.0, fmt: str = "msgpack",
                 cancel_ttl_s: int = CANCEL_TTL_S, route: str = "prefix", lanes: str = lane_scheme.DEFAULT_LANES,
                 max_lanes: int = lane_scheme.DEFAULT_MAX_LANES,
                 prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> None:
        if client is None and redis_url is None:
            raise ValueError("Client needs a redis_url or a client")
        self._core = ClientCore(stream=stream, shards=shards, reply_to=reply_to, max_backlog=max_backlog,
                                backpressure=backpressure, backpressure_timeout_s=backpressure_timeout_s,
                                fmt=fmt, cancel_ttl_s=cancel_ttl_s, route=route,
                                lanes=lanes, max_lanes=max_lanes, prefix_cache_scope=prefix_cache_scope)
        self._owns_redis = client is None
        self.redis = client if client is not None else connect_redis(redis_url, cluster=cluster)
        self._core.cluster = is_cluster(self.redis)
        if self._core.router.by_prefix:
            # Prefixes go where the workers' KV tiers hold them (docs/kv-tiers.md).
            self._core.router.tier_homes = tier_homes_from(self.redis, self._core.streams)
        self._state_lock = threading.Lock()  # the core: every step of a plan runs under it
        self._read_lock = threading.Lock()  # the read turn: one thread reads the reply streams at a time
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self._register_lane = self.redis.register_script(lane_scheme.REGISTER_SCRIPT)

    @property
    def reply_to(self) -> str:
        return self._core.reply_to

    @property
    def stream_keys(self) -> list[str]:
        return list(self._core.stream_keys)

    @property
    def router(self):
        """The shard placement (``mqinfer.schemas.routing.PrefixRouter``): its ``load`` per shard
        and ``spilled``, the requests sent elsewhere than their prefix's first shard for balance."""
        return self._core.router

    # -- performing the core's plans ---------------------------------------------------------
    def _run(self, plan: Plan[T]) -> T:
        """Perform a plan's actions, feeding back each result or error, until it returns.

        The plan runs under the state lock, the Redis calls and waits outside it, so submitting
        and looking up results never wait behind a blocking read.
        """
        result: Any = None
        error: Exception | None = None
        holding_turn = False
        try:
            while True:
                with self._state_lock:
                    try:
                        action = plan.send(result) if error is None else plan.throw(error)
                    except StopIteration as done:
                        return done.value
                result, error = None, None
                if isinstance(action, TakeReadTurn):
                    timeout = -1 if action.timeout_s is None else action.timeout_s
                    result = holding_turn = self._read_lock.acquire(timeout=timeout)
                elif isinstance(action, EndReadTurn):
                    holding_turn = False
                    self._read_lock.release()
                else:
                    try:
                        result = self._perform(action)
                    except Exception as exc:  # the plan decides what a failed call means
                        error = exc
        finally:
            plan.close()
            if holding_turn:
                self._read_lock.release()

    def _perform(self, action) -> Any:
        match action:
            case ReadReplies(cursors, count, block_ms):
                return self.redis.xread(cursors, count=count, block=block_ms)
            case AddEntries(stream_key, entries):
                pipe = self.redis.pipeline(transaction=False)
                for fields in entries:
                    pipe.xadd(stream_key, fields)
                return pipe.execute()
            case ReadBacklog(stream_key):
                pipe = self.redis.pipeline(transaction=False)
                pipe.xinfo_groups(stream_key)
                pipe.xlen(stream_key)
                return pipe.execute()
            case RegisterLane(registry, version_key, lane, max_lanes, shared, reserved):
                return self._register_lane(keys=[registry, version_key],
                                           args=[lane, time.time(), max_lanes, shared, reserved,
                                                 lane_scheme.WAKE_AFTER_S])
            case CreateGroup(stream_key, group):
                return self.redis.xgroup_create(stream_key, group, id="0", mkstream=True)
            case AddCancel(key, member, ttl_s):
                return self._cancel(keys=[key], args=[member, ttl_s])
            case DeleteStream(key):
                return self.redis.delete(key)
            case Sleep(seconds):
                time.sleep(seconds)
                return None
        raise TypeError(f"the client cannot perform {action!r}")

    # -- submitting --------------------------------------------------------------------------
    def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None, reply: bool = True) -> str:
        """Validate and send one request; returns its id."""
        return self.submit_many([request], job_id=job_id, reply=reply)[0]

    def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                    reply: bool = True, chunk_size: int = 500) -> list[str]:
        """Validate every request, then send them pipelined, ``chunk_size`` per round trip.

        Returns their ids in order. A bad request raises ``RequestError`` before anything is sent.
        """
        reqs = self._core.prepare(requests, job_id, reply)
        return self._run(self._core.submit(reqs, chunk_size))

    def backlog(self, shard: int = 0, *, tenant: str = "default", job_id: str | None = None) -> int:
        """Requests not yet finished (unread plus read and unacked) in the stream that a request of
        ``tenant`` and ``job_id`` goes to: its lane, or the plain stream (of one shard)."""
        return self._run(self._core.backlog(shard, tenant=tenant, job_id=job_id))

    # -- replies -----------------------------------------------------------------------------
    def result(self, request_id: str, timeout: float | None = 60.0, *, job_id: str | None = None) -> ResultRow:
        """Wait for a request's final row (its result row, as in the results dataset); for a request
        with ``n`` > 1 choices, choice 0's row (:meth:`choices` gives every choice's).

        Raises ``ResultTimeout`` after ``timeout`` seconds (None: wait forever).
        """
        return self._run(self._core.result(request_id, job_id, timeout))

    def choices(self, request_id: str, timeout: float | None = 60.0, *,
                job_id: str | None = None) -> list[ResultRow]:
        """Wait for a request's final message and return every choice's row, in ``index`` order (one
        row for a request with one choice). The final message comes once all of them are written.

        Raises ``ResultTimeout`` after ``timeout`` seconds (None: wait forever).
        """
        return self._run(self._core.choices(request_id, job_id, timeout))

    def stream(self, request_id: str, timeout: float | None = 60.0, *,
               job_id: str | None = None) -> Iterator[ReplyEvent]:
        """The request's events as they come: ``Delta``s, a ``Restart`` if it was redelivered (drop
        what came before), and last its ``Final``. ``timeout`` bounds the wait for each event."""
        events = self._core.event_stream(request_id, job_id, timeout)
        while batch := self._run(events.next_batch()):
            yield from batch

    def cancel(self, request_id: str, *, job_id: str | None = None) -> None:
        """Ask workers to stop the request: it ends with finish_reason ``cancelled`` (unless it
        finished first). Takes effect within about a second wherever the request is."""
        self._run(self._core.cancel(request_id, job_id))

    def forget(self, request_id: str, *, job_id: str | None = None) -> None:
        """Drop what is buffered for a request whose replies nobody will read."""
        with self._state_lock:
            self._core.forget(request_id, job_id)

    def close(self, delete_reply_stream: bool = True) -> None:
        self._run(self._core.close(delete_reply_stream))
        if self._owns_redis:
            self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
