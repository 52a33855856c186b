"""What the queue side's parts share, in one place: the Redis connection, the worker's settings and
consumer name, the record keepers every part writes to (idempotency records, job statuses, replies),
the rate-limit throttle and budget guard when there are any, the metrics and the clock.

The worker (``worker.py``) builds one ``QueueContext`` once its model has loaded and hands it to
``Acks``, ``Ownership`` and ``Ingest``; each takes beside it only the collaborators that are its
own (the sinks and billing for acks; the engine, the batcher and the other parts for ownership and
ingest), so that a constructor says what a part depends on beyond the shared ground.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mqinfer.workers.config import WorkerConfig
from mqinfer.workers.queue.idempotency import Idempotency
from mqinfer.workers.queue.jobs import JobStatuses
from mqinfer.workers.queue.replies import Replies
from mqinfer.workers.queue.throttle import Throttle


@dataclass(frozen=True, slots=True)
class QueueContext:
    redis: Any
    config: WorkerConfig
    consumer: str
    idempotency: Idempotency
    jobs: JobStatuses
    replies: Replies
    metrics: Any
    # Requests of rate-limited tenants waiting on their limits (None without --tenant-limits).
    throttle: Throttle | None = None
    # Tenants', jobs' and labels' budgets (None without budgets).
    budget_guard: Any = None
    clock: Callable[[], float] = field(default=time.time)
