"""Cost caps of bulk jobs (``--max-cost-usd`` of `mqinfer run` and `mqinfer jobs submit`), as a
worker enforces them.

A job's cap and spend live in its hash ``mqinfer:job:{JOB}:cost`` (:func:`keys.job_cost`):
``max_cost_usd``, set by the command that submits the job, and ``spent_usd``, which every
worker raises by a request's cost when it acks the request's entry (in the ack transaction; in
a Redis Cluster, right after it, as the hash lives in the job's slot).

A worker starts a request of a capped job (moves it from the batcher into the engine) only while
the job's spend is below the cap, counting: what is acked (read from the hash at most every
``refresh_s``, and at every check once within ``NEAR_CAP`` of the cap), this worker's rows of the
job written and not acked yet, and the estimate of its requests of the job in the engine (the
device time they used so far, at the worker's price). Otherwise the request ends with an error
row ``budget_exceeded`` and costs nothing. Requests already in an engine finish: a job spends at
most its cap plus the cost of the requests in flight when it reached it (another worker's rows
count once it acks them). Running the job again with a higher cap carries on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError

from mqinfer.schemas import keys
from mqinfer.workers.queue.entries import text

log = logging.getLogger("mqinfer.worker")

# How long a read of a job's cap and spend stays good, and how many jobs are remembered at most.
REFRESH_S = 1.0
MAX_CACHED_JOBS = 10_000
# From this fraction of its cap on, a job's spend is read again at every check.
NEAR_CAP = 0.8


class JobCaps:
    def __init__(self, redis_client, *, clock: Callable[[], float] = time.time, refresh_s: float = REFRESH_S) -> None:
        self.redis = redis_client
        self.clock = clock
        self.refresh_s = refresh_s
        # job id -> (read at, cap or None, acked spend)
        self._read: dict[str, tuple[float, float | None, float]] = {}

    def _cap(self, job_id: str, *, fresh: bool = False) -> tuple[float | None, float]:
        now = self.clock()
        cached = self._read.get(job_id)
        if fresh or cached is None or now - cached[0] >= self.refresh_s:
            try:
                cap, spent = self.redis.hmget(keys.job_cost(job_id), "max_cost_usd", "spent_usd")
            except RedisError as exc:
                # Redis is away (the worker's loop backs off and reconnects elsewhere): go on with
                # the last reading, and start requests of a job never read, rather than stop here.
                log.debug("job %s: cost cap unavailable (%s)", job_id, exc)
                return (cached[1], cached[2]) if cached is not None else (None, 0.0)
            if len(self._read) > MAX_CACHED_JOBS:
                self._read.clear()
            cached = (now, float(text(cap)) if cap is not None else None, float(text(spent)) if spent else 0.0)
            self._read[job_id] = cached
        return cached[1], cached[2]

    def capped(self, job_id: str | None) -> bool:
        """The job has a cost cap (read at most every ``refresh_s``)."""
        return job_id is not None and self._cap(job_id)[0] is not None

    def exceeded(self, job_id: str | None, local_usd: Callable[[str], float]) -> str | None:
        """Why a request of ``job_id`` may not start, or None. ``local_usd(job_id)``: this worker's
        spend on the job not acked yet (rows written, requests in the engine)."""
        if job_id is None:
            return None
        cap, spent = self._cap(job_id)
        if cap is None:
            return None
        local = local_usd(job_id)
        if spent + local >= NEAR_CAP * cap:
            cap, spent = self._cap(job_id, fresh=True)
            if cap is None:
                return None
        total = spent + local
        if total < cap:
            return None
        return (f"job {job_id!r} reached its cost cap: ${total:.6f} spent or in flight of its "
                f"${cap:.6f} (--max-cost-usd); run it again with a higher cap to carry on")

    def queue_charges(self, pipe, charges: Iterable[tuple[str, float]]) -> list[str]:
        """Queue on ``pipe`` the spend of acked rows, (job id, USD) each, for the capped jobs;
        returns those jobs, to pass to :meth:`charged` once ``pipe`` ran."""
        per_job: dict[str, float] = {}
        for job_id, usd in charges:
            if usd > 0 and self.capped(job_id):
                per_job[job_id] = per_job.get(job_id, 0.0) + usd
        for job_id, usd in per_job.items():
            pipe.hincrbyfloat(keys.job_cost(job_id), "spent_usd", usd)
        return list(per_job)

    def charged(self, job_ids: Iterable[str]) -> None:
        """The charges went through: read these jobs' spend again at their next check."""
        for job_id in job_ids:
            self._read.pop(job_id, None)


def set_cap(client, job_id: str, max_cost_usd: float, *, spent_usd: float | None = None) -> None:
    """Give ``job_id`` the cost cap ``max_cost_usd`` (a later call with a higher one lets it carry
    on); ``spent_usd``: what the job spent so far, when the caller knows it better than the hash
    (`mqinfer run` counts its rows on disk)."""
    mapping = {"max_cost_usd": repr(float(max_cost_usd))}
    if spent_usd is not None:
        mapping["spent_usd"] = repr(float(spent_usd))
    client.hset(keys.job_cost(job_id), mapping=mapping)


__all__ = ["JobCaps", "NEAR_CAP", "REFRESH_S", "set_cap"]
