"""The inference worker process: stream ingest, engine loop, durable rows, then acks.

One loop, one thread: read what the engine can start soon (``XREADGROUP`` with a COUNT bounded
by free capacity, plus ``XAUTOCLAIM`` of dead workers' entries), decode and validate, hold
requests in the dual-threshold batcher, step the engine, turn finished requests into a result
row and a cost row, write them durably, and only then ``XACK`` (and ``XDEL``) their entries.
While a request runs its entry is re-claimed by this worker (``XCLAIM ... JUSTID``) so its idle
time stays low and only a dead worker's entries are taken over. SIGTERM drains: no new reads,
finish what runs within ``drain_timeout_s``, hand the rest back, flush, ack, exit 0.

Duplicates from producers: each accepted request (``job_id``, ``id``) gets an idempotency record
(first entry id, content hash, whether it was computed) with a time to live, taken atomically by
a script. While the first entry is live or computed, a second entry with the same content is
acked without computing it again and one with different content is refused to the dead letters;
content is compared without the fields that only say where and when to deliver (``reply_to``,
``priority``, ``deadline``), so a retry from another client is the same request. A copy with a
reply stream is answered there: with the first copy's final row (kept with the record when the
first copy had a reply stream too), once that row is written if it still runs, or with a
``duplicate_id`` error row (never written) if its content differs. Once the first is gone
without a result (lost, cancelled, failed), a new copy takes over.

Entries trimmed from the stream are noticed: those this worker runs are finished from memory, a
dead worker's pending ones end with a ``lost`` error row when the in-flight hash still names
their request, and undelivered ones are counted and logged.

A request's log line (``finished ...``, or ``<reason> row ...``) is written once its row is
durable, so the log never counts more finished requests than the results dataset holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis
from prometheus_client import Gauge

from mqinfer.schemas import faults, keys
from mqinfer.schemas.replies import ReplyWriter, cancel_key, cancel_member
from mqinfer.schemas.connection import CLUSTER_TRANSIENT, connect_redis
from mqinfer.ops.budgets import BUDGET_EXCEEDED, BudgetGuard, load_budgets
from mqinfer.ops.metrics import WorkerMetrics
from mqinfer.scheduler.batcher import DynamicBatcher
from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request, to_sampling_kwargs
from mqinfer.schemas.rows import CostRow, ResultRow, error_result_row
from mqinfer.schemas.stream import decode_entry, encode_entry
from mqinfer.schemas.connection import redact
from mqinfer.workers.costs import Meter, WorkModel, kv_block_shares, process_start_time, wasted_work_row
from mqinfer.workers.config import WorkerConfig
from mqinfer.workers.engine import EngineInputError, LLMEngine
from mqinfer.schemas.dataset import remove_temp_files
from mqinfer.workers.sink import Sinks

log = logging.getLogger("mqinfer.worker")

# Redis unreachable (restarting, loading its append-only file, network): retry with backoff.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError,
              *CLUSTER_TRANSIENT)

# How long a starting worker waits for Redis to answer before it gives up.
REDIS_STARTUP_WAIT_S = 60.0
# Server replies that mean the credentials are wrong or missing: retrying cannot help.
_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "invalid password")

HANDBACK_CONSUMER = "mqinfer-handback"
# Deterministic (sorted map keys), so equal requests hash equal however the producer ordered them.
_CONTENT_ENCODER = msgspec.msgpack.Encoder(order="deterministic")

# Takes a request's idempotency record for an entry, atomically. KEYS: record, in-flight hash,
# request stream, stored final row, waiting reply streams. ARGV: entry id, content hash, ttl
# seconds, in-flight value, the entry's reply stream ('' for none). The record holds
# "<entry id> <content hash> <run|done>"; `done` once the request has its result (a row that
# finished `stop` or `length`). Returns {outcome, first entry id, state, stored row}; outcome is
# `new`, `redelivery` (the same entry again), `takeover` (the first entry is gone without a result:
# lost, cancelled, expired or failed, so the request may be sent again), `same` (a duplicate of a
# live or computed request) or `conflict` (different content than a live or computed one). A `same`
# copy of a computed request gets the stored final row (if any) to answer with; one of a live
# request adds its reply stream to the waiting ones (a JSON list, at most MAX_WAITERS), answered
# when the first copy's row is written (_ack reads and clears them in one transaction with the
# record's change to `done`). Only GET and SET touch the row and waiter keys: the worker's ACL
# user may not DEL (ops/acl), so a stale key is cleared by letting it expire at once.
_CLAIM_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' ' .. ARGV[2] .. ' run'
if cur then
  local entry, digest, state = string.match(cur, '^(%S+) (%S+) (%S+)$')
  if entry == ARGV[1] then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
    return {'redelivery', entry, state, ''}
  end
  if state == 'done' or #redis.call('XRANGE', KEYS[3], entry, entry) > 0 then
    if digest ~= ARGV[2] then return {'conflict', entry, state, ''} end
    if state == 'done' then
      return {'same', entry, state, redis.call('GET', KEYS[4]) or ''}
    end
    if ARGV[5] ~= '' then
      local raw = redis.call('GET', KEYS[5])
      local waiting = {}
      if raw and raw ~= '' then waiting = cjson.decode(raw) end
      if #waiting < tonumber(ARGV[6]) then
        table.insert(waiting, ARGV[5])
        redis.call('SET', KEYS[5], cjson.encode(waiting), 'EX', ARGV[3])
      end
    end
    return {'same', entry, state, ''}
  end
  redis.call('SET', KEYS[1], mine, 'EX', ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
  return {'takeover', entry, state, ''}
end
redis.call('SET', KEYS[1], mine, 'EX', ARGV[3])
for i = 4, 5 do  -- left by an expired record of the same (job_id, id): not this request's
  if redis.call('GET', KEYS[i]) then redis.call('SET', KEYS[i], '', 'PX', 1) end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
return {'new', '', 'run', ''}
"""
# Fields that say where, when or in what order to deliver a result, not what to compute: a copy
# of a request that differs only in these is the same request (a retry from another client).
_DELIVERY_FIELDS = {"reply_to": None, "priority": 0, "deadline": None}
# Copies of one running request whose reply streams are remembered, at most.
MAX_WAITERS = 100
_ROW_ENCODER = msgspec.json.Encoder()
_ROW_DECODER = msgspec.json.Decoder(ResultRow)


def _final_row_key(record: str) -> str:
    """The stored final row of a computed request (same hash tag as its record)."""
    return record + ":row"


def _waiters_key(record: str) -> str:
    """Reply streams of copies that arrived while the first copy ran (same hash tag as its record)."""
    return record + ":wait"


def _waiting_reply_streams(raw) -> list[str]:
    """The reply streams of a waiter key's value (a JSON list), each once, in order."""
    if not raw:
        return []
    try:
        streams = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(streams, list):
        return []
    return list(dict.fromkeys(s for s in streams if isinstance(s, str) and s.startswith(keys.REPLY_PREFIX)))


def content_digest(request: Request) -> str:
    """A request's content hash for the idempotency record: equal for copies that differ only in
    delivery fields, however the producer ordered map keys."""
    bare = msgspec.structs.replace(request, **_DELIVERY_FIELDS)
    return hashlib.sha256(_CONTENT_ENCODER.encode(bare)).hexdigest()[:32]


# A consumer that tried to read this recently is a live worker (a blocked XREADGROUP counts).
LIVE_CONSUMER_MS = 10_000
CANCELLED_JOB_STATUSES = ("cancelling", "cancelled")
FINAL_JOB_STATUSES = ("completed", "failed", "expired", "cancelled")


class SinkError(RuntimeError):
    """Result rows could not be written durably; the worker must not ack them."""


class StartupError(ValueError):
    """The worker cannot start: Redis refuses its credentials or stays unreachable. The message is
    one line naming the server (its password redacted); a ValueError, so that the command line
    prints it as ``mqinfer worker: error: ...`` and exits non-zero, without a traceback."""


def _is_auth_error(exc: Exception) -> bool:
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)):
        return True
    text = str(exc)
    return isinstance(exc, redis.exceptions.ResponseError) and any(r in text for r in _AUTH_REPLIES)


@dataclass(slots=True)
class InFlight:
    """A stream entry this worker owns, from decode to ack."""

    entry_id: str
    request: Request
    attempt: int
    enqueued_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def entry_time(entry_id: str) -> float:
    """Unix seconds at which the server added the entry (its id's millisecond part)."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


def _recover_job_id(fields: dict) -> str | None:
    """Best effort: the job_id of an entry that failed validation, so its error row is keyed right."""
    raw = fields.get(b"r") or fields.get("r")
    obj = None
    try:
        if raw is not None:
            obj = msgspec.msgpack.decode(raw)
        else:
            text = fields.get(b"json") or fields.get("json")
            if text is not None:
                obj = msgspec.json.decode(text)
    except Exception:
        return None
    job_id = obj.get("job_id") if isinstance(obj, dict) else None
    if isinstance(job_id, str) and 0 < len(job_id) <= 128 and job_id.isprintable():
        return job_id
    return None


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Worker:
    def __init__(self, config: WorkerConfig, *, clock=time.time) -> None:
        self.config = config
        self.clock = clock
        self.started = clock()
        self.consumer = config.consumer or default_consumer_name()
        self.stream_key = keys.request_stream(config.stream)
        self.dead_key = keys.dead_letter_stream(config.stream)
        self.inflight_key = keys.inflight_hash(config.stream)
        self.redis = connect_redis(config.redis_url, cluster=config.redis_cluster)
        self.metrics = WorkerMetrics()
        self.batcher = DynamicBatcher(max_batch=config.max_batch, max_wait_ms=config.max_wait_ms)
        r = self.metrics.registry
        self._wait_gauges = (
            Gauge("mqinfer_batcher_max_wait_seconds", "The batcher's wait threshold in force.", registry=r),
            Gauge("mqinfer_batcher_arrival_rate", "Requests per second reaching the batcher (adaptive wait).",
                  registry=r),
            Gauge("mqinfer_batcher_step_time_seconds", "Moving average of engine step time (adaptive wait).",
                  registry=r),
        ) if self.batcher.adaptive is not None else None
        self.replies = ReplyWriter(self.consumer, maxlen=config.reply_maxlen, ttl_s=config.reply_ttl_s)
        # Final reply messages wait for their rows to be durable: (reply_to, row), sent by _ack.
        self.pending_finals: list[tuple[str, ResultRow]] = []
        # Entries whose request has a reply stream: their final row is kept with the idempotency
        # record when computed, to answer later copies of the request (a client's retry).
        self._keep_final: set[str] = set()
        self.cancel_key = cancel_key(config.stream)
        self._cancels_allowed = True
        self.inflight: dict[str, InFlight] = {}
        # Entries whose rows are written (or about to be): (entry_id, job_id, id, result row).
        self.pending_acks: list[tuple[str, str | None, str, ResultRow | None]] = []
        self._job_cache: dict[str, tuple[float, str | None]] = {}
        self._entry_cost: dict[str, float] = {}  # cost_usd of written rows, until acked
        # Log lines of buffered rows ("finished ...", "error row ..."): logged once the row is durable,
        # so the log never claims more finished requests than the results hold. (format, args, fields).
        self._row_log: list[tuple[str, tuple, dict | None]] = []
        self.stopping = False
        self.engine: LLMEngine | None = None
        self.sinks: Sinks | None = None
        self.meter: Meter | None = None
        self.budget_guard: BudgetGuard | None = None
        self._last_autoclaim = 0.0
        self._autoclaim_cursor = "0-0"
        self._last_keepalive = 0.0
        self._last_activity = self.started
        # Busy-time accounting (perf_counter seconds): the loop's working time, less blocking reads.
        self.busy_s = 0.0
        self._blocked_s = 0.0
        self._phases_seen: dict[str, float] = {}
        self._disowned: set[str] = set()
        # Entries trimmed from the stream while running here: finished from memory, never kept fresh.
        self._detached: set[str] = set()
        # entry id -> (idempotency record key, content hash) of requests this worker took.
        self._idem: dict[str, tuple[str, str]] = {}
        self._claim = self.redis.register_script(_CLAIM_SCRIPT)
        self._gap_reported: str | None = None
        self._redis_retry_at = 0.0
        self._redis_backoff = 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        def on_signal(signum, _frame):
            if self.stopping:
                return
            log.info("signal %s: draining", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def start(self) -> None:
        cfg = self.config
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        removed = remove_temp_files(out)
        if removed:
            log.info("removed %d leftover temporary part files", removed)
        self._wait_for_redis()
        self.engine = LLMEngine(cfg.engine, clock=self.clock)
        info = self.engine.info
        self.meter = Meter(
            WorkModel.for_model(
                num_params=info.num_params, vocab_size=info.vocab_size, hidden_size=info.hidden_size,
                num_layers=info.num_layers, num_heads=info.num_heads, head_dim=info.head_dim,
                tied=getattr(info, "tie_word_embeddings", False),
            ),
            start=self._startup_began(), block_size=cfg.engine.block_size,
        )
        self.metrics.track_meter(self.meter)
        self.metrics.track_engine(self.engine.scheduler, self.batcher.__len__)
        self.metrics.watch_memory(str(self.engine.device))
        # Scrapes read Redis from the HTTP thread, on their own client with a short timeout.
        scrape_redis = connect_redis(cfg.redis_url, cluster=cfg.redis_cluster, socket_timeout=2.0)
        self.metrics.watch_stream(scrape_redis, self.stream_key, cfg.group, clock=self.clock)
        if cfg.budgets is not None:
            self.budget_guard = BudgetGuard(load_budgets(cfg.budgets), self.redis, cfg.stream, clock=self.clock)
            self.metrics.watch_budgets(self.budget_guard, scrape_redis)
        self.sinks = Sinks(out, self.consumer, flush_rows=cfg.flush_rows, flush_interval_s=cfg.flush_interval_s,
                           clock=self.clock,
                           before_rename=(lambda _p: faults.hit("sink.before_rename")) if faults.enabled() else None)
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            log.info("metrics on http://%s:%d/metrics", cfg.metrics_host, port)
        now = self.clock()
        startup_s = self.meter.startup_done(now)
        self.sinks.add_cost(self._overhead_row("startup", startup_s, now))
        self.metrics.ready = True
        self._last_activity = now
        log.info(
            "worker %s ready: model %s, stream %s on %s, startup %.2fs",
            self.consumer, info.model_id, self.stream_key, redact(cfg.redis_url), startup_s,
        )

    def _startup_began(self) -> float:
        """Where the startup row begins: the process's start (imports count as startup), unless
        the worker runs on an injected clock."""
        began = process_start_time() if self.clock is time.time else None
        return min(self.started, began) if began is not None else self.started

    def _wait_for_redis(self, timeout_s: float | None = None) -> None:
        """Wait (with backoff) for the server to answer; StartupError at once when it refuses our
        credentials or permissions (waiting cannot fix those), or when it stays away ``timeout_s``."""
        timeout_s = REDIS_STARTUP_WAIT_S if timeout_s is None else timeout_s
        url = redact(self.config.redis_url)
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        while True:
            try:
                self._ensure_group()
                return
            except redis.exceptions.RedisError as exc:
                if _is_auth_error(exc):
                    raise StartupError(f"cannot authenticate to {url}: {exc}") from None
                if isinstance(exc, redis.exceptions.NoPermissionError):
                    raise StartupError(f"the Redis user of {url} may not create the consumer group of "
                                       f"{self.stream_key}: {exc}") from None
                if not isinstance(exc, REDIS_DOWN):
                    raise
                if time.monotonic() > deadline:
                    raise StartupError(f"cannot connect to {url} (tried for {timeout_s:g}s): {exc}") from None
                log.warning("waiting for redis at %s (%s)", url, exc)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic()) + 0.01))
                delay = min(delay * 2, 5.0)

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream_key, self.config.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run(self) -> int:
        """Serve until SIGTERM or idle exit; 0 on a clean stop, 3 when rows could not be written."""
        self._install_signals()
        self.start()
        self._redis(self._recover_own_pending)
        try:
            while True:
                if self.stopping:
                    break
                self._iteration()
                if self._idle_exit_due():
                    log.info("idle for %.1fs: exiting", self.config.idle_exit_s)
                    break
            self._drain()
        except SinkError as exc:
            # Nothing unwritten was acked: the entries stay pending and another worker redoes them.
            self.metrics.healthy = False
            log.error("cannot write result rows (%s): exiting unhealthy without acking them", exc.__cause__)
            self.metrics.close()
            return 3
        return 0

    def _holds_work(self) -> bool:
        return bool(self.inflight or self.pending_acks or self.sinks.pending or len(self.batcher))

    def _iteration(self) -> None:
        t0, blocked0 = time.perf_counter(), self._blocked_s
        worked = self._holds_work()
        self._iteration_body()
        if worked or self._holds_work():
            busy = max(0.0, time.perf_counter() - t0 - (self._blocked_s - blocked0))
            self.busy_s += busy
            self.metrics.busy_seconds.inc(busy)

    def busy_summary(self) -> dict:
        """Where the worker's busy time went: the engine's phases and everything else (ingest, sinks,
        acks, replies, keepalive), and the share of busy time outside the model's forward pass."""
        phases = {k: round(v, 4) for k, v in self.engine.phase_seconds.items()}
        forward = self.engine.phase_seconds.get("forward", 0.0)
        busy = self.busy_s
        return {"busy_s": round(busy, 4), "phases_s": phases,
                "other_s": round(max(0.0, busy - sum(self.engine.phase_seconds.values())), 4),
                "outside_forward_share": round(1.0 - forward / busy, 4) if busy > 0 else None}

    def _iteration_body(self) -> None:
        now = self.clock()
        if not self.engine.has_unfinished():
            self.meter.idle_until(now)  # keeps the batch idle ratio current while nothing runs
        self._redis(self._ingest, now)
        self._admit()
        if self.engine.has_unfinished():
            self._step()
            faults.hit("worker.after_step")
        if self.replies:
            self._redis(self.replies.send, self.redis)
        now = self.clock()
        if self._redis(self._keepalive, now):
            self._redis(self._cancel_cancelled_jobs)
        if self.sinks.pending and (self.sinks.should_flush() or not self.engine.has_unfinished()):
            self._flush()
        elif self.pending_acks and not self.sinks.pending:
            # Only acks whose rows are durable (a flush whose ack failed): with rows still
            # buffered, pending_acks holds their entries too, and they wait for the next flush.
            self._redis(self._ack)

    def _redis(self, fn, *args):
        """Call a Redis-using phase; while the server is unreachable, skip it and retry with backoff.

        The engine keeps stepping meanwhile, rows keep being written, and acks wait: nothing that
        was read is lost (an entry read but not yet tracked stays pending and is re-claimed).
        """
        now = self.clock()
        if now < self._redis_retry_at:
            return None
        try:
            result = fn(*args)
        except REDIS_DOWN as exc:
            self._redis_backoff = min(max(self._redis_backoff * 2, 0.1), 5.0)
            self._redis_retry_at = now + self._redis_backoff
            log.warning("redis unavailable (%s); retrying in %.1fs", exc, self._redis_backoff)
            if not self.engine.has_unfinished():
                time.sleep(min(self._redis_backoff, 0.5))
            return None
        if self._redis_backoff:
            log.info("redis reachable again")
            self._redis_backoff = 0.0
        return result

    def _idle_exit_due(self) -> bool:
        limit = self.config.idle_exit_s
        if limit is None:
            return False
        busy = self.inflight or len(self.batcher) or self.engine.has_unfinished() or self.pending_acks
        if busy:
            self._last_activity = self.clock()
            return False
        return self.clock() - self._last_activity >= limit

    # -- ingest ------------------------------------------------------------------------------
    def _room(self) -> int:
        # A worker holding requests its engine could not start (waiting in the scheduler) reads
        # nothing more: what is still in the stream goes to a worker that can start it now.
        if self.engine.scheduler.num_waiting:
            return 0
        return max(0, min(self.engine.free_capacity() - len(self.batcher), self.config.max_batch))

    def _fair_share(self, room: int) -> int:
        """How many unread entries to take now: an even share of all outstanding work (unread plus
        in flight) among the live workers, less what this one holds, but at least one, so that no
        backlog waits while this worker has room. Nothing unread: ``room`` (new arrivals go to the
        blocked readers in turn)."""
        if room <= 1:
            return room
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.stream_key)
        pipe.xinfo_consumers(self.stream_key, self.config.group)
        try:
            groups, consumers = pipe.execute()
        except redis.exceptions.ResponseError:  # no stream or group yet: the read below recreates it
            return room
        group = next((g for g in groups if _s(g["name"]) == self.config.group), None)
        if group is None or not group.get("lag"):  # nothing unread, or the server cannot tell
            return room
        names = {_s(c["name"]): c for c in consumers}
        live = sum(1 for name, c in names.items()
                   if name != HANDBACK_CONSUMER and (name == self.consumer or c["idle"] < LIVE_CONSUMER_MS))
        if self.consumer not in names:
            live += 1
        share = -(-(int(group["lag"]) + int(group["pending"])) // live) - len(self.inflight)
        return max(1, min(room, share))

    def _block_ms(self) -> int | None:
        """How long XREADGROUP may block: never while the engine has work to step."""
        if self.engine.has_unfinished() or self.sinks.pending:
            return None
        wait = self.batcher.time_until_release(engine_idle=True)
        if wait is not None:
            return max(1, int(wait * 1000)) if wait > 0 else None
        cap = 1000
        if self.config.idle_exit_s is not None:
            cap = min(cap, max(1, int(self.config.idle_exit_s * 1000)))
        return cap

    def _ingest(self, now: float) -> None:
        room = self._room()
        if room <= 0:
            return
        if now - self._last_autoclaim >= min(self.config.claim_idle_ms / 2000.0, 5.0):
            self._last_autoclaim = now
            self._check_undelivered_loss()
            room -= self._autoclaim(room)
            if room <= 0:
                return
        room = self._fair_share(room)
        block = self._block_ms()
        t_read = time.perf_counter()
        try:
            response = self.redis.xreadgroup(
                self.config.group, self.consumer, {self.stream_key: ">"}, count=room, block=block
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):  # the stream or group was deleted under us: recreate
                self._ensure_group()
                return
            raise
        finally:
            if block is not None:  # waiting for entries is not work
                self._blocked_s += time.perf_counter() - t_read
        new = []
        for _key, entries in response or []:
            for entry_id, fields in entries:
                entry_id = _s(entry_id)
                if entry_id in self.inflight:
                    # Delivered again while running here (a group rewound with XGROUP SETID, a
                    # server restarted from an append-only file that lost its last second).
                    continue
                self._accept(entry_id, fields, attempt=1)
                new.append(entry_id)
        if new:
            self._apply_cancels([e for e in new if e in self.inflight])

    def _recover_own_pending(self) -> None:
        """Entries already pending under this consumer name (a restart with a fixed --consumer)."""
        response = self.redis.xreadgroup(self.config.group, self.consumer, {self.stream_key: "0"}, count=10_000)
        for _key, entries in response or []:
            for entry_id, fields in entries:
                entry_id = _s(entry_id)
                if fields:
                    self._accept(entry_id, fields, attempt=self._delivery_count(entry_id), redelivered=True)
                else:
                    self._ack_lost(entry_id)

    def _delivery_count(self, entry_id: str) -> int:
        info = self.redis.xpending_range(self.stream_key, self.config.group, entry_id, entry_id, 1)
        return int(info[0]["times_delivered"]) if info else 1

    def _autoclaim(self, room: int) -> int:
        """Take over entries idle longer than --claim-idle-ms (their worker is presumed dead)."""
        try:
            result = self.redis.xautoclaim(
                self.stream_key, self.config.group, self.consumer, self.config.claim_idle_ms,
                start_id=self._autoclaim_cursor, count=room,
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self._ensure_group()
                return 0
            raise
        # The server scans at most COUNT*10 pending entries per call: keep the cursor so that a
        # long pending list is walked in full over successive calls.
        self._autoclaim_cursor = _s(result[0]) if result else "0-0"
        entries = result[1] if len(result) > 1 else []
        deleted = result[2] if len(result) > 2 else []
        written = {e for e, _, _, _ in self.pending_acks} if deleted else set()
        for entry_id in deleted:  # pending, but trimmed from the stream: its content is gone
            entry_id = _s(entry_id)
            if entry_id in written:
                continue  # its row is written, only the ack is to come
            if entry_id in self.inflight:  # running here: the scan dropped it from our pending list
                if entry_id not in self._detached and entry_id not in self._disowned:
                    self._sort_out_gone([entry_id], pending_elsewhere=[])
                continue
            self._ack_lost(entry_id)
        for entry_id, fields in entries:
            entry_id = _s(entry_id)
            if entry_id in self.inflight:
                continue
            self.metrics.redeliveries.inc()
            self._accept(entry_id, fields, attempt=self._delivery_count(entry_id), redelivered=True)
        return len(entries)

    def _ack_lost(self, entry_id: str) -> None:
        """A pending entry whose content was removed from the stream (trimmed) before it had a row.

        If the in-flight hash names its request, that request ends with a ``lost`` error row, unless
        a newer entry carries it (the idempotency record moved on), its row is written already, or a
        registered bulk job sends it again itself; without a name, a dead letter keeps the entry id.
        """
        self.metrics.lost_entries["pending"].inc()
        raw = self.redis.hget(self.inflight_key, entry_id)
        known = None
        try:
            known = json.loads(raw) if raw is not None else None
        except ValueError:
            pass
        if not (isinstance(known, list) and len(known) == 4 and isinstance(known[1], str)):
            log.warning("entry %s was pending but is no longer in the stream (trimmed): its request is lost "
                        "and its id unknown", entry_id)
            self._dead_letter(entry_id, {}, RequestError(
                errors.LOST, "the entry was removed from the stream (trimmed) while pending; its content is gone"))
            return
        job_id, request_id, tenant, request_type = known
        log.warning("entry %s (request %r, job %r) was pending but is no longer in the stream (trimmed): "
                    "its request is lost", entry_id, request_id, job_id)
        record_key = keys.idempotency_key(self.config.stream, job_id, request_id)
        record = self.redis.get(record_key)
        if record is not None and (_s(record).split(" ", 1)[0] != entry_id or _s(record).endswith(" done")):
            self.pending_acks.append((entry_id, None, "", None))
            return
        if self._job_status(job_id) is not None:  # `mqinfer jobs` sends its lost requests again
            self.pending_acks.append((entry_id, None, "", None))
            return
        if record is not None:  # the record is this entry's: copies waiting for it get the lost row
            self._idem[entry_id] = (record_key, "")
        self._error_row(
            entry_id, request_id, job_id, errors.LOST,
            "the stream entry was removed (trimmed) while pending, before the request finished; send it again",
            attempt=self._delivery_count(entry_id), enqueued_at=entry_time(entry_id),
            # Stands in for the request whose content is gone: only its labels are read.
            request=Request(id=request_id, prompt="", tenant=tenant, request_type=request_type),
        )

    def _check_undelivered_loss(self) -> None:
        """Notice entries removed from the stream before the group read them (XTRIM below the backlog).

        Workers delete only entries they acked, so when no entry older than the group's last
        delivered one is left, entries added minus entries read minus entries left is how many
        were removed unread. One worker reports each gap (a marker key taken with NX).
        """
        pipe = self.redis.pipeline(transaction=True)
        pipe.xinfo_stream(self.stream_key)
        pipe.xinfo_groups(self.stream_key)
        try:
            stream, groups = pipe.execute()
        except redis.exceptions.ResponseError:
            return  # no stream yet
        group = next((g for g in groups if _s(g.get("name")) == self.config.group), None)
        read, added = (group or {}).get("entries-read"), stream.get("entries-added")
        if group is None or read is None or added is None:
            return  # an old server, or a counter the server cannot vouch for
        last = _s(group["last-delivered-id"])
        first = stream.get("recorded-first-entry-id")
        length = int(stream.get("length", 0))
        if length and first is not None and _id_key(_s(first)) <= _id_key(last):
            return  # pending entries are left at the head: a trim cannot have passed them
        missing = int(added) - int(read) - length
        if missing <= 0 or self._gap_reported == last:
            return
        self._gap_reported = last
        if not self.redis.set(keys.gap_marker(self.config.stream, last), self.consumer, nx=True, ex=7 * 24 * 3600):
            return  # another worker reported this gap
        self.metrics.lost_entries["undelivered"].inc(missing)
        log.error("%d entries after %s were removed from %s before any worker read them (XTRIM or MAXLEN "
                  "below the backlog?): their requests are lost and their ids unknown", missing, last,
                  self.stream_key)
        self.redis.xadd(self.dead_key, {
            "entry_id": last, "error_code": errors.LOST, "count": missing, "worker": self.consumer,
            "error": f"{missing} entries after {last} were removed from the stream before any worker read them",
        }, maxlen=100_000, approximate=True)

    def _accept(self, entry_id: str, fields: dict, attempt: int, redelivered: bool = False) -> None:
        """Decode and validate one entry; a bad one becomes an error row or a dead letter.

        A redelivered request with a reply stream first gets a ``restart`` message there, so its
        consumer drops what an earlier worker sent.
        """
        now = self.clock()
        enqueued_at = entry_time(entry_id)
        self._last_activity = now
        try:
            request = decode_entry(fields, max_entry_bytes=self.config.max_entry_bytes)
        except RequestError as exc:
            if exc.request_id is None:
                self._dead_letter(entry_id, fields, exc)
            else:
                self._error_row(entry_id, exc.request_id, _recover_job_id(fields), exc.code, exc.message,
                                attempt=attempt, enqueued_at=enqueued_at)
            return
        if not self._claim_request(entry_id, request, fields):
            return
        if redelivered and request.reply_to is not None:
            self.replies.restart(request.reply_to, request.id, request.job_id, attempt)
        if attempt > self.config.max_deliveries:
            self._error_row(
                entry_id, request.id, request.job_id, errors.MAX_DELIVERIES_EXCEEDED,
                f"delivered {attempt} times (--max-deliveries {self.config.max_deliveries}); "
                "its workers died or failed each time", attempt=attempt, enqueued_at=enqueued_at, request=request,
            )
            return
        if self._job_status(request.job_id) in CANCELLED_JOB_STATUSES:
            self._error_row(entry_id, request.id, request.job_id, None, None, attempt=attempt,
                            enqueued_at=enqueued_at, request=request, finish_reason="cancelled")
            return
        if self.config.enforce_budgets:
            refused = self.budget_guard.exceeded(request.tenant)
            if refused is not None:
                self._error_row(entry_id, request.id, request.job_id, BUDGET_EXCEEDED, refused, attempt=attempt,
                                enqueued_at=enqueued_at, request=request)
                return
        info = self.engine.info
        if request.model is not None and request.model not in (info.name, info.model_id):
            self._error_row(
                entry_id, request.id, request.job_id, errors.MODEL_MISMATCH,
                f"model: request asks for {request.model!r} but this worker serves {info.name!r}",
                attempt=attempt, enqueued_at=enqueued_at, request=request,
            )
            return
        try:
            messages = (
                [{"role": m.role, "content": m.content} for m in request.messages] if request.messages else None
            )
            limit = self.config.max_tokens_limit
            if limit is not None and request.max_tokens > limit:
                raise ValueError(f"max_tokens {request.max_tokens} is over this worker's limit of {limit} "
                                 "(--max-tokens-limit) - at `$.max_tokens`")
            prompt_ids = self.engine.encode_prompt(request.prompt, request.prompt_token_ids, messages)
            sampling = SamplingParams(**to_sampling_kwargs(request))
        except EngineInputError as exc:
            self._error_row(entry_id, request.id, request.job_id, exc.code, exc.message,
                            attempt=attempt, enqueued_at=enqueued_at, request=request)
            return
        except ValueError as exc:
            self._error_row(entry_id, request.id, request.job_id, errors.INVALID_REQUEST, str(exc),
                            attempt=attempt, enqueued_at=enqueued_at, request=request)
            return
        self.inflight[entry_id] = InFlight(
            entry_id, request, attempt, enqueued_at, prompt_token_ids=prompt_ids, sampling=sampling
        )
        self.batcher.add(entry_id)

    def _claim_request(self, entry_id: str, request: Request, fields: dict) -> bool:
        """Take the request's idempotency record for this entry; False when the entry is done with
        (a duplicate acked without computing, or a conflicting copy sent to the dead letters).

        A duplicate with a reply stream is answered there: with the first copy's stored final row
        if it was computed, when its row is written if it still runs; a conflicting copy gets an
        error row (``duplicate_id``) that is not written, so its client does not wait in vain.
        """
        ttl = self.config.idempotency_ttl_s
        if not ttl:
            return True
        record = keys.idempotency_key(self.config.stream, request.job_id, request.id)
        digest = content_digest(request)
        known = json.dumps([request.job_id, request.id, request.tenant, request.request_type])
        outcome, first, state, stored = self._claim(
            keys=[record, self.inflight_key, self.stream_key, _final_row_key(record), _waiters_key(record)],
            args=[entry_id, digest, max(1, math.ceil(ttl)), known, request.reply_to or "", MAX_WAITERS])
        outcome, first, state = _s(outcome), _s(first), _s(state)
        if outcome in ("new", "redelivery", "takeover"):
            if outcome == "takeover":
                log.info("request %r (job %r): entry %s takes over from %s, which is gone without a row",
                         request.id, request.job_id, entry_id, first)
            self._idem[entry_id] = (record, digest)
            return True
        if outcome == "same":
            self.metrics.duplicates["same"].inc()
            log.info("entry %s repeats request %r (job %r) of entry %s: computed once", entry_id, request.id,
                     request.job_id, first)
            self.pending_acks.append((entry_id, None, "", None))
            if request.reply_to is not None and state == "done":
                self._answer_duplicate(entry_id, request, first, stored)
            return False
        self.metrics.duplicates["conflict"].inc()
        message = (f"id {request.id!r} (job_id {request.job_id!r}) was already submitted with different content "
                   f"(entry {first}); a request is identified by (job_id, id) - at `$.id`")
        self._dead_letter(entry_id, fields, RequestError(errors.DUPLICATE_ID, message, request.id))
        if request.reply_to is not None:
            self.replies.final(request.reply_to, self._unwritten_error_row(entry_id, request, message))
        return False

    def _answer_duplicate(self, entry_id: str, request: Request, first: str, stored) -> None:
        """Send a copy of a computed request the first copy's final row (no row is written for it)."""
        row = None
        if stored:
            try:
                row = _ROW_DECODER.decode(stored)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("stored final row of request %r (job %r) is unreadable: %s", request.id,
                            request.job_id, exc)
        if row is None:  # computed without a reply stream of its own, so its row was not kept
            row = self._unwritten_error_row(entry_id, request, (
                f"id {request.id!r} (job_id {request.job_id!r}) was already computed (entry {first}); its row is "
                "in the results dataset and is not sent again - at `$.id`"))
        self.replies.final(request.reply_to, row)

    def _unwritten_error_row(self, entry_id: str, request: Request, message: str) -> ResultRow:
        """A ``duplicate_id`` error row that only answers on a reply stream: the dataset keeps the
        row of the request's first copy."""
        return error_result_row(
            request.id, request.job_id, errors.DUPLICATE_ID, message, tenant=request.tenant,
            model=self.engine.info.model_id, request_type=request.request_type, worker=self.consumer,
            attempt=1, enqueued_at=entry_time(entry_id), finished_at=self.clock(), metadata=dict(request.metadata),
        )

    def _dead_letter(self, entry_id: str, fields: dict, exc: RequestError) -> None:
        """No usable id: the entry goes to the dead-letter stream with the reason, then is acked."""
        self.metrics.dead_letters.inc()
        log.warning("dead letter %s: %s: %s", entry_id, exc.code, exc.message)
        dead = {"entry_id": entry_id, "error_code": exc.code, "error": exc.message[:2000], "worker": self.consumer}
        for k, v in fields.items():
            name = _s(k)
            if name in ("r", "json", "v"):
                dead["orig_" + name] = v
        self.redis.xadd(self.dead_key, dead, maxlen=100_000, approximate=True)
        self.pending_acks.append((entry_id, None, "", None))

    # -- engine ------------------------------------------------------------------------------
    def _admit(self) -> None:
        idle = not self.engine.has_unfinished()
        batch = self.batcher.poll(engine_idle=idle)
        if not batch:
            return
        now = self.clock()
        if idle:
            self.meter.idle_until(now)
        for entry_id in batch:
            item = self.inflight.get(entry_id)
            if item is None:
                continue
            req = item.request
            try:
                self.engine.add_request(
                    entry_id, item.prompt_token_ids, item.sampling,
                    arrival_time=item.enqueued_at, priority=req.priority, deadline=req.deadline,
                )
            except EngineInputError as exc:
                del self.inflight[entry_id]
                self._error_row(entry_id, req.id, req.job_id, exc.code, exc.message, attempt=item.attempt,
                                enqueued_at=item.enqueued_at, request=req)
                continue
            item.started_at = now
            self.metrics.queue_time.observe(max(0.0, now - item.enqueued_at))

    def _step(self) -> None:
        result = self.engine.step()
        if result.work:  # a step that only reported cancellations ran no model
            self.batcher.observe_step(result.end - result.start)
        scheduler = self.engine.scheduler
        held = kv_block_shares(scheduler.kv_cache_manager, (w.request_id for w in result.work))
        self.meter.step(result.end, result.work, held)
        self.metrics.record_step(result, scheduler)
        seen = self._phases_seen
        for phase, total in self.engine.phase_seconds.items():
            counter = self.metrics.engine_phase_seconds.get(phase)
            if counter is not None and total > seen.get(phase, 0.0):
                counter.inc(total - seen.get(phase, 0.0))
                seen[phase] = total
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s", json.dumps({
                "requests": len(result.work), "tokens": sum(w.num_tokens for w in result.work),
                "prefill_requests": sum(1 for w in result.work if w.is_prefill),
                "finished": sum(1 for o in result.outputs if o.finished), "running": scheduler.num_running,
                "waiting": scheduler.num_waiting, "kv_usage": round(scheduler.kv_cache_manager.usage, 4),
                "step_s": round(result.end - result.start, 6),
            }))
        for out in result.outputs:
            item = self.inflight.get(out.request_id)
            if item is None:
                continue
            if item.first_token_at is None and out.new_token_ids:
                item.first_token_at = out.first_token_time or result.end
                self.metrics.ttft.observe(max(0.0, item.first_token_at - item.enqueued_at))
            reply_to = item.request.reply_to
            if reply_to is not None and (out.new_token_ids or out.new_text) and item.entry_id not in self._disowned:
                req = item.request
                index = len(out.output_token_ids) - len(out.new_token_ids)
                self.replies.delta(reply_to, req.id, req.job_id, out.new_token_ids, out.new_text, index, item.attempt)
            if out.finished:
                self._finish(item, out)
        if self._wait_gauges is not None:
            stats = self.batcher.stats()
            self._wait_gauges[0].set(stats.wait_s)
            self._wait_gauges[1].set(stats.arrival_rate)
            self._wait_gauges[2].set(stats.step_time_s or 0.0)
        self._last_activity = result.end

    def _finish(self, item: InFlight, out) -> None:
        del self.inflight[item.entry_id]
        meter = self.meter.pop(item.entry_id)
        if item.entry_id in self._disowned:  # another worker owns the entry now: its row wins
            self._disowned.discard(item.entry_id)
            self._bill_wasted(item, meter)
            return
        now = self.clock()
        req = item.request
        info = self.engine.info
        row = ResultRow(
            job_id=req.job_id, id=req.id, tenant=req.tenant, model=info.model_id, request_type=req.request_type,
            finish_reason=out.finish_reason, error_code=out.error_code, error=out.error,
            prompt_tokens=out.num_prompt_tokens, output_tokens=len(out.output_token_ids),
            output_token_ids=list(out.output_token_ids), text=out.text, logprobs=out.logprobs,
            enqueued_at=item.enqueued_at, started_at=item.started_at, first_token_at=item.first_token_at,
            finished_at=now, worker=self.consumer, attempt=item.attempt, metadata=dict(req.metadata),
        )
        price = self.config.price_per_device_hour
        cost = CostRow(
            kind="request", job_id=req.job_id, id=req.id, tenant=req.tenant, model=info.model_id,
            request_type=req.request_type, prompt_tokens=out.num_prompt_tokens,
            cached_prompt_tokens=max(0, out.num_cached_tokens), output_tokens=len(out.output_token_ids),
            queue_s=max(0.0, (item.started_at or now) - item.enqueued_at), prefill_s=meter.prefill_s,
            decode_s=meter.decode_s, device_s=meter.device_s, recomputed_s=meter.recomputed_s,
            kv_block_s=meter.kv_block_s, cost_usd=meter.device_s * price / 3600.0,
            price_per_device_hour=price, worker=self.consumer, finished_at=now,
        )
        self.sinks.add(row, cost)
        self.pending_acks.append((item.entry_id, req.job_id, req.id, row))
        if req.reply_to is not None:
            self.pending_finals.append((req.reply_to, row))
            self._keep_final.add(item.entry_id)
        if req.job_id is not None:
            self._entry_cost[item.entry_id] = cost.cost_usd
        if self.budget_guard is not None:
            self.budget_guard.note(item.entry_id, req.tenant, cost.cost_usd, now)
        self.metrics.finish(out.finish_reason or "error")
        self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.e2e.observe(max(0.0, now - item.enqueued_at))
        self.metrics.charge(req.tenant, cost.cost_usd)
        fields = {
            "id": req.id, "job_id": req.job_id, "tenant": req.tenant, "request_type": req.request_type,
            "model": info.model_id, "worker": self.consumer, "attempt": item.attempt,
            "finish_reason": out.finish_reason, "error_code": out.error_code,
            "prompt_tokens": out.num_prompt_tokens, "cached_prompt_tokens": cost.cached_prompt_tokens,
            "output_tokens": len(out.output_token_ids), "preemptions": out.num_preemptions,
            "queue_s": round(cost.queue_s, 6),
            "ttft_s": round(item.first_token_at - item.enqueued_at, 6) if item.first_token_at else None,
            "e2e_s": round(now - item.enqueued_at, 6), "device_s": round(meter.device_s, 6),
            "recomputed_s": round(meter.recomputed_s, 6), "cost_usd": cost.cost_usd,
        }
        self._row_log.append(("finished %s", (json.dumps(fields),), fields))

    def _error_row(self, entry_id: str, request_id: str, job_id: str | None, code: str | None,
                   message: str | None, *, attempt: int, enqueued_at: float, request: Request | None = None,
                   finish_reason: str = "error") -> None:
        """A row for a request that ends without running: invalid, or its job was cancelled."""
        now = self.clock()
        info = self.engine.info
        row = error_result_row(
            request_id, job_id, code, message,
            tenant=request.tenant if request else "default",
            model=info.model_id,
            request_type=request.request_type if request else "default",
            worker=self.consumer, attempt=attempt, enqueued_at=enqueued_at, finished_at=now,
            metadata=dict(request.metadata) if request else {},
        )
        cost = CostRow(
            kind="request", job_id=job_id, id=request_id, tenant=row.tenant, model=info.model_id,
            request_type=row.request_type, prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0,
            queue_s=max(0.0, now - enqueued_at), prefill_s=0.0, decode_s=0.0, device_s=0.0, recomputed_s=0.0,
            kv_block_s=0.0, cost_usd=0.0, price_per_device_hour=self.config.price_per_device_hour,
            worker=self.consumer, finished_at=now,
        )
        if finish_reason != "error":
            row = msgspec.structs.replace(row, finish_reason=finish_reason)
        self.sinks.add(row, cost)
        self.pending_acks.append((entry_id, job_id, request_id, row))
        if request is not None and request.reply_to is not None:
            self.pending_finals.append((request.reply_to, row))
        self.metrics.finish(finish_reason)
        self._row_log.append(("%s row %s: %s: %s", (finish_reason, request_id, code, message), None))

    def _bill_wasted(self, item: InFlight, meter) -> None:
        """Device time spent on a request whose row this worker will not write bills nobody,
        but still appears (as a ``duplicate`` row), so the worker's rows add up to its uptime."""
        if meter.device_s <= 0:
            return
        req = item.request
        self.sinks.add_cost(wasted_work_row(
            meter, job_id=req.job_id, request_id=req.id, tenant=req.tenant, model=self.engine.info.model_id,
            request_type=req.request_type, prompt_tokens=len(item.prompt_token_ids), worker=self.consumer,
            price_per_device_hour=self.config.price_per_device_hour, finished_at=self.clock(),
        ))

    def _overhead_row(self, kind: str, seconds: float, now: float) -> CostRow:
        price = self.config.price_per_device_hour
        return CostRow(
            kind=kind, job_id=None, id=None, tenant=None, model=self.engine.info.model_id if self.engine else None,
            request_type=None, prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0, queue_s=0.0,
            prefill_s=0.0, decode_s=0.0, device_s=seconds, recomputed_s=0.0, kv_block_s=0.0,
            cost_usd=seconds * price / 3600.0, price_per_device_hour=price, worker=self.consumer, finished_at=now,
        )

    # -- durability and acks -----------------------------------------------------------------
    def _flush(self) -> None:
        now = self.clock()
        if not self.engine.has_unfinished():
            self.meter.idle_until(now)
        idle = self.meter.take_idle()
        if idle > 0:
            self.sinks.add_cost(self._overhead_row("idle", idle, now))
        try:
            self.sinks.flush()
            self._log_durable_rows()
            faults.hit("sink.after_write")
        except OSError as exc:
            raise SinkError("writing Parquet part files failed") from exc
        self.metrics.rows_written.inc(len(self.pending_acks))
        self._redis(self._ack)

    def _log_durable_rows(self) -> None:
        for fmt, args, fields in self._row_log:
            log.info(fmt, *args, extra={"fields": fields} if fields is not None else None)
        self._row_log.clear()

    def _ack(self) -> None:
        """Acknowledge entries whose rows are durable, in one transaction with their side effects:
        the entry leaves the stream, its id joins the job's done set, and a registered bulk job
        gets the row on its result stream. Final reply messages (rows durable now) go first."""
        for reply_to, row in self.pending_finals:
            self.replies.final(reply_to, row)
        self.pending_finals.clear()
        if self.replies:
            self.replies.send(self.redis)
        if not self.pending_acks:
            return
        ids = [entry_id for entry_id, _, _, _ in self.pending_acks]
        done: dict[str, list[str]] = {}
        for _, job_id, rid, _ in self.pending_acks:
            if job_id is not None:
                done.setdefault(job_id, []).append(rid)
        pipe = self.redis.pipeline(transaction=True)
        charged = self.budget_guard.charge(pipe, ids) if self.budget_guard is not None else []
        pipe.xack(self.stream_key, self.config.group, *ids)
        pipe.xdel(self.stream_key, *ids)  # acked entries leave the stream; pending ones never do
        pipe.hdel(self.inflight_key, *ids)
        # Copies that arrived while a request ran wait for its row: taken in this transaction, so
        # that a copy claimed after it finds the record `done` (and the stored row) instead.
        waiting: list[tuple[int, ResultRow]] = []
        ttl = max(1, math.ceil(self.config.idempotency_ttl_s or 1))
        for entry_id, _, _, row in self.pending_acks:
            idem = self._idem.get(entry_id)
            if idem is None or row is None:
                continue
            if row.finish_reason in ("stop", "length"):
                # Computed: later copies are duplicates. A request that ended otherwise (an error,
                # cancelled, expired) may be sent again and is then computed again.
                if entry_id in self._keep_final:
                    pipe.set(_final_row_key(idem[0]), _ROW_ENCODER.encode(row), ex=ttl)
                pipe.set(idem[0], f"{entry_id} {idem[1]} done", xx=True, keepttl=True)
            waiting.append((len(pipe), row))
            pipe.get(_waiters_key(idem[0]))
            pipe.set(_waiters_key(idem[0]), "", px=1, xx=True)
        for job_id, rids in done.items():
            key = keys.job_done_set(self.config.stream, job_id)
            pipe.sadd(key, *rids)
            pipe.expire(key, 7 * 24 * 3600)
        # A job's result stream is in another slot: in a cluster it cannot join the transaction.
        results_pipe = self.redis.pipeline(transaction=False) if self.config.redis_cluster else pipe
        for entry_id, job_id, rid, row in self.pending_acks:
            cost_usd = self._entry_cost.pop(entry_id, 0.0)
            if job_id is not None and row is not None and self._job_wants_rows(job_id):
                results_pipe.xadd(keys.job_results_stream(job_id),
                                  {"id": rid, "row": msgspec.json.encode(row), "cost_usd": repr(cost_usd)})
        results = pipe.execute()
        for entry_id in ids:
            self._idem.pop(entry_id, None)
            self._keep_final.discard(entry_id)
        for position, row in waiting:
            for reply_to in _waiting_reply_streams(results[position]):
                self.replies.final(reply_to, row)
        if self.replies:
            self.replies.send(self.redis)
        if results_pipe is not pipe:
            results_pipe.execute()
        if charged:
            self.budget_guard.charged(charged)
        self.pending_acks.clear()

    def _job_wants_rows(self, job_id: str) -> bool:
        """Whether `mqinfer jobs` registered this job and still collects rows from its result stream
        (a late row for a finished job must not recreate the stream it deleted)."""
        return self._job_status(job_id) not in (None, *FINAL_JOB_STATUSES)

    def _job_status(self, job_id: str | None) -> str | None:
        """A registered bulk job's status (cached for a second), or None for other requests."""
        if job_id is None:
            return None
        now = self.clock()
        cached = self._job_cache.get(job_id)
        if cached is not None and now - cached[0] < 1.0:
            return cached[1]
        status = self.redis.hget(keys.job_key(job_id), "status")
        status = _s(status) if status is not None else None
        if len(self._job_cache) > 10_000:
            self._job_cache.clear()
        self._job_cache[job_id] = (now, status)
        return status

    def _cancel_cancelled_jobs(self) -> None:
        """Running requests of a job being cancelled stop now (they end with finish_reason cancelled)."""
        for entry_id, item in list(self.inflight.items()):
            if self._job_status(item.request.job_id) in CANCELLED_JOB_STATUSES:
                if self.engine.scheduler.get_request(entry_id) is not None:
                    self.engine.cancel(entry_id)

    def _keepalive(self, now: float) -> bool:
        """Reset the idle time of the entries this worker is working on (and notice lost ones)."""
        if now - self._last_keepalive < min(self.config.claim_idle_ms / 3000.0, 1.0):
            return False
        self._last_keepalive = now
        # Finished entries whose rows wait for a flush stay ours until acked: keep them fresh too.
        mine = [e for e in self.inflight if e not in self._disowned and e not in self._detached]
        mine += [a[0] for a in self.pending_acks if a[0] not in self._detached]
        if not mine:
            return True
        owned = set()
        for chunk_start in range(0, len(mine), 1000):
            chunk = mine[chunk_start:chunk_start + 1000]
            lo, hi = min(chunk, key=_id_key), max(chunk, key=_id_key)
            for p in self.redis.xpending_range(self.stream_key, self.config.group, lo, hi, len(chunk) * 4 + 10,
                                               consumername=self.consumer):
                owned.add(_s(p["message_id"]))
        still = [e for e in mine if e in owned]
        if still:
            kept = {_s(e) for e in self.redis.xclaim(self.stream_key, self.config.group, self.consumer, 0, still,
                                                     justid=True)}
            # XCLAIM drops entries that are gone from the stream from our pending list.
            self._sort_out_gone([e for e in still if e not in kept], pending_elsewhere=[])
            self._apply_cancels(still)
        gone = [e for e in mine if e not in owned]
        if gone:
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in gone:
                pipe.xpending_range(self.stream_key, self.config.group, entry_id, entry_id, 1)
            owners = pipe.execute()
            self._sort_out_gone(gone, pending_elsewhere=[e for e, o in zip(gone, owners) if o])
        return True

    def _sort_out_gone(self, entry_ids: list[str], *, pending_elsewhere: list[str]) -> None:
        """Entries running here that are no longer pending under this worker: drop or keep our copy.

        Pending under another consumer: it took the entry over while we were stalled, drop ours.
        Pending nowhere: either that worker finished it (its idempotency record says ``done``),
        or the entry was trimmed from the stream while it ran here; then nobody else can run it,
        so we finish it from memory (without a record to tell, we finish it too: a duplicate row
        is removed by compaction, a dropped one is lost). Entries already finished here keep their
        buffered row either way.
        """
        entry_ids = [e for e in entry_ids if e in self.inflight]
        if not entry_ids:
            return
        elsewhere = set(pending_elsewhere)
        unsure = [e for e in entry_ids if e not in elsewhere and e in self._idem]
        records = dict(zip(unsure, self.redis.mget([self._idem[e][0] for e in unsure]))) if unsure else {}
        for entry_id in entry_ids:
            record = records.get(entry_id)
            done_elsewhere = record is not None and _s(record).endswith(" done")
            if entry_id not in elsewhere and not done_elsewhere:
                log.warning("entry %s was removed from the stream while running here; finishing it from memory",
                            entry_id)
                self.metrics.trimmed_in_flight.inc()
                self._detached.add(entry_id)
                continue
            log.warning("entry %s was %s by another worker; dropping our copy", entry_id,
                        "claimed" if entry_id in elsewhere else "finished")
            self._idem.pop(entry_id, None)
            self._disowned.add(entry_id)
            if self.engine.scheduler.get_request(entry_id) is not None:
                self.engine.cancel(entry_id)
            else:
                self.inflight.pop(entry_id, None)
                self._disowned.discard(entry_id)

    def _apply_cancels(self, entry_ids: list[str]) -> None:
        """Requests their producer cancelled (``Client.cancel``) stop now and end ``cancelled``.

        One ZMSCORE for all of them; a cancel older than the request's entry is for an earlier
        request with the same id and is ignored.
        """
        items = [self.inflight[e] for e in entry_ids if e in self.inflight and e not in self._disowned]
        if not items or not self._cancels_allowed:
            return
        try:
            scores = self.redis.zmscore(self.cancel_key,
                                        [cancel_member(i.request.id, i.request.job_id) for i in items])
        except redis.exceptions.NoPermissionError as exc:
            # An ACL written before cancel existed: serve on, without it, and say so once.
            self._cancels_allowed = False
            log.warning("cancel checks are off: this Redis user may not read %s (%s); grant ZMSCORE on it",
                        self.cancel_key, exc)
            return
        for item, score in zip(items, scores):
            if score is None or score < item.enqueued_at:
                continue
            req = item.request
            if self.engine.scheduler.get_request(item.entry_id) is not None:
                self.engine.cancel(item.entry_id)  # the next step reports it and _finish writes its row
            elif self.batcher.remove(item.entry_id):
                del self.inflight[item.entry_id]
                self._error_row(item.entry_id, req.id, req.job_id, None, None, attempt=item.attempt,
                                enqueued_at=item.enqueued_at, request=req, finish_reason="cancelled")

    def _drain(self) -> None:
        """Finish what runs (within the drain timeout), hand back the rest, flush and ack."""
        # Entries still in the batcher never started: they are handed back below.
        deadline = self.clock() + self.config.drain_timeout_s
        while self.engine.has_unfinished() and self.clock() < deadline:
            self._step()
            if self.replies:
                self._redis(self.replies.send, self.redis)
            if self.sinks.should_flush():
                self._flush()
        unfinished = [e for e in self.inflight if e not in self._disowned]
        for entry_id, item in self.inflight.items():  # work that no row of ours will carry
            self._bill_wasted(item, self.meter.pop(entry_id))
        if unfinished:
            for entry_id in unfinished:
                if self.engine.scheduler.get_request(entry_id) is not None:
                    self.engine.cancel(entry_id)
            self._redis(self._handback, unfinished)
            self.inflight.clear()
        self.meter.idle_until(self.clock())
        self._flush()
        for _ in range(20):  # acks of durable rows: keep trying a while if the server is away
            if not self.pending_acks:
                break
            self._redis_retry_at = 0.0
            self._redis(self._ack)
            if self.pending_acks:
                time.sleep(0.5)
        try:
            pending = self.redis.xpending_range(self.stream_key, self.config.group, "-", "+", 1,
                                                consumername=self.consumer)
            if not pending:
                self.redis.xgroup_delconsumer(self.stream_key, self.config.group, self.consumer)
        except redis.exceptions.RedisError:
            log.warning("could not remove consumer %s from the group", self.consumer)
        if self.pending_acks:
            log.warning("%d durable rows stay unacked (redis unavailable): they will be redelivered and "
                        "deduplicated by compaction", len(self.pending_acks))
        self.metrics.close()
        log.info("worker %s stopped; busy time %s", self.consumer, json.dumps(self.busy_summary()))

    def _handback(self, entry_ids: list[str]) -> None:
        """Make unfinished entries claimable at once by another worker, without counting a delivery.

        An entry trimmed from the stream while it ran here cannot be handed back: its request is
        added again as a new entry, which takes over its idempotency record."""
        for entry_id in entry_ids:
            self._idem.pop(entry_id, None)
            if entry_id in self._detached:
                new_id = self.redis.xadd(self.stream_key, encode_entry(self.inflight[entry_id].request))
                log.warning("entry %s was trimmed while running here: its request is sent again as %s",
                            entry_id, _s(new_id))
                continue
            attempt = self.inflight[entry_id].attempt
            self.redis.xclaim(
                self.stream_key, self.config.group, HANDBACK_CONSUMER, 0, [entry_id],
                idle=self.config.claim_idle_ms + 1, retrycount=max(0, attempt - 1), justid=True,
            )
        log.info("handed back %d unfinished entries", len(entry_ids))


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


