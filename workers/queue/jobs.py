"""Bulk jobs registered with `mqinfer jobs`, as a worker sees them: their status, read from the
job's hash and cached for a second (a worker asks per request it reads, runs or acks)."""

from __future__ import annotations

import time
from collections.abc import Callable

from mqinfer.schemas import keys
from mqinfer.workers.queue.entries import text

CANCELLED_JOB_STATUSES = ("cancelling", "cancelled")
FINAL_JOB_STATUSES = ("completed", "failed", "expired", "cancelled")
# How long a status read stays good, and how many jobs are remembered at most.
STATUS_CACHE_S = 1.0
MAX_CACHED_JOBS = 10_000


class JobStatuses:
    def __init__(self, redis_client, *, clock: Callable[[], float] = time.time) -> None:
        self.redis = redis_client
        self.clock = clock
        self._cache: dict[str, tuple[float, str | None]] = {}

    def status(self, job_id: str | None) -> str | None:
        """A registered bulk job's status, or None for other requests (no job, or not registered)."""
        if job_id is None:
            return None
        now = self.clock()
        cached = self._cache.get(job_id)
        if cached is not None and now - cached[0] < STATUS_CACHE_S:
            return cached[1]
        raw = self.redis.hget(keys.job_key(job_id), "status")
        status = text(raw) if raw is not None else None
        if len(self._cache) > MAX_CACHED_JOBS:
            self._cache.clear()
        self._cache[job_id] = (now, status)
        return status

    def cancelled(self, job_id: str | None) -> bool:
        """The job is being cancelled: its requests end ``cancelled`` instead of running."""
        return self.status(job_id) in CANCELLED_JOB_STATUSES

    def registered(self, job_id: str | None) -> bool:
        """`mqinfer jobs` registered the job (it sends its lost requests again itself)."""
        return self.status(job_id) is not None

    def wants_rows(self, job_id: str | None) -> bool:
        """The job is registered and still collects rows from its result stream (a late row for a
        finished job must not recreate the stream it deleted)."""
        return self.status(job_id) not in (None, *FINAL_JOB_STATUSES)
