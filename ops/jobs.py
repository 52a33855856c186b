"""Bulk jobs, the public API: submit a file, look at a job, list jobs, cancel one, run the rq worker.

``submit_job`` registers a job (its Redis hash, status ``validating``), writes its manifest into
the output folder and enqueues the first :func:`mqinfer.ops.job_tasks.advance` task; everything
after that happens in rq tasks run by :class:`JobsWorker` (``mqinfer jobs worker``). Statuses
follow the OpenAI Batch API: validating, failed, in_progress, finalizing, completed, expired,
cancelling, cancelled.

A chain of tasks can break (an rq worker killed mid-task, a task that raised): the worker's
sweeper, run between tasks and every couple of seconds while idle, finds active jobs that are
neither locked by a running task nor queued, and starts a new chain for them (the old chain's
token is retired, so a late task of it does nothing). Submitting into a folder whose job Redis
no longer knows (the server lost its data) resumes that job: the rows already in its spool are
kept and their requests are skipped, not computed again.

Nothing here imports torch.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer

from mqinfer.schemas import keys
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.ops.job_carry_on import carry_on_rows, set_job_cap
from mqinfer.ops.job_cost import JobCost, job_cost, parse_folders, rows_since
from mqinfer.ops.job_output import ERRORS_JSONL, OUTPUT_JSONL, OUTPUT_PARQUET
from mqinfer.ops.job_spool import Spool
from mqinfer.ops.job_store import (
    ACTIVE_JOBS, CANCELLED, CANCELLING, COMPLETED, EXPIRED, FINAL_STATUSES, IN_PROGRESS, JOBS_INDEX,
    QUEUE_NAME, SWEEP_LOCK, VALIDATING, JobNotFound, JobStore, decode_hash,
)
from mqinfer.ops.job_tasks import DEFAULT_LEASE_S, enqueue_task, new_task_id, set_data_client
from mqinfer.schemas.files import input_format
from mqinfer.schemas.lanes import DEFAULT_MAX_LANES, check_max_lanes, parse_lanes
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, PREFIX_CACHE_SCOPES
from mqinfer.schemas.routing import ROUTES

ORDERS = ("prefix", "input")

log = logging.getLogger("mqinfer.jobs")

DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_CHUNK_SIZE = 500
_ADOPT_BATCH = 10_000


class JobConflict(ValueError):
    """The output folder already belongs to a job that is still known."""


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    resumed: bool  # an earlier job of this folder was registered again
    adopted_rows: int  # rows already in the spool whose requests will be skipped
    rerun: int = 0  # requests a cost cap stopped in an earlier run of the job, which run now


def parse_deadline(text: str | float | None, *, now: float | None = None) -> float | None:
    """``+SECONDS`` from now, unix seconds, or an ISO 8601 time (UTC unless it names a zone)."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        raw = text.strip()
        try:
            if raw.startswith("+"):
                value = (time.time() if now is None else now) + float(raw[1:])
            else:
                value = float(raw)
        except ValueError:
            try:
                parsed = dt.datetime.fromisoformat(raw)
            except ValueError:
                raise ValueError(f"--deadline {text!r}: expected +SECONDS, unix seconds or an ISO 8601 time "
                                 "such as 2030-01-31T18:00:00Z") from None
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=dt.timezone.utc)
            value = parsed.timestamp()
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--deadline {text!r} is not a usable time")
    return value


def new_job_id() -> str:
    return f"job-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def submit_job(client: redis.Redis, input_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
               stream: str = "requests", deadline: float | None = None,
               max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, chunk_size: int = DEFAULT_CHUNK_SIZE,
               queue_name: str = QUEUE_NAME, lease_s: float = DEFAULT_LEASE_S, shards: int = 1,
               order: str = "prefix", route: str = "prefix", data=None,
               worker_out: list[str] | None = None, lanes: str = "none",
               max_lanes: int = DEFAULT_MAX_LANES,
               prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE,
               max_cost_usd: float | None = None) -> SubmitResult:
    """Register a job for ``input_path`` writing into ``out_dir`` and enqueue its first task.

    ``client`` holds the job and the rq queue. ``data`` is the server (or cluster) of the request
    streams when it is another one (``--jobs-redis``); ``shards`` spreads the job's requests over
    the streams ``S-0 .. S-{N-1}`` as ``mqinfer worker --shards`` reads them, by their leading
    prompt (``route="prefix"``) or by a hash of their id (``"id"``). ``order="prefix"`` feeds the
    requests of each part of INDEX_PART_LINES input lines in prefix-tree order, ``"input"`` in the
    file's order; the output is in input order either way (see :mod:`mqinfer.ops.job_run`).
    ``worker_out``: the inference workers' ``--out`` folders, whose cost rows give the job's final
    cost (:mod:`mqinfer.ops.job_cost`) when it ends. ``lanes`` (:mod:`mqinfer.schemas.lanes`): the
    lane of its shard's stream each request goes to, by its tenant and this job (``tenant,job``, the
    default of `mqinfer jobs submit`: a lane per tenant of the job), registered as producers register
    lanes, at most ``max_lanes`` in the registry; the job's own lanes are removed when it ends.
    ``none`` (this function's default, as before lanes): the plain streams. ``max_cost_usd``: the
    job's cost cap, which the inference workers enforce (``keys.job_cost``: set on the streams'
    server before the first request is fed; workers/queue/job_caps.py).
    """
    _check_options(max_in_flight=max_in_flight, chunk_size=chunk_size, lease_s=lease_s, stream=stream,
                   order=order, route=route)
    if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"--prefix-cache-scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, "
                         f"got {prefix_cache_scope!r}")
    if max_cost_usd is not None and not (math.isfinite(max_cost_usd) and max_cost_usd > 0):
        raise ValueError(f"--max-cost-usd must be a number of USD > 0, got {max_cost_usd}")
    lanes = parse_lanes(lanes)
    check_max_lanes(max_lanes)
    streams = shard_streams(stream, shards)
    now = time.time()
    if deadline is not None and deadline <= now:
        raise ValueError(f"--deadline is {now - deadline:.0f}s in the past")
    source = Path(input_path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no such input file: {source}")
    fmt = input_format(source)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spool = Spool(out)

    resumed, adopted, parts, rerun = False, 0, [], 0
    worker_out = parse_folders(worker_out)
    manifest = spool.read_manifest()
    if manifest is not None:
        resumed = True
        job_id, parts, adopted, rerun = _resume(client, data, spool, manifest, source, streams)
    else:
        job_id = new_job_id()
        spool.write_manifest({"job_id": job_id, "input": str(source), "out": str(out), "created_at": now})

    set_job_cap(client if data is None else data, job_id, max_cost_usd, worker_out)
    chain = uuid.uuid4().hex
    task_id = new_task_id(job_id)
    store = JobStore(client, job_id, data=data)
    store.register({
        "id": job_id, "status": VALIDATING, "input": str(source), "input_format": fmt, "out": str(out),
        "stream": stream, "shards": shards, "order": order, "route": route, "lanes": lanes,
        "max_lanes": max_lanes, "prefix_cache_scope": prefix_cache_scope,
        "data": "separate" if store.split else "same", "queue": queue_name,
        "deadline": "" if deadline is None else repr(float(deadline)),
        "max_in_flight": max_in_flight, "chunk_size": chunk_size, "lease_s": repr(float(lease_s)),
        "created_at": repr(now), "chain": chain, "task": task_id, "beat": repr(now), "total": 0, "invalid": 0,
        "val_parts": 0, "fed": 0, "skipped": 0, "collected": 0, "row_parts": len(parts),
        "resumed_rows": adopted, "worker_out": json.dumps(worker_out), "rerun": rerun,
        "max_cost_usd": "" if max_cost_usd is None else repr(float(max_cost_usd)),
    }, parts=parts)
    enqueue_task(client, queue_name, job_id, chain, task_id)
    return SubmitResult(job_id, resumed, adopted, rerun)


def _check_options(*, max_in_flight: int, chunk_size: int, lease_s: float, stream: str, order: str,
                   route: str) -> None:
    """ValueError for the first of ``submit_job``'s options that is out of range, worded as the
    command line option it comes from."""
    if max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {max_in_flight}")
    if chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {chunk_size}")
    if lease_s < 0.5:
        raise ValueError(f"--lease-s must be >= 0.5, got {lease_s}")
    if not stream or "}" in stream or "{" in stream:
        raise ValueError(f"invalid --stream {stream!r}")
    if order not in ORDERS:
        raise ValueError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")
    if route not in ROUTES:
        raise ValueError(f"--route must be one of {', '.join(ROUTES)}, got {route!r}")


def _resume(client: redis.Redis, data, spool: Spool, manifest: dict, source: Path,
            streams: list[str]) -> tuple[str, list[str], int, int]:
    """Take up again the job of ``spool``'s manifest: (its id, the parts of rows already in its
    spool, how many requests they hold, to be skipped, how many requests a cost cap stopped run
    again). Either Redis no longer knows the job, or it ended with requests its cost cap stopped
    (:mod:`mqinfer.ops.job_carry_on`): those run now, the others keep their rows.

    JobConflict when the manifest names no job, another input, or a job Redis still knows that is
    running, or that ended with nothing left to run."""
    out = spool.out
    job_id = str(manifest.get("job_id") or "")
    store = JobStore(client, job_id, data=data)
    if not job_id:
        raise JobConflict(f"{spool.manifest_path} names no job; remove it or choose another --out")
    if manifest.get("input") != str(source):
        raise JobConflict(f"{out} holds job {job_id} of another input ({manifest.get('input')}); "
                          "choose another --out")
    known = store.exists()
    if known and store.status() not in (COMPLETED, CANCELLED, EXPIRED):
        raise JobConflict(f"{out} already holds job {job_id} ({store.status()}); watch it with "
                          f"`mqinfer jobs status {job_id}`, or choose another --out")
    spool.clean()
    parts, rerun = carry_on_rows(spool, client if data is None else data, streams, job_id)
    if known and not rerun:
        raise JobConflict(f"{out} already holds job {job_id} ({store.status()}) and no request of it was "
                          f"stopped by a cost cap; see `mqinfer jobs status {job_id}`, or choose another --out")
    spool.reset_index()
    adopted = _adopt_rows(client if data is None else data, spool, parts, job_id, streams)
    log.info("job %s resumes in %s: %d rows already collected, %d requests a cost cap stopped run again",
             job_id, out, adopted, rerun)
    return job_id, parts, adopted, rerun


def _adopt_rows(client, spool: Spool, parts: list[str], job_id: str, streams: list[str]) -> int:
    """Mark the ids of rows already in the spool as done, so feeding skips their requests.

    Each id goes into the done set of its id's shard, wherever routing by prefix sends the request:
    the feed counts a request as done when any shard's done set holds it."""
    if not parts:
        return 0
    ids = pc.unique(spool.read_rows(parts, ["id"])["id"]).to_pylist()
    by_shard: dict[int, list[str]] = {}
    for rid in ids:
        by_shard.setdefault(shard_index(rid, job_id, len(streams)), []).append(rid)
    for shard, shard_ids in by_shard.items():
        done_key = keys.job_done_set(streams[shard], job_id)
        for start in range(0, len(shard_ids), _ADOPT_BATCH):
            client.sadd(done_key, *shard_ids[start:start + _ADOPT_BATCH])
        client.expire(done_key, 7 * 24 * 3600)
    return len(ids)


def cancel_job(client: redis.Redis, job_id: str, *, data=None) -> str:
    """Ask a job to stop; returns its status after the call (``cancelling`` when it will stop).

    With two servers, ``data`` lets the inference workers see the cancel at once; without it they
    see it when the job's next task runs (within seconds)."""
    separate = client.hget(keys.job_key(job_id), "data") == b"separate"
    before = JobStore(client, job_id, data=data if separate else None).cancel()
    if not before:
        raise JobNotFound(f"no job {job_id!r} on this Redis (see `mqinfer jobs list`)")
    return CANCELLING if before in (VALIDATING, IN_PROGRESS) else before


# -- looking at jobs -------------------------------------------------------------------------
def _f(job: dict, name: str) -> float | None:
    value = job.get(name)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _i(job: dict, name: str) -> int:
    value = job.get(name)
    return value if isinstance(value, int) else 0


def _cost(job: dict, status: str, rows: JobCost | None) -> tuple[float | None, dict]:
    """The job's cost and where it comes from (the ``cost`` object of ``jobs status --json``).

    ``cost_rows``: every cost row of the job, read now (``rows``) or when the job ended (the
    ``rows_*`` fields that its last task wrote): the final figure. ``result_stream``: the costs the
    workers put on the job's result stream, summed as rows were collected, one attempt per
    request: provisional while the job runs, and all there is for a job that names no worker
    folders."""
    if rows is None and _f(job, "rows_cost_usd") is not None:
        rows = JobCost(cost_usd=_f(job, "rows_cost_usd") or 0.0, device_s=_f(job, "rows_device_s") or 0.0,
                       rows=_i(job, "rows_cost_count"), request_usd=_f(job, "rows_request_usd") or 0.0,
                       duplicate_usd=_f(job, "rows_duplicate_usd") or 0.0)
    stream = _f(job, "cost_usd") if _i(job, "cost_rows") else None
    if rows is not None:
        return rows.cost_usd, {"source": "cost_rows", "provisional": False, "usd": rows.cost_usd,
                               "request_usd": rows.request_usd, "duplicate_usd": rows.duplicate_usd,
                               "device_s": rows.device_s, "rows": rows.rows, "stream_usd": stream,
                               "missing_folders": list(rows.missing)}
    return stream, {"source": "result_stream", "provisional": status not in FINAL_STATUSES, "usd": stream,
                    "request_usd": None, "duplicate_usd": None, "device_s": None, "rows": None,
                    "stream_usd": stream, "missing_folders": []}


def describe(job: dict, *, in_flight: int = 0, now: float | None = None, rows: JobCost | None = None) -> dict:
    """The public view of a job hash: counts, tokens, cost, throughput, ETA, outputs. ``rows``: the
    job's cost rows read now (``jobs status --worker-out``), else the figure its hash holds."""
    now = time.time() if now is None else now
    status = str(job.get("status"))
    finished = status in (COMPLETED, CANCELLED, EXPIRED) and "output_rows" in job
    total = _i(job, "total")
    invalid = _i(job, "invalid") + _i(job, "duplicates")
    if finished:
        counts = {k: _i(job, k) for k in ("completed", "failed", "cancelled", "expired")}
        done = _i(job, "output_rows")
    else:
        counts = {"completed": _i(job, "completed"), "failed": _i(job, "failed") + invalid,
                  "cancelled": _i(job, "cancelled"), "expired": _i(job, "expired")}
        done = sum(counts.values()) + _i(job, "skipped")
    started = _f(job, "in_progress_at")
    ended = next((_f(job, f"{s}_at") for s in (COMPLETED, CANCELLED, EXPIRED, "failed") if _f(job, f"{s}_at")), None)
    elapsed = ((ended or now) - started) if started else None
    computed = _i(job, "collected")
    rate = computed / elapsed if elapsed and elapsed > 0 else None
    token_rate = _i(job, "output_tokens") / elapsed if elapsed and elapsed > 0 else None
    remaining = max(0, total - done)
    eta = remaining / rate if rate and not finished and status not in FINAL_STATUSES else None
    out = str(job.get("out", ""))
    outputs = {}
    if finished:
        outputs["parquet"] = str(Path(out) / OUTPUT_PARQUET)
        if job.get("format") in ("openai", "mixed"):
            outputs["jsonl"] = str(Path(out) / OUTPUT_JSONL)
            outputs["errors"] = str(Path(out) / ERRORS_JSONL)
    deadline = _f(job, "deadline")
    cost_usd, cost = _cost(job, status, rows)
    return {
        "id": job.get("id"), "status": status, "input": job.get("input"), "out": out,
        "stream": job.get("stream"), "format": job.get("format") or None,
        "order": job.get("order") or "input", "route": job.get("route") or "id",
        "lanes": job.get("lanes") or "none",
        "created_at": _f(job, "created_at"), "in_progress_at": started,
        "finalizing_at": _f(job, "finalizing_at"), "ended_at": ended, "deadline": deadline,
        "counts": {"total": total, **counts, "invalid": invalid, "skipped": _i(job, "skipped"),
                   "in_flight": in_flight, "fed": _i(job, "fed"), "done": done,
                   "budget_exceeded": _i(job, "budget_exceeded"), "rerun": _i(job, "rerun")},
        "tokens": {"prompt": _i(job, "prompt_tokens"), "output": _i(job, "output_tokens")},
        "cost_usd": cost_usd, "cost": cost, "max_cost_usd": _f(job, "max_cost_usd"),
        "throughput": {"requests_per_s": rate, "output_tokens_per_s": token_rate},
        "eta_s": eta,
        "validated": bool(_i(job, "validated")),
        "errors": json.loads(str(job.get("errors") or "[]")),
        "error": job.get("error") or None,
        "last_task_error": job.get("last_task_error") or None,
        "outputs": outputs,
    }


def job_info(client: redis.Redis, job_id: str, *, now: float | None = None,
             worker_out: list[str] | None = None) -> dict:
    """``describe`` of a registered job; with ``worker_out`` (workers' ``--out`` folders) its cost
    comes from the cost rows there, read now."""
    store = JobStore(client, job_id)
    job = store.load()
    rows = job_cost(worker_out, job_id, since=rows_since(job)) if worker_out else None
    return describe(job, in_flight=store.inflight_count(), now=now, rows=rows)


def list_jobs(client: redis.Redis, *, limit: int = 50) -> list[dict]:
    """The latest ``limit`` jobs, newest first."""
    ids = [i.decode() if isinstance(i, bytes) else i for i in client.zrevrange(JOBS_INDEX, 0, max(0, limit - 1))]
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(keys.job_key(job_id))
    jobs = []
    for job_id, raw in zip(ids, pipe.execute()):
        if not raw:
            client.zrem(JOBS_INDEX, job_id)
            continue
        jobs.append(describe(decode_hash(raw)))
    return jobs


# -- the rq worker ---------------------------------------------------------------------------
def sweep(client: redis.Redis, queue_name: str = QUEUE_NAME, *, grace_s: float = 5.0,
          lock_ms: int = 1000) -> list[str]:
    """Start a new task chain for every active job of ``queue_name`` whose chain died; returns their ids.

    A chain is alive while its job is locked (a task runs), while its next task waits in the
    queue, or within ``grace_s`` of its last sign of life (a task about to start or just enqueued).
    """
    if not client.set(SWEEP_LOCK, b"1", nx=True, px=lock_ms):
        return []  # another worker swept just now
    queue_key = Queue(queue_name, connection=client, serializer=JSONSerializer).key
    restarted = []
    now = time.time()
    for raw_id in client.smembers(ACTIVE_JOBS):
        job_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        store = JobStore(client, job_id)
        status, chain, task, beat, queue = (
            v.decode() if isinstance(v, bytes) else v
            for v in client.hmget(store.hash_key, "status", "chain", "task", "beat", "queue"))
        if status is None or status in FINAL_STATUSES:
            client.srem(ACTIVE_JOBS, job_id)
            continue
        if (queue or QUEUE_NAME) != queue_name or client.exists(store.lock_key):
            continue
        if now - float(beat or 0) < grace_s:
            continue
        if task and client.lpos(queue_key, task) is not None:
            continue
        new_chain, task_id = uuid.uuid4().hex, new_task_id(job_id)
        if store.rekick(chain or "", new_chain, task_id):
            enqueue_task(client, queue_name, job_id, new_chain, task_id)
            log.warning("job %s (%s): its task chain had stopped; started a new one", job_id, status)
            restarted.append(job_id)
    return restarted


class JobsWorker(Worker):
    """An rq worker for the bulk-job queue (JSON serializer) that also sweeps for broken chains.

    It forks a work horse per task, as rq does; the tasks import no torch. Its dequeue wait is
    short so that the sweep runs every ``sweep_interval_s`` even when the queue is empty.
    """

    def __init__(self, connection: redis.Redis, *, queue_name: str = QUEUE_NAME, name: str | None = None,
                 sweep_interval_s: float = 2.0, grace_s: float | None = None, **kwargs) -> None:
        if sweep_interval_s <= 0:
            raise ValueError(f"--sweep-interval-s must be > 0, got {sweep_interval_s}")
        # Set before rq's constructor, which reads dequeue_timeout.
        self.sweep_interval_s = sweep_interval_s
        self.grace_s = grace_s if grace_s is not None else max(5.0, 2.5 * sweep_interval_s)
        self.jobs_queue_name = queue_name
        self._next_sweep = 0.0
        name = name or f"mqinfer-jobs-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        super().__init__([queue_name], name=name, connection=connection, serializer=JSONSerializer, **kwargs)

    @property
    def dequeue_timeout(self) -> int:
        return max(1, math.ceil(self.sweep_interval_s))

    def subscribe(self) -> None:
        """rq's subscription to this worker's command channel, its listening thread polling five
        times a second instead of once a minute. On a stop, rq unsubscribes and then waits for
        that thread, which (with redis-py 8) can sit out its whole poll once the channel is gone:
        an idle worker sent SIGTERM took up to a minute to exit."""
        log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=0.2, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    @property
    def should_run_maintenance_tasks(self) -> bool:
        return time.monotonic() >= self._next_sweep or super().should_run_maintenance_tasks

    def run_maintenance_tasks(self) -> None:
        if super().should_run_maintenance_tasks:
            super().run_maintenance_tasks()
        self._next_sweep = time.monotonic() + self.sweep_interval_s
        try:
            sweep(self.connection, self.jobs_queue_name, grace_s=self.grace_s,
                  lock_ms=max(100, int(self.sweep_interval_s * 900)))
        except redis.RedisError as exc:
            # rq's loop quits on an unexpected exception; a Redis blip must not stop the worker.
            log.warning("sweep failed: %s", exc)


def run_worker(client: redis.Redis, *, queue_name: str = QUEUE_NAME, name: str | None = None,
               burst: bool = False, sweep_interval_s: float = 2.0, logging_level: str = "INFO",
               data=None) -> int:
    """Run :class:`JobsWorker` until it is stopped (SIGTERM / Ctrl-C finish the current task first).

    ``data``: the server or cluster of the request streams of jobs submitted with a separate jobs
    server (``--jobs-redis``); ``client`` is that jobs server."""
    set_data_client(data)
    worker = JobsWorker(client, queue_name=queue_name, name=name, sweep_interval_s=sweep_interval_s)
    worker.work(burst=burst, logging_level=logging_level.upper())
    return 0
