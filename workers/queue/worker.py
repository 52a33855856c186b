"""The inference worker process: one loop, one thread, calling its parts.

Each turn: read what the engine can start soon (:mod:`.ingest`: ``XREADGROUP`` bounded by free
capacity, ``XAUTOCLAIM`` of dead workers' entries, decode and validate, :mod:`.idempotency` for
producers' duplicates), pass on the requests of rate-limited tenants whose buckets give them
their tokens (:mod:`.throttle`), admit what the dual-threshold batcher releases, step the
engine, send reply messages and progress (:mod:`.replies`), keep the entries it runs its own and
apply cancels (:mod:`.ownership`), and turn finished requests into rows (:mod:`.billing`) that
are written durably before their entries are acked (:mod:`.acks`). A request with ``n`` > 1 choices
becomes its rows once its last choice finishes: one row per choice, written together, so that its
entry is acked only with all of them durable. The worker's uptime record in Redis
(its beat, and the device seconds its rows hold) lets another worker bill the time it used and
never wrote if it is killed; it bills dead workers' time itself in turn (:mod:`.uptime`).

SIGTERM drains: no new reads, finish what runs within ``drain_timeout_s``, hand the rest back,
flush, ack, exit 0. A worker that cannot write its rows exits 3 without acking them; one whose
tensor-parallel rank died exits 4, acking nothing more (another worker claims what it held). At stop it
logs where its busy time went and leaves the same as ``OUT/.mqinfer/workers/<consumer>.json``.

Metrics and the budget guard are handed in (the command line builds them from ``mqinfer.ops``),
and so is the clock: a test drives :meth:`Worker.iteration` by hand on a clock it moves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
from prometheus_client import Gauge

from mqinfer.procs import started_by, starter_gone
from mqinfer.scheduler.batcher import DynamicBatcher
from mqinfer.schemas import errors, faults, keys
from mqinfer.schemas.connection import connect_redis, redact
from mqinfer.schemas.dataset import remove_temp_files
from mqinfer.schemas.dataset_uri import check_writable, out_location
from mqinfer.schemas.rows import model_variant
from mqinfer.workers.queue.acks import Acks, SinkError
from mqinfer.workers.queue.arrivals import ArrivalWatch, interactive_entry
from mqinfer.workers.queue.billing import Billing
from mqinfer.workers.queue.buckets import TokenBuckets, server_clock_unless
from mqinfer.workers.queue.busy import BusyTime, summary_path, write_exit_summary
from mqinfer.workers.config import WorkerConfig
from mqinfer.workers.queue.costs import Meter, WorkModel, kv_block_shares, process_start_time
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.queue.finishing import Finishing
from mqinfer.workers.heap import CollectorPauses, freeze_startup_heap
from mqinfer.workers.queue.idempotency import Idempotency
from mqinfer.workers.queue.consumer_group import HANDBACK_CONSUMER, DeadLetters, announced, ensure_group
from mqinfer.workers.queue.context import QueueContext
from mqinfer.workers.queue.ingest import Ingest
from mqinfer.workers.queue.jobs import JobStatuses
from mqinfer.workers.queue.job_caps import JobCaps
from mqinfer.workers.queue.kv_prefixes import TierPrefixes
from mqinfer.workers.queue.lanes import key_of, share_group
from mqinfer.workers.queue.ownership import Ownership
from mqinfer.workers.engine.parallel import RankFailure
from mqinfer.workers.queue.reconnect import Backoff, wait_for_redis
from mqinfer.workers.queue.replies import Replies
from mqinfer.workers.queue.sink import Sinks
from mqinfer.workers.queue.slo import LatencyTargets
from mqinfer.workers.queue.throttle import Throttle
from mqinfer.workers.queue.uptime import LostTime, UptimeRecord

log = logging.getLogger("mqinfer.worker")

# Tries to ack durable rows at stop while Redis is away, half a second apart.
_FINAL_ACK_TRIES = 20


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Worker:
    def __init__(self, config: WorkerConfig, *, metrics, budget_guard=None,
                 clock: Callable[[], float] = time.time) -> None:
        """``metrics``: a ``WorkerMetrics`` (``mqinfer.ops.metrics``); ``budget_guard``: a
        ``BudgetGuard`` (``mqinfer.ops.budgets``), needed with ``enforce_budgets``."""
        if config.enforce_budgets and budget_guard is None:
            raise ValueError("enforce_budgets needs a budget guard (--budgets FILE)")
        self.config = config
        self.clock = clock
        self.started = clock()
        self._parent_pid = started_by()
        self.consumer = config.consumer or default_consumer_name()
        self.stream_key = keys.request_stream(config.stream)
        self.redis = connect_redis(config.redis_url, cluster=config.redis_cluster)
        self.metrics = metrics
        self.budget_guard = budget_guard
        self.batcher = DynamicBatcher(max_batch=config.max_batch, max_wait_ms=config.max_wait_ms)
        self.jobs = JobStatuses(self.redis, clock=clock)
        self.job_caps = JobCaps(self.redis, clock=clock)
        self.billing = Billing(self.consumer, config.price_per_device_hour, clock=clock,
                               targets=LatencyTargets(config.tenant_slo_map))
        self.replies = Replies(self.consumer, config.stream, maxlen=config.reply_maxlen, ttl_s=config.reply_ttl_s)
        self.idempotency = Idempotency(self.redis, config.stream, ttl_s=config.idempotency_ttl_s,
                                       replies=self.replies, billing=self.billing, metrics=metrics)
        self.busy = BusyTime(metrics)
        self.stopping = False
        # Built by start(), once the engine is up.
        self.engine: LLMEngine | None = None
        self.gc_pauses: CollectorPauses | None = None  # installed by run(), after start-up
        self.meter: Meter | None = None
        self.acks: Acks | None = None
        self.ownership: Ownership | None = None
        self.ingest: Ingest | None = None
        # Watches the streams during a step for a request with latency targets (arrivals.py).
        self.arrivals: ArrivalWatch | None = None
        self.finishing: Finishing | None = None
        # With --tenant-limits: requests of limited tenants waiting on their buckets.
        self.throttle: Throttle | None = None
        self.uptime: UptimeRecord | None = None
        self.lost: LostTime | None = None
        self._last_lost_scan = float("-inf")
        # The entry whose last try runs alone in the engine now (workers/queue/last_try.py), if any.
        self._alone: str | None = None
        self._wait_gauges: tuple[Gauge, Gauge, Gauge] | None = None
        # With KV tiers: the prompt prefixes they hold, published for prefix routing.
        self.tier_prefixes: TierPrefixes | None = None
        self._last_activity = self.started
        # Every Redis call of the loop goes through this: on a connection error it backs off and
        # returns None instead of raising, and skips calls until the backoff has passed
        # (workers/queue/reconnect.py).
        self._with_backoff = Backoff(clock=clock, busy=lambda: self.engine.has_unfinished(),
                                     ping=lambda: self.redis.ping())

    # -- lifecycle ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        def on_signal(signum, _frame):
            if self.stopping:
                return
            log.info("signal %s: draining", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        """Serve until SIGTERM or idle exit; 0 on a clean stop, 3 when rows could not be written."""
        self._install_signals()
        self.start()
        # Here, not in start(): a test that starts a worker in its own process must not freeze that
        # process's heap.
        freeze_startup_heap()
        self.gc_pauses = CollectorPauses().install()
        code = 0
        try:
            while not self.stopping:
                self.iteration()
                if self._idle_exit_due():
                    log.info("idle for %.1fs: exiting", self.config.idle_exit_s)
                    break
            self.drain()
        except SinkError as exc:
            # Nothing unwritten was acked: the entries stay pending and another worker redoes them.
            self.metrics.healthy = False
            log.error("cannot write result rows (%s): exiting unhealthy without acking them", exc.__cause__)
            code = 3
        except RankFailure as exc:
            # As after a crash: what this worker holds stays pending, for another worker to claim.
            self.metrics.healthy = False
            log.error("%s: the worker stops without acking what it holds", exc)
            code = 4
        self.close(code)
        return code

    def start(self) -> None:
        """Wait for Redis, load the engine, wire the parts, write the startup row, and take back
        what is pending under this consumer's name."""
        cfg = self.config
        out = out_location(cfg.out_dir)
        if isinstance(out, Path):
            out.mkdir(parents=True, exist_ok=True)
            removed = remove_temp_files(out)
            if removed:
                log.info("removed %d leftover temporary part files", removed)
        else:
            check_writable(out)  # object storage: no temp objects to clean, parts appear whole
        self._wait_for_redis()
        limits = cfg.tenant_limit_map
        if limits:
            # Before the model loads: limits that cannot be enforced stop the worker at once.
            buckets = TokenBuckets(self.redis, limits, clock=server_clock_unless(self.clock))
            buckets.check()
            self.throttle = Throttle(limits, buckets, max_take=cfg.max_batch, metrics=self.metrics, clock=self.clock)
        with announced(self.redis, self.stream_key, cfg.group, self.consumer):
            self.engine = engine = LLMEngine(cfg.engine, clock=self.clock)
        info = engine.info
        if getattr(engine, "kv_tiers", None) is not None:
            self.tier_prefixes = TierPrefixes(self.redis, cfg.stream,
                                              prefix_cache_scope=cfg.engine.prefix_cache_scope)
        self.billing.model = info.model_id
        ecfg = cfg.engine
        self.billing.model_variant = model_variant(
            dtype=info.dtype, quantization=ecfg.quantization,
            kv_cache_dtype=info.dtype if ecfg.kv_cache_dtype == "auto" else ecfg.kv_cache_dtype,
            tensor_parallel_size=ecfg.tensor_parallel_size, pipeline_parallel_size=ecfg.pipeline_parallel_size)
        share = cfg.device_share if cfg.device_share is not None else engine.device_share
        self.billing.device_share = share
        self.meter = Meter(
            WorkModel.for_model(
                num_params=info.num_params, vocab_size=info.vocab_size, hidden_size=info.hidden_size,
                num_layers=info.num_layers, num_heads=info.num_heads, head_dim=info.head_dim,
                tied=getattr(info, "tie_word_embeddings", False),
            ),
            start=self._startup_began(), block_size=cfg.engine.block_size, device_share=share,
        )
        self._watch(engine)
        sinks = Sinks(out, self.consumer, flush_rows=cfg.flush_rows, flush_interval_s=cfg.flush_interval_s,
                      clock=self.clock,
                      before_rename=(lambda _p: faults.hit("sink.before_rename")) if faults.enabled() else None)
        context = QueueContext(self.redis, cfg, self.consumer, idempotency=self.idempotency, jobs=self.jobs,
                               replies=self.replies, metrics=self.metrics, throttle=self.throttle,
                               budget_guard=self.budget_guard, clock=self.clock)
        self.acks = Acks(context, sinks=sinks, billing=self.billing, job_caps=self.job_caps)
        dead_letters = DeadLetters(self.redis, cfg.stream, self.consumer, acks=self.acks, metrics=self.metrics)
        self.ownership = Ownership(context, engine=engine, batcher=self.batcher, acks=self.acks,
                                   dead_letters=dead_letters)
        self.ingest = Ingest(context, engine=engine, batcher=self.batcher, ownership=self.ownership, acks=self.acks,
                             dead_letters=dead_letters)
        if cfg.interrupt_steps and not cfg.redis_cluster:
            self.arrivals = ArrivalWatch(self.redis, lambda: [lane.key for lane in self.ingest.lanes],
                                         interactive_entry(self.billing.targets, cfg.max_entry_bytes,
                                                           lambda lane: key_of(cfg.stream, lane)))
        self.finishing = Finishing(ownership=self.ownership, meter=self.meter, billing=self.billing, acks=self.acks,
                                   metrics=self.metrics, lanes=self.ingest.lanes, clock=self.clock,
                                   tier_prefixes=self.tier_prefixes)
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            log.info("metrics on http://%s:%d/metrics", cfg.metrics_host, port)
        self.uptime = UptimeRecord(self.redis, cfg.stream, self.consumer, started_at=self.meter.start,
                                   model=info.model_id, price_per_device_hour=cfg.price_per_device_hour,
                                   device_share=share)
        self.lost = LostTime(self.redis, cfg.stream, cfg.group, self.consumer, claim_idle_ms=cfg.claim_idle_ms,
                             skip=lambda name: name == HANDBACK_CONSUMER)
        now = self.clock()
        startup_s = self.meter.startup_done(now)
        self.acks.add_cost(self.billing.overhead("startup", startup_s, now))
        for row in self._with_backoff(self.lost.previous_life, now) or ():
            self.acks.add_cost(row)
        self._with_backoff(self.uptime.beat, now, billed_s=self.uptime.billed_s, fresh=True)
        self.metrics.ready = True
        self._last_activity = now
        log.info("worker %s ready: model %s, stream %s on %s, startup %.2fs, billing %.3g of a device",
                 self.consumer, info.model_id, self.stream_key, redact(cfg.redis_url), self.meter.startup_s, share)
        self._with_backoff(self.ingest.recover_own_pending)

    def _watch(self, engine: LLMEngine) -> None:
        """What the metrics read at scrape time: the engine, the meter, memory, the stream, budgets."""
        cfg = self.config
        self.metrics.track_meter(self.meter)
        throttle = self.throttle
        if throttle is None:
            self.metrics.track_engine(engine, self.batcher.__len__)
        else:
            self.metrics.track_engine(engine, lambda: len(self.batcher) + len(throttle))
            self.metrics.track_rate_limits(throttle.limits, throttle.waiting_by_tenant)
        self.metrics.watch_memory(str(engine.device), *engine.rank_devices[1:])
        if getattr(engine, "kv_tiers", None) is not None:
            self.metrics.watch_kv_tiers(engine.kv_tiers.snapshot)
        # Scrapes read Redis from the HTTP thread, on their own client with a short timeout.
        scrape_redis = connect_redis(cfg.redis_url, cluster=cfg.redis_cluster, socket_timeout=2.0)
        self.metrics.watch_stream(scrape_redis, self.stream_key, cfg.group, clock=self.clock,
                                  lanes=lambda: {lane.name: lane.key for lane in self.ingest.lanes if lane.name})
        if self.budget_guard is not None:
            self.metrics.watch_budgets(self.budget_guard, scrape_redis)
        r = self.metrics.registry
        self._wait_gauges = (
            Gauge("mqinfer_batcher_max_wait_seconds", "The batcher's wait threshold in force.", registry=r),
            Gauge("mqinfer_batcher_arrival_rate", "Requests per second reaching the batcher (adaptive wait).",
                  registry=r),
            Gauge("mqinfer_batcher_step_time_seconds", "Moving average of engine step time (adaptive wait).",
                  registry=r),
        ) if self.batcher.adaptive is not None else None

    def _startup_began(self) -> float:
        """Where the startup row begins: the process's start (imports count as startup), unless
        the worker runs on an injected clock."""
        began = process_start_time() if self.clock is time.time else None
        return min(self.started, began) if began is not None else self.started

    def _wait_for_redis(self) -> None:
        wait_for_redis(lambda: ensure_group(self.redis, self.stream_key, self.config.group), self.config.redis_url,
                       timeout_s=self.config.redis_wait_s, what=f"the consumer group of {self.stream_key}")

    # -- the loop ----------------------------------------------------------------------------
    def _holds_work(self) -> bool:
        return bool(len(self.ownership) or self.acks.pending or self.acks.rows_buffered or len(self.batcher))

    def iteration(self) -> None:
        """One turn of the loop; its time counts as busy when the worker held work before or after
        it (less the time a read blocked waiting for entries)."""
        t0, blocked0 = time.perf_counter(), self.ingest.blocked_s
        worked = self._holds_work()
        now = self.clock()
        if not self.engine.has_unfinished():
            self.meter.idle_until(now)  # keeps the batch idle ratio current while nothing runs
        self._with_backoff(self.ingest.read, now)
        if self.throttle is not None:
            self._with_backoff(self._release_throttled, self.clock())
        self._admit()
        if self.engine.has_unfinished():
            self._step()
            faults.hit("worker.after_step")
        now = self.clock()
        if self.replies.due(now):
            self._with_backoff(self.replies.send, self.redis, now)
        if self.tier_prefixes is not None:
            self._with_backoff(self.tier_prefixes.publish, now)
        if self._with_backoff(self.ownership.keepalive, now):
            self._with_backoff(self.uptime.beat, now, billed_s=self.uptime.billed_s)
            self._with_backoff(self.ownership.cancel_cancelled_jobs)
        if now - self._last_lost_scan >= min(self.config.claim_idle_ms / 2000.0, 5.0):
            self._last_lost_scan = now
            for row in self._with_backoff(self.lost.scan, now) or ():
                self.acks.add_cost(row)
        if self.acks.rows_buffered and (self.acks.should_flush() or not self.engine.has_unfinished()):
            self._flush()
        elif self.acks.pending and not self.acks.rows_buffered:
            # Only acks whose rows are durable (a flush whose ack failed): with rows still
            # buffered, the pending acks hold their entries too, and they wait for the next flush.
            self._with_backoff(self.acks.ack)
        if worked or self._holds_work():
            self.busy.add(time.perf_counter() - t0 - (self.ingest.blocked_s - blocked0))

    def _idle_exit_due(self) -> bool:
        limit = self.config.idle_exit_s
        if limit is None:
            return False
        if len(self.ownership) or len(self.batcher) or self.engine.has_unfinished() or self.acks.pending:
            self._last_activity = self.clock()
            return False
        return self.clock() - max(self._last_activity, self.ingest.last_accept) >= limit

    # -- the engine --------------------------------------------------------------------------
    def _release_throttled(self, now: float) -> None:
        """Requests whose tenant's bucket gave them their tokens go to the batcher; those whose
        deadline passed while they waited on the limit end with error ``rate_limited``."""
        released = self.throttle.release(now)
        for held in released.admitted:
            if held.entry_id in self.ownership:  # else cancelled or taken over meanwhile
                self.batcher.add(held.entry_id)
        for held in released.expired:
            if held.entry_id not in self.ownership:
                continue
            item, ours = self.ownership.release(held.entry_id)
            if not ours:
                continue
            req = item.request
            limit = self.throttle.limits[held.tenant]
            self.acks.add_error(
                item.entry_id, req.id, req.job_id, errors.RATE_LIMITED,
                f"tenant {held.tenant!r} is over its rate limit ({limit.describe()}, --tenant-limits); the "
                f"request ({held.tokens} tokens) waited {now - held.since:.1f}s and its deadline passed - at "
                "`$.deadline`",
                attempt=item.attempt, enqueued_at=item.enqueued_at, request=req)

    def _admit(self) -> None:
        idle = not self.engine.has_unfinished()
        if idle:
            self._alone = None
        batch = self.batcher.poll(engine_idle=idle)
        if not batch:
            return
        now = self.clock()
        if idle:
            self.meter.idle_until(now)
        # A last try runs alone (workers/queue/last_try.py): while one runs, or one waits for the engine
        # to empty, nothing else starts; the rest go back to the batcher's front.
        items = [(e, item) for e in batch if (item := self.ownership.get(e)) is not None]
        start, later, self._alone = self.ingest.last_tries.split(items, not idle, self._alone)
        for entry_id, item in start:
            req = item.request
            refused = self.job_caps.exceeded(req.job_id, self._unacked_usd) if req.job_id is not None else None
            if refused is not None:
                self.ownership.release(entry_id)
                self.acks.add_error(entry_id, req.id, req.job_id, errors.BUDGET_EXCEEDED, refused,
                                    attempt=item.attempt, enqueued_at=item.enqueued_at, request=req)
                if self._alone == entry_id:
                    self._alone = None
                continue
            if self._alone == entry_id:
                self._with_backoff(self.ingest.last_tries.mark, entry_id)
            faults.hit(f"worker.admit.{req.id}")
            ttft_ms, tpot_ms = self.billing.targets.of(req)
            try:
                self.engine.add_request(entry_id, item.prompt_token_ids, item.sampling, arrival_time=item.enqueued_at,
                                        priority=req.priority, deadline=req.deadline, tenant=req.tenant,
                                        share_group=share_group(entry_id), speculative=req.speculative,
                                        cache_salt=req.cache_salt, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms)
            except EngineInputError as exc:
                self.ownership.release(entry_id)
                self.acks.add_error(entry_id, req.id, req.job_id, exc.code, exc.message, attempt=item.attempt,
                                    enqueued_at=item.enqueued_at, request=req)
                if self._alone == entry_id:
                    self._alone = None
                continue
        if later:
            self.batcher.requeue(later)

    def _unacked_usd(self, job_id: str) -> float:
        """This worker's spend on ``job_id`` not acked yet: its rows written and its requests in
        the engine (the device time they used so far), for the job's cost cap."""
        usd = self.acks.pending_usd(job_id)
        for request_id, meter in self.meter.requests.items():
            item = self.ownership.get(request_id)
            if item is not None and item.request.job_id == job_id:
                usd += meter.device_s * self.billing.price / 3600.0
        return usd

    def _step(self) -> None:
        watch = self.arrivals
        if watch is None:
            result = self.engine.step()
        else:
            watch.arm()
            try:
                result = self.engine.step(interrupt=watch.arrived.is_set)
            finally:
                arrived_on = watch.disarm()
            if arrived_on:
                self.ingest.expect_arrival(arrived_on)
        # A step that only reported cancellations ran no model; a given-up one is not a step's time.
        if result.work and not result.interrupted:
            self.batcher.observe_step(result.end - result.start)
        engine = self.engine
        self.meter.step(result.end, result.work, kv_block_shares(engine, (w.request_id for w in result.work)))
        self.metrics.record_step(result, engine, getattr(engine, "spec_stats", None))
        self.busy.phases(self.engine.phase_seconds)
        # A request starts when the scheduler first gives it tokens (a prompt chunk), not when it
        # joins the engine's waiting queue: its queueing delay includes the wait there.
        for work in result.work:
            if work.is_prefill:
                item = self.ownership.get(work.request_id)
                if item is not None and item.started_at is None:
                    item.started_at = result.start
                    self.metrics.queue_time.observe(max(0.0, result.start - item.enqueued_at))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s", json.dumps({
                "requests": len(result.work), "tokens": sum(w.num_tokens for w in result.work),
                "prefill_requests": sum(1 for w in result.work if w.is_prefill),
                "finished": sum(1 for o in result.outputs if o.finished), "running": engine.num_running,
                "waiting": engine.num_waiting, "kv_usage": round(engine.kv_usage, 4),
                "step_s": round(result.end - result.start, 6),
                # What the step's time depends on beyond its token count (mqinfer plan's step shape):
                # each prompt chunk's tokens and context, and the decode tokens' summed context.
                "prompt_chunks": [[w.num_tokens, w.context_len] for w in result.work if w.num_tokens > 1],
                "decode_context": sum(w.context_len for w in result.work if w.num_tokens == 1),
            }))
        for out in result.outputs:
            item = self.ownership.get(out.request_id)
            if item is None:
                continue
            if item.first_token_at is None and out.new_token_ids:
                item.first_token_at = out.first_token_time or result.end
                self.metrics.ttft.observe(max(0.0, item.first_token_at - item.enqueued_at))
            if self.ownership.owns(item.entry_id):
                self.replies.step_output(item, out)
            if out.finished:
                self.finishing.finish(out)
        if self._wait_gauges is not None:
            stats = self.batcher.stats()
            self._wait_gauges[0].set(stats.wait_s)
            self._wait_gauges[1].set(stats.arrival_rate)
            self._wait_gauges[2].set(stats.step_time_s or 0.0)
        self._last_activity = result.end

    def _flush(self) -> None:
        """Write the buffered rows (and the idle time since the last flush) durably, then ack."""
        now = self.clock()
        if not self.engine.has_unfinished():
            self.meter.idle_until(now)
        idle = self.uptime.idle_to_bill(self.meter.take_idle())
        if idle > 0:
            self.acks.add_cost(self.billing.overhead("idle", idle, now))
        # The record counts the rows before they are written: killed while writing, this worker is
        # billed less than its uptime, never more.
        writing_s = self.acks.sinks.buffered_device_s(self.consumer)
        self._with_backoff(self.uptime.before_write, now, writing_s)
        try:
            self.acks.write()
        except SinkError:
            self._with_backoff(self.uptime.beat, now, billed_s=self.uptime.billed_s)  # what is written, only
            raise
        self.uptime.written(writing_s)
        self._with_backoff(self.lost.confirm)
        self._with_backoff(self.acks.ack)

    # -- stopping ----------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish what runs (within the drain timeout), hand back the rest, flush and ack."""
        # Entries still in the batcher, and requests waiting in the engine that have never run,
        # never started: they are handed back below, for a worker that is staying.
        self.engine.withdraw(self.engine.unstarted_request_ids())
        deadline = self.clock() + self.config.drain_timeout_s
        while self.engine.has_unfinished() and self.clock() < deadline:
            self._step()
            now = self.clock()
            if self.replies.due(now):
                self._with_backoff(self.replies.send, self.redis, now)
            if self.acks.should_flush():
                self._flush()
        ownership = self.ownership
        unfinished = ownership.unfinished()
        for item in ownership.inflight.values():  # work that no row of ours will carry
            self.finishing.bill_wasted(item, self.finishing.pop_meter(item))
        if unfinished:
            for entry_id in unfinished:
                ownership.stop(entry_id)
            self._with_backoff(ownership.handback, unfinished)
            ownership.inflight.clear()
        self.meter.idle_until(self.clock())
        self._flush()
        self._with_backoff.retry_now()
        self._with_backoff(self.uptime.close, self.clock())  # every second written: nothing to bill as lost
        for _ in range(_FINAL_ACK_TRIES):  # acks of durable rows: keep trying a while if the server is away
            if not self.acks.pending:
                break
            self._with_backoff.retry_now()
            self._with_backoff(self.acks.ack)
            if self.acks.pending and starter_gone(self._parent_pid):
                # The process that started us is gone (a `mqinfer run` killed, its embedded server
                # with it): no server is coming back to take these acks.
                break
            if self.acks.pending:
                time.sleep(0.5)
        self._with_backoff.retry_now()
        self._with_backoff(self.replies.send, self.redis, self.clock(), force=True)  # the last progress counts
        for lane in self.ingest.lanes:
            try:
                pending = self.redis.xpending_range(lane.key, self.config.group, "-", "+", 1,
                                                    consumername=self.consumer)
                if not pending:
                    self.redis.xgroup_delconsumer(lane.key, self.config.group, self.consumer)
            except redis.exceptions.RedisError:
                log.warning("could not remove consumer %s from the group of %s", self.consumer, lane.key)
        if self.acks.pending:
            log.warning("%d durable rows stay unacked (redis unavailable): they will be redelivered and "
                        "deduplicated by compaction", len(self.acks.pending))

    def busy_summary(self) -> dict:
        """Where the worker's busy time went (see :meth:`BusyTime.summary`)."""
        return self.busy.summary(self.engine.phase_seconds)

    def exit_summary(self, code: int = 0) -> dict:
        """What a stopped worker leaves for benchmarks: its busy-time summary, how many requests it
        finished, how many result rows it wrote and its uptime (from the process's start)."""
        now = self.clock()
        summary = {"consumer": self.consumer, "exit_code": code, **self.busy_summary(),
                   "requests_finished": self.acks.requests_finished, "result_rows": self.acks.rows_written,
                   "uptime_s": round(max(0.0, now - self.meter.start), 4), "stopped_at": now}
        if self.gc_pauses is not None:
            summary["gc"] = self.gc_pauses.summary()
        engine = self.engine
        if engine is not None:
            summary["steps"], summary["steps_interrupted"] = engine.num_steps, engine.num_interrupted
        if engine is not None and engine.spec_stats.proposer != "none":
            # Speculative decoding's totals, and the engine's steps to put them against.
            summary["speculation"] = {**dataclasses.asdict(engine.spec_stats), "steps": engine.num_steps}
        return summary

    def close(self, code: int = 0) -> None:
        """The worker stopped (drained, or unable to write): metrics off, its busy time logged and
        its exit summary written."""
        self.metrics.close()
        if self.arrivals is not None:
            self.arrivals.close()
        if self.engine is not None:
            self.engine.close()
        log.info("worker %s stopped; busy time %s", self.consumer, json.dumps(self.busy_summary()))
        if self.gc_pauses is not None:
            log.info("worker %s: garbage collector while serving %s", self.consumer,
                     json.dumps(self.gc_pauses.summary()))
        path = summary_path(self.config.out_dir, self.consumer)
        try:
            write_exit_summary(path, self.exit_summary(code))
        except (OSError, ValueError) as exc:
            log.warning("could not write the exit summary %s: %s", path, exc)
