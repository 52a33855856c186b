"""The asyncio producer client: a driver of the client's sans-IO core over redis.asyncio.

:class:`AsyncClient` is exported by :mod:`mqinfer.client`, next to its blocking twin.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

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
from mqinfer.client_core import ClientCore
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE
from mqinfer.schemas.replies import CANCEL_SCRIPT, CANCEL_TTL_S, ReplyEvent
from mqinfer.schemas.request import Request
from mqinfer.schemas.routing import queue_tier_lookup, tier_homes_of
from mqinfer.schemas.rows import ResultRow

T = TypeVar("T")


class AsyncClient:
    """The asyncio twin of :class:`Client` (same arguments, coroutine methods; ``stream`` is an
    async iterator). Many coroutines may wait on results at once: one of them reads the reply
    stream at a time and sorts out what it reads for all."""

    def __init__(self, redis_url: str | None = None, *, stream: str = "requests", shards: int = 1,
                 cluster: bool = False, client=None, reply_to: str | None = None,
                 max_backlog: int | None = None, backpressure: str = "wait",
                 backpressure_timeout_s: float = 60.0, fmt: str = "msgpack",
                 cancel_ttl_s: int = CANCEL_TTL_S, route: str = "prefix", lanes: str = lane_scheme.DEFAULT_LANES,
                 max_lanes: int = lane_scheme.DEFAULT_MAX_LANES,
                 prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> None:
        if client is None and redis_url is None:
            raise ValueError("AsyncClient needs a redis_url or a client")
        self._core = ClientCore(stream=stream, shards=shards, reply_to=reply_to, max_backlog=max_backlog,
                                backpressure=backpressure, backpressure_timeout_s=backpressure_timeout_s,
                                fmt=fmt, cancel_ttl_s=cancel_ttl_s, route=route,
                                lanes=lanes, max_lanes=max_lanes, prefix_cache_scope=prefix_cache_scope)
        self._owns_redis = client is None
        if client is None:
            client = _async_connect(redis_url, cluster)
        self.redis = client
        import redis.asyncio.cluster

        self._core.cluster = isinstance(client, redis.asyncio.cluster.RedisCluster)
        self._read_lock = asyncio.Lock()  # the read turn: one coroutine reads the reply streams at a time
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self._register_lane = self.redis.register_script(lane_scheme.REGISTER_SCRIPT)

    @property
    def reply_to(self) -> str:
        return self._core.reply_to

    @property
    def router(self):
        """The shard placement (``mqinfer.schemas.routing.PrefixRouter``), as ``Client.router``."""
        return self._core.router

    # -- performing the core's plans ---------------------------------------------------------
    async def _run(self, plan: Plan[T]) -> T:
        """Perform a plan's actions, feeding back each result or error, until it returns."""
        result: Any = None
        error: Exception | None = None
        holding_turn = False
        try:
            while True:
                try:
                    action = plan.send(result) if error is None else plan.throw(error)
                except StopIteration as done:
                    return done.value
                result, error = None, None
                if isinstance(action, TakeReadTurn):
                    result = holding_turn = await self._take_read_turn(action.timeout_s)
                elif isinstance(action, EndReadTurn):
                    holding_turn = False
                    self._read_lock.release()
                else:
                    try:
                        result = await _cancellable(self._perform(action))
                    except Exception as exc:  # the plan decides what a failed call means
                        error = exc
        finally:
            plan.close()
            if holding_turn:
                self._read_lock.release()

    async def _take_read_turn(self, timeout_s: float | None) -> bool:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the lock to a task that
        # was cancelled in the same moment the lock came free, so the cancelled waiter would go
        # on reading with the turn instead of raising CancelledError.
        try:
            async with asyncio.timeout(timeout_s):
                await self._read_lock.acquire()
        except TimeoutError:
            return False
        return True

    async def _perform(self, action) -> Any:
        match action:
            case ReadReplies(cursors, count, block_ms):
                return await self.redis.xread(cursors, count=count, block=block_ms)
            case AddEntries(stream_key, entries):
                pipe = self.redis.pipeline(transaction=False)
                for fields in entries:
                    pipe.xadd(stream_key, fields)
                return await pipe.execute()
            case ReadBacklog(stream_key):
                pipe = self.redis.pipeline(transaction=False)
                pipe.xinfo_groups(stream_key)
                pipe.xlen(stream_key)
                return await pipe.execute()
            case RegisterLane(registry, version_key, lane, max_lanes, shared, reserved):
                return await self._register_lane(keys=[registry, version_key],
                                           args=[lane, time.time(), max_lanes, shared, reserved,
                                                 lane_scheme.WAKE_AFTER_S])
            case CreateGroup(stream_key, group):
                return await self.redis.xgroup_create(stream_key, group, id="0", mkstream=True)
            case AddCancel(key, member, ttl_s):
                return await self._cancel(keys=[key], args=[member, ttl_s])
            case DeleteStream(key):
                return await self.redis.delete(key)
            case Sleep(seconds):
                await asyncio.sleep(seconds)
                return None
        raise TypeError(f"the client cannot perform {action!r}")

    # -- the client's methods (see Client) ---------------------------------------------------
    async def submit(self, request: Request | dict[str, Any], *, job_id: str | None = None,
                     reply: bool = True) -> str:
        """Validate and send one request; returns its id."""
        return (await self.submit_many([request], job_id=job_id, reply=reply))[0]

    async def submit_many(self, requests: Iterable[Request | dict[str, Any]], *, job_id: str | None = None,
                          reply: bool = True, chunk_size: int = 500) -> list[str]:
        """Validate every request, then send them pipelined, ``chunk_size`` per round trip."""
        reqs = self._core.prepare(requests, job_id, reply)
        await self._look_up_tier_homes(reqs)
        return await self._run(self._core.submit(reqs, chunk_size))

    async def _look_up_tier_homes(self, reqs: list[Request]) -> None:
        """With prefix routing over shards: ask where the workers' KV tiers hold the prompts'
        prefixes, so that the router sends them there (docs/kv-tiers.md). A failed lookup routes
        by hash, as the synchronous client does."""
        router = self._core.router
        route_keys = router.unhomed_keys(reqs)
        if not route_keys:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            queue_tier_lookup(pipe, self._core.streams, route_keys)
            found = tier_homes_of(route_keys, await pipe.execute())
        except Exception:  # an optimisation, never a reason to refuse a submission
            return
        router.add_tier_homes(found)

    async def backlog(self, shard: int = 0, *, tenant: str = "default", job_id: str | None = None) -> int:
        """Requests not yet finished (unread plus read and unacked) in the stream that a request of
        ``tenant`` and ``job_id`` goes to: its lane, or the plain stream (of one shard)."""
        return await self._run(self._core.backlog(shard, tenant=tenant, job_id=job_id))

    async def result(self, request_id: str, timeout: float | None = 60.0, *,
                     job_id: str | None = None) -> ResultRow:
        """Wait for a request's final row (choice 0's with n > 1 choices); ``ResultTimeout`` after
        ``timeout`` seconds (None: never)."""
        return await self._run(self._core.result(request_id, job_id, timeout))

    async def choices(self, request_id: str, timeout: float | None = 60.0, *,
                      job_id: str | None = None) -> list[ResultRow]:
        """Every choice's row of a request, in index order (see ``Client.choices``)."""
        return await self._run(self._core.choices(request_id, job_id, timeout))

    async def stream(self, request_id: str, timeout: float | None = 60.0, *,
                     job_id: str | None = None) -> AsyncIterator[ReplyEvent]:
        """The request's events as they come, last its ``Final``; ``timeout`` bounds each wait."""
        events = self._core.event_stream(request_id, job_id, timeout)
        while batch := await self._run(events.next_batch()):
            for event in batch:
                yield event

    async def cancel(self, request_id: str, *, job_id: str | None = None) -> None:
        """Ask workers to stop the request (see ``Client.cancel``)."""
        await self._run(self._core.cancel(request_id, job_id))

    def forget(self, request_id: str, *, job_id: str | None = None) -> None:
        """Drop what is buffered for a request whose replies nobody will read."""
        self._core.forget(request_id, job_id)

    async def close(self, delete_reply_stream: bool = True) -> None:
        await self._run(self._core.close(delete_reply_stream))
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _cancellable(call: Awaitable[T]) -> T:
    """Await ``call`` in a task of its own, so that cancelling the caller raises CancelledError at
    once. On Python 3.11 asyncio.wait_for, which redis-py uses to write each command under its
    socket timeout, returns normally when the task is cancelled as the write completes: awaited
    directly, the call would go on into a blocking read and the caller would never see its
    cancellation. The abandoned call is cancelled and its outcome dropped (a read consumes nothing:
    the next read starts from the same cursors)."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


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
