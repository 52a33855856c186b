"""The worker's place in its consumer group, below ``Ingest`` (``workers/queue/ingest.py``) and
``Ownership``: the group itself (created if missing), joining it before the model loads
(``announced``), the consumer that handed-back entries wait under, the dead letters of entries no
row can be written for, and what an entry says before it is decoded (a lane's notice, its job id).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import msgspec
import redis

from mqinfer.schemas import keys
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.lanes import NOTICE_FIELD
from mqinfer.workers.queue.acks import Acks
from mqinfer.workers.queue.entries import text

log = logging.getLogger("mqinfer.worker")

# The consumer that handed-back entries wait under (never a live worker).
HANDBACK_CONSUMER = "mqinfer-handback"
# A consumer that tried to read this recently is a live worker (a blocked XREADGROUP counts).
LIVE_CONSUMER_MS = 10_000
# Dead letters kept, about.
DEAD_LETTERS_MAXLEN = 100_000


def recover_job_id(fields: dict) -> str | None:
    """Best effort: the job_id of an entry that failed validation, so its error row is keyed right."""
    raw = fields.get(b"r") or fields.get("r")
    obj = None
    try:
        if raw is not None:
            obj = msgspec.msgpack.decode(raw)
        else:
            payload = fields.get(b"json") or fields.get("json")
            if payload is not None:
                obj = msgspec.json.decode(payload)
    except Exception:
        return None
    job_id = obj.get("job_id") if isinstance(obj, dict) else None
    if isinstance(job_id, str) and 0 < len(job_id) <= 128 and job_id.isprintable():
        return job_id
    return None


def is_notice(fields: dict) -> bool:
    """A new lane's notice on the plain stream (no request in it)."""
    names = {text(k) for k in fields}
    return NOTICE_FIELD in names and not names & {"r", "json"}


def ensure_group(redis_client, stream_key: str, group: str) -> None:
    """Create the consumer group (and the stream) unless it exists; it starts at the stream's start."""
    try:
        redis_client.xgroup_create(stream_key, group, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@contextlib.contextmanager
def announced(redis_client, stream_key: str, group: str, consumer: str, every_s: float = 2.0) -> Iterator[None]:
    """Join the group as a consumer before the model loads, and keep it marked live until the
    block ends (a claim that claims nothing every ``every_s`` seconds refreshes its idle time).

    Workers already reading count a starting one among the live workers, and one that has never
    been given an entry as about to take its share: so a backlog waiting when several workers
    start is split between them instead of going whole to the first one ready."""
    try:
        redis_client.xgroup_createconsumer(stream_key, group, consumer)
    except redis.exceptions.NoPermissionError:
        log.warning("this Redis user may not run XGROUP CREATECONSUMER (see ops/acl/users.acl): the worker "
                    "joins its group only once loaded, and a backlog waiting meanwhile may go whole to another")
        yield
        return
    stop = threading.Event()

    def touch() -> None:
        while not stop.wait(every_s):
            try:
                redis_client.xautoclaim(stream_key, group, consumer, min_idle_time=2**62, start_id="0-0", count=1)
            except redis.exceptions.RedisError:  # the loop's own reads report a lost server
                pass

    thread = threading.Thread(target=touch, name="mqinfer-announce", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class DeadLetters:
    """Entries without a usable id (or whose content is gone) go to ``mqinfer:{S}:dead`` with the
    reason, then are acked."""

    def __init__(self, redis_client, stream: str, worker: str, *, acks: Acks, metrics) -> None:
        self.redis = redis_client
        self.key = keys.dead_letter_stream(stream)
        self.worker = worker
        self.acks = acks
        self.metrics = metrics

    def send(self, entry_id: str, fields: dict, exc: RequestError) -> None:
        self.metrics.dead_letters.inc()
        log.warning("dead letter %s: %s: %s", entry_id, exc.code, exc.message)
        dead = {"entry_id": entry_id, "error_code": exc.code, "error": exc.message[:2000], "worker": self.worker}
        for k, v in fields.items():
            name = text(k)
            if name in ("r", "json", "v"):
                dead["orig_" + name] = v
        self.redis.xadd(self.key, dead, maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
        self.acks.add_without_row(entry_id)

    def record_gap(self, fields: dict) -> None:
        """A dead letter for entries that no worker read (no entry id to ack)."""
        self.redis.xadd(self.key, fields, maxlen=DEAD_LETTERS_MAXLEN, approximate=True)


__all__ = ["DEAD_LETTERS_MAXLEN", "HANDBACK_CONSUMER", "LIVE_CONSUMER_MS", "DeadLetters", "announced", "ensure_group",
           "is_notice", "recover_job_id"]
