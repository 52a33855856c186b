"""The rq task that advances a bulk job by one short step, and enqueues its own follow-up.

A job is a chain of :func:`advance` tasks on the ``mqinfer-jobs`` queue (JSON serializer). Each
task takes the job's lock, works for at most a few seconds, then puts the next task at the back
of the queue, so one rq worker serves many jobs in turn; a task also ends as soon as another task
joins the queue, so a job submitted behind a huge one is validated and fed at once. What a task does depends on the job's status: :class:`mqinfer.ops.job_run.JobRun`
(validating the input, feeding the request streams, collecting result rows, reconciling requests
that lost their entry, finalizing the output). This module is the chain around it: the rq task, the
job's lock and the lease that keeps it, the next task, and what a failed task leaves.

The tasks never import torch: rq forks a work horse per task, and a forked process must not touch
a GPU. State lives in Redis (:mod:`mqinfer.ops.job_store`) and in the spool
(:mod:`mqinfer.ops.job_spool`), so a task killed anywhere is simply run again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis
from rq import Queue, get_current_job
from rq.serializers import JSONSerializer

from mqinfer.ops.job_run import JobRun
from mqinfer.ops.job_store import FAILED, QUEUE_NAME, JobNotFound, JobStore, LockLost, StatusChanged
from mqinfer.schemas import keys
from mqinfer.schemas.connection import CLUSTER_TRANSIENT

log = logging.getLogger("mqinfer.jobs")

TASK_BUDGET_S = 5.0          # a task yields the rq worker after this long
MAX_TASK_ERRORS = 5          # failed tasks in a row before the job itself fails
DEFAULT_LEASE_S = 10.0
TASK_TIMEOUT_S = 3600
FAILURE_TTL_S = 7 * 24 * 3600


# -- the task --------------------------------------------------------------------------------
# The data server (request streams, result streams) of this `mqinfer jobs worker`, when it is not
# the rq server (--jobs-redis). Set once in the worker process; rq's forked work horses inherit it.
_data_client = None


def set_data_client(client) -> None:
    """Use ``client`` (a server or a cluster) for the request and result streams of two-server jobs."""
    global _data_client
    _data_client = client


def advance(job_id: str, chain: str) -> str:
    """The rq task: advance bulk job ``job_id`` if ``chain`` is still its live chain."""
    current = get_current_job()
    if current is None:
        raise RuntimeError("advance() runs as an rq task; start `mqinfer jobs worker` to run bulk jobs")
    return run_task(current.connection, job_id, chain, queue_name=current.origin or QUEUE_NAME, data=_data_client)


def enqueue_task(client: redis.Redis, queue_name: str, job_id: str, chain: str, task_id: str) -> None:
    """Put an :func:`advance` task for ``job_id`` at the back of ``queue_name``."""
    queue = Queue(queue_name, connection=client, serializer=JSONSerializer)
    queue.enqueue(advance, job_id, chain, job_id=task_id, job_timeout=TASK_TIMEOUT_S, result_ttl=0,
                  failure_ttl=FAILURE_TTL_S, description=f"advance bulk job {job_id}")


def new_task_id(job_id: str) -> str:
    return f"mqinfer-job-{job_id}-{uuid.uuid4().hex[:12]}"


class LeaseKeeper:
    """Keeps the task's lock fresh from a thread, so a long step never loses it while alive."""

    def __init__(self, store: JobStore, token: str, lease_s: float) -> None:
        self.store, self.token, self.lease_s = store, token, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mqinfer-job-lease", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.store.refresh(self.token, self.lease_s):
                    return  # lost: the fenced writes of the task will notice
            except redis.RedisError:
                log.warning("job %s: could not refresh the lease", self.store.job_id, exc_info=True)

    def __enter__(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_task(client: redis.Redis, job_id: str, chain: str, *, queue_name: str = QUEUE_NAME,
             budget_s: float | None = None, data=None) -> str:
    """One step of a job: take its lock, work for up to ``budget_s`` (default TASK_BUDGET_S),
    enqueue the next step. ``data`` is the server of the request streams when the job was
    submitted with a separate jobs server (``--jobs-redis``)."""
    separate = client.hget(keys.job_key(job_id), "data") == b"separate"
    if separate and data is None:
        raise RuntimeError(
            f"job {job_id} was submitted with --jobs-redis: its requests go to another Redis than the job "
            "queue; start `mqinfer jobs worker --jobs-redis JOBS_URL --redis DATA_URL` (plus --redis-cluster "
            "for a cluster) to run it")
    store = JobStore(client, job_id, data=data if separate else None)
    lease_raw = client.hget(store.hash_key, "lease_s")
    lease_s = float(lease_raw) if lease_raw else DEFAULT_LEASE_S
    token = uuid.uuid4().hex
    got = store.acquire(chain, token, lease_s)
    if got == "stale":
        return f"job {job_id}: chain {chain} is no longer the job's (the job ended or was restarted)"
    if got == "busy":
        return f"job {job_id}: another task is advancing it"
    try:
        with LeaseKeeper(store, token, lease_s):
            try:
                budget = TASK_BUDGET_S if budget_s is None else budget_s
                final = JobRun(store, token, queue_name, budget_s=budget).advance()
            except LockLost as exc:
                log.warning("%s; this task stops", exc)
                return str(exc)
            except JobNotFound as exc:  # deleted under us: nothing left to advance
                return str(exc)
            except Exception as exc:
                _record_task_error(store, token, exc)
                raise
            if final:
                return f"job {job_id}: {store.status()}"
            task_id = new_task_id(job_id)
            store.record_next_task(token, task_id)
            enqueue_task(client, queue_name, job_id, chain, task_id)
            return f"job {job_id}: {store.status()}, next task {task_id}"
    finally:
        try:
            store.release(token)
        except redis.RedisError:
            log.warning("job %s: could not release its lock (it expires by itself)", job_id)


def _record_task_error(store: JobStore, token: str, exc: Exception) -> None:
    """Note a failed step; after MAX_TASK_ERRORS in a row the job fails, unless the failure is a
    server that cannot be reached (a restart, a cluster failover): that is retried with backoff for
    as long as it lasts.

    The chain stops here; the sweeper of `mqinfer jobs worker` starts a new one once the job's
    last sign of life is older than its grace time. That sign is set into the future, doubling
    with each failure, so that a lasting fault (a full disk, say) is retried with backoff.
    """
    message = f"{type(exc).__name__}: {exc}"[:2000]
    log.exception("job %s: task failed: %s", store.job_id, message)
    try:
        errors = int(store.redis.hget(store.hash_key, "task_errors") or 0) + 1
        store.update(token, {"last_task_error": message, "beat": time.time() + min(60.0, 2.0 ** errors)},
                     incr={"task_errors": 1})
        transient = isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                     *CLUSTER_TRANSIENT))
        if errors >= MAX_TASK_ERRORS and not transient:
            store.finish(token, {"status": FAILED, "failed_at": time.time(),
                                 "error": f"orchestration failed {errors} times in a row; last: {message}"},
                         expect_status=None)
    except (redis.RedisError, LockLost, StatusChanged):
        log.warning("job %s: could not record the task error", store.job_id, exc_info=True)

