"""The producer client: validate requests and add them to the request stream. No torch here.

``Producer(redis_url).submit(request)`` validates before anything is sent (a bad request raises
``RequestError`` naming the field) and pipelines ``XADD`` for many requests at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import redis

from mqinfer import keys
from mqinfer.schemas.request import Request, request_from_obj
from mqinfer.schemas.stream import encode_entry
from mqinfer.server import connect


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
