"""Prometheus metrics of a worker (prefix ``mqinfer_``), in the style of vLLM's names.

Each worker owns one registry (no module-level mutable state), served on ``--metrics-port``
bound to 127.0.0.1 unless told otherwise, with ``/healthz`` and ``/readyz`` beside ``/metrics``.
With ``mqinfer run --workers N`` worker ``i`` serves on ``--metrics-port + i``.

Counters and histograms are updated by the worker's thread as things happen (``record_step``
once per engine step, ``charge`` and ``finish`` per request). Everything else is read when
Prometheus scrapes, in the HTTP thread, so it is current even while the engine is idle: the
engine's running / waiting counts and KV usage (plain integer reads), the meter's time totals,
device memory, the stream's lag and queueing delay (``XINFO GROUPS`` on the worker's stream,
cached for a second so that several scrapers cost one round trip) and the tenants' budgets (the
collectors in ops/metrics_collectors.py). A collector whose source fails (Redis away) exports
nothing for that scrape rather than a stale value.

Names (``_total`` is added to counters by the client library):

``mqinfer_num_requests_running``            gauge      requests in the engine's running set
``mqinfer_num_requests_waiting``            gauge      read from the stream, not running yet
``mqinfer_kv_cache_usage_ratio``            gauge      share of KV blocks held (0-1)
``mqinfer_prefix_cache_queries_total``      counter    prompt tokens looked up in the cache
``mqinfer_prefix_cache_hits_total``         counter    prompt tokens found there
``mqinfer_num_preemptions_total``           counter    requests preempted
``mqinfer_prompt_tokens_total``             counter    prompt tokens of finished requests
``mqinfer_generation_tokens_total``         counter    generated tokens
``mqinfer_request_success_total``           counter    finished requests by ``finished_reason``
``mqinfer_time_to_first_token_seconds``     histogram  enqueue to first token
``mqinfer_inter_token_latency_seconds``     histogram  gap between a request's tokens
``mqinfer_e2e_request_latency_seconds``     histogram  enqueue to result row
``mqinfer_request_queue_time_seconds``      histogram  enqueue to the first step that runs it
``mqinfer_slo_requests_total``              counter    finished requests with latency targets, by
                                                       ``tenant``
``mqinfer_slo_misses_total``                counter    of those, targets missed, by ``tenant`` and
                                                       ``kind``: ttft, tpot
``mqinfer_batch_idle_ratio``                gauge      share of the last minute or so the engine
                                                       had capacity and nothing to run
``mqinfer_device_seconds_total``            counter    wall time by ``state``: startup, idle, busy
``mqinfer_queueing_delay_seconds``          gauge      age of the oldest entry no worker has read
                                                       (by ``stream``, as the two below)
``mqinfer_memory_utilization_ratio``        gauge      device memory in use (0-1); CPU: host RAM
``mqinfer_stream_lag``                      gauge      entries not yet delivered + pending, by
                                                       ``stream``: every worker of the stream exports
                                                       the same value (take max by stream)
``mqinfer_stream_pending``                  gauge      entries delivered, not yet acked
``mqinfer_dead_letters_total``              counter    entries sent to the dead-letter stream
``mqinfer_redeliveries_total``              counter    entries taken over from another consumer
``mqinfer_cost_usd_total``                  counter    billed dollars by ``tenant`` (capped)
``mqinfer_tenant_budget_usd``               gauge      a tenant's budget (with ``--budgets``)
``mqinfer_tenant_spend_usd``                gauge      its fleet-wide spend this budget period
``mqinfer_budget_usd``                      gauge      a budgeted group's budget, by ``key``
                                                       (tenant, job_id, metadata.KEY) and ``value``
``mqinfer_budget_spend_usd``                gauge      its fleet-wide spend this budget period
``mqinfer_budget_threshold_reached``        gauge      1 once it reached the warning ``threshold``
                                                       (percent of its budget), else 0
``mqinfer_tenant_rate_limit``               gauge      a tenant's limit (``--tenant-limits``), by
                                                       ``kind``: tokens_per_second,
                                                       requests_per_second
``mqinfer_num_requests_rate_limited``       gauge      requests held here waiting on their
                                                       tenant's limit, by ``tenant``
``mqinfer_rate_limited_seconds_total``      counter    seconds requests waited on a limit
``mqinfer_rate_limited_tokens_total``       counter    tokens of requests that had to wait
``mqinfer_result_rows_written_total``       counter    result rows written durably
``mqinfer_duplicate_requests_total``        counter    entries repeating a taken request, by
                                                       ``outcome``: same (acked once), conflict
``mqinfer_stream_entries_lost_total``       counter    entries trimmed before their row, by
                                                       ``state``: pending, undelivered
``mqinfer_stream_entries_trimmed_in_flight_total``  counter  trimmed while running here (finished)
``mqinfer_spec_proposed_tokens_total``      counter    speculative decoding: proposed tokens checked,
                                                       by ``proposer``
``mqinfer_spec_accepted_tokens_total``      counter    proposed tokens kept, by ``proposer``
``mqinfer_spec_emitted_tokens_total``       counter    tokens emitted in steps with proposals (the
                                                       accepted ones plus one sampled each), by
                                                       ``proposer``
``mqinfer_process_*``                       various    resident memory, CPU seconds, open fds

Speculative decoding's acceptance rate is ``rate(mqinfer_spec_accepted_tokens_total[5m]) /
rate(mqinfer_spec_proposed_tokens_total[5m])``; tokens per checking step are emitted /
(emitted - accepted).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mqinfer.ops.metrics_collectors import (
    OTHER_TENANT,
    BudgetCollector,
    MemoryCollector,
    MeterCollector,
    RateLimitCollector,
    StreamCollector,
    memory_utilization,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "error", "expired", "cancelled")
# Tenants exported with their own label; the rest are summed under OTHER_TENANT.
DEFAULT_MAX_TENANT_LABELS = 50


class WorkerMetrics:
    def __init__(self, model: str = "", *, max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS) -> None:
        if max_tenant_labels < 1:
            raise ValueError(f"max_tenant_labels must be >= 1, got {max_tenant_labels}")
        self.model = model
        self.max_tenant_labels = max_tenant_labels
        self.registry = CollectorRegistry(auto_describe=True)
        # The families in the order /metrics lists them.
        self._add_engine_metrics()
        self._add_request_metrics()
        self._add_stream_metrics()
        self._add_cost_and_time_metrics()
        self._add_rate_limit_metrics()
        self._add_spec_metrics()
        ProcessCollector(namespace="mqinfer", registry=self.registry)
        # Deltas of the scheduler's cumulative counts, and each running request's last token time.
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_preemptions = 0
        self._seen_interrupted = 0
        self._last_token_at: dict[str, float] = {}
        self.ready = False
        self.healthy = True
        self._server: ThreadingHTTPServer | None = None

    def _add_engine_metrics(self) -> None:
        """The engine's sets and KV cache, and its token counts."""
        r = self.registry
        self.requests_running = Gauge(
            "mqinfer_num_requests_running", "Requests in the engine's running set.", registry=r
        )
        self.requests_waiting = Gauge(
            "mqinfer_num_requests_waiting", "Requests read from the stream and not yet running.", registry=r
        )
        self.kv_cache_usage = Gauge(
            "mqinfer_kv_cache_usage_ratio", "Share of KV cache blocks in use (0-1).", registry=r
        )
        self.prefix_cache_queries = Counter(
            "mqinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "mqinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.prompt_tokens = Counter("mqinfer_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("mqinfer_generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("mqinfer_num_preemptions", "Requests preempted by the scheduler.", registry=r)
        self.steps_interrupted = Counter(
            "mqinfer_steps_interrupted", "Steps given up between two layers for an arriving request with "
            "latency targets (--interrupt-steps).", registry=r)

    def _add_request_metrics(self) -> None:
        """Finished requests by reason, and their latencies."""
        r = self.registry
        finished = Counter(
            "mqinfer_request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        # Labels bound once: the hot path never builds a label set.
        self.finished = {reason: finished.labels(reason) for reason in FINISH_REASONS}
        self.ttft = Histogram(
            "mqinfer_time_to_first_token_seconds", "Time from enqueue to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "mqinfer_inter_token_latency_seconds", "Time between two generated tokens of one request.",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "mqinfer_e2e_request_latency_seconds", "Time from enqueue to the result row.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "mqinfer_request_queue_time_seconds", "Time from enqueue to the first engine step that runs the request.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self._slo_requests = Counter(
            "mqinfer_slo_requests", "Finished requests with latency targets (slo_ttft_ms, slo_tpot_ms, "
            f"--tenant-slos), by tenant (at most {self.max_tenant_labels} by name).", ["tenant"], registry=r,
        )
        self._slo_misses = Counter(
            "mqinfer_slo_misses", "Latency targets missed by finished requests, by tenant and kind (ttft: time to "
            "first token, tpot: time per output token).", ["tenant", "kind"], registry=r,
        )
        self._slo_tenants: set[str] = set()

    def _add_stream_metrics(self) -> None:
        """What happened to stream entries: dead letters, take-overs, rows, duplicates, trimmed ones."""
        r = self.registry
        self.dead_letters = Counter("mqinfer_dead_letters", "Entries sent to the dead-letter stream.", registry=r)
        self.redeliveries = Counter(
            "mqinfer_redeliveries", "Entries this worker claimed from another consumer.", registry=r
        )
        self.rows_written = Counter("mqinfer_result_rows_written", "Result rows written durably.", registry=r)
        duplicates = Counter(
            "mqinfer_duplicate_requests",
            "Entries repeating a request (same job_id and id) another entry carries: `same` content is acked "
            "without computing it again, `conflict` (different content) goes to the dead letters.",
            ["outcome"], registry=r,
        )
        self.duplicates = {outcome: duplicates.labels(outcome) for outcome in ("same", "conflict")}
        lost = Counter(
            "mqinfer_stream_entries_lost",
            "Stream entries removed (XTRIM, MAXLEN) before their request had a row: `pending` ones (read by a "
            "worker that died) and `undelivered` ones (never read).", ["state"], registry=r,
        )
        self.lost_entries = {state: lost.labels(state) for state in ("pending", "undelivered")}
        self.trimmed_in_flight = Counter(
            "mqinfer_stream_entries_trimmed_in_flight",
            "Entries removed from the stream while this worker ran their request (finished from memory).",
            registry=r,
        )

    def _add_cost_and_time_metrics(self) -> None:
        """Billed cost by tenant (named up to the label cap), busy time and engine phase time."""
        r = self.registry
        self._cost = Counter(
            "mqinfer_cost_usd", f"Billed cost in USD by tenant (at most {self.max_tenant_labels} tenants by name, "
            f"the rest as {OTHER_TENANT!r}).", ["tenant"], registry=r,
        )
        self._tenant_cost: dict[str, Any] = {}
        self.busy_seconds = Counter(
            "mqinfer_worker_busy_seconds", "Wall seconds the worker loop spent working (holding requests or "
            "rows), not waiting for entries.", registry=r,
        )
        phases = Counter(
            "mqinfer_engine_phase_seconds", "Seconds of engine steps by phase (schedule, prepare, forward, sample, "
            "postprocess); busy time less these is ingest, sinks, acks and replies.", ["phase"], registry=r,
        )
        self.engine_phase_seconds = {p: phases.labels(p) for p in ("schedule", "prepare", "forward", "sample",
                                                                    "postprocess")}

    def _add_rate_limit_metrics(self) -> None:
        """Time and tokens of requests that waited on their tenant's limit (--tenant-limits)."""
        r = self.registry
        self._throttled_seconds = Counter(
            "mqinfer_rate_limited_seconds", "Seconds requests waited on their tenant's rate limit (--tenant-limits), "
            "counted when they stop waiting.", ["tenant"], registry=r,
        )
        self._throttled_tokens = Counter(
            "mqinfer_rate_limited_tokens", "Tokens (prompt + max_tokens) of requests that had to wait on their "
            "tenant's rate limit.", ["tenant"], registry=r,
        )
        self._limited_tenants: set[str] = set()

    def _add_spec_metrics(self) -> None:
        """Speculative decoding's proposed, accepted and emitted tokens, by proposer."""
        self._spec_counters = {
            name: Counter(f"mqinfer_spec_{name}_tokens", help, ["proposer"], registry=self.registry)
            for name, help in (
                ("proposed", "Speculative decoding: proposed tokens checked by the model."),
                ("accepted", "Speculative decoding: proposed tokens kept."),
                ("emitted", "Speculative decoding: tokens emitted in steps with proposals (accepted plus one "
                            "sampled each)."),
            )
        }
        self._seen_spec: dict[str, int] = {"proposed": 0, "accepted": 0, "emitted": 0}

    # -- what the worker thread records ----------------------------------------------------------
    def finish(self, reason: str) -> None:
        counter = self.finished.get(reason)
        if counter is not None:
            counter.inc()

    def slo_outcome(self, tenant: str, missed: tuple[str, ...]) -> None:
        """A finished request with latency targets, and the kinds of target it missed."""
        label = tenant
        if tenant not in self._slo_tenants:
            if len(self._slo_tenants) < self.max_tenant_labels:
                self._slo_tenants.add(tenant)
            else:
                label = OTHER_TENANT
        self._slo_requests.labels(label).inc()
        for kind in missed:
            self._slo_misses.labels(label, kind).inc()

    def record_step(self, result, engine, spec_stats=None) -> None:
        """One engine step: generated tokens, inter-token latency, prefix-cache and preemption counts.

        ``result`` is the engine's ``StepResult``; ``engine`` the engine or its ``Scheduler``
        (read only: ``prefix_cache_queries``, ``prefix_cache_hits``, ``num_preemptions_total``, an
        engine's ``num_interrupted``);
        ``spec_stats`` the engine's ``SpecStats`` (speculative decoding's totals), if any.
        """
        now = result.end
        generated = 0
        last_token_at = self._last_token_at
        observe_itl = self.itl.observe
        for out in result.outputs:
            n = len(out.new_token_ids)
            if n:
                generated += n
                previous = last_token_at.get(out.request_id)
                if previous is not None:
                    gap = max(0.0, now - previous) / n  # tokens of one step arrive together
                    for _ in range(n):
                        observe_itl(gap)
                last_token_at[out.request_id] = now
            if out.finished:
                last_token_at.pop(out.request_id, None)
        if generated:
            self.generation_tokens.inc(generated)
        self._seen_queries = _advance(self.prefix_cache_queries, self._seen_queries, engine.prefix_cache_queries)
        self._seen_hits = _advance(self.prefix_cache_hits, self._seen_hits, engine.prefix_cache_hits)
        self._seen_preemptions = _advance(self.preemptions, self._seen_preemptions, engine.num_preemptions_total)
        self._seen_interrupted = _advance(self.steps_interrupted, self._seen_interrupted,
                                          getattr(engine, "num_interrupted", 0))
        if spec_stats is not None and spec_stats.proposed_tokens:
            seen = self._seen_spec
            for name, total in (("proposed", spec_stats.proposed_tokens), ("accepted", spec_stats.accepted_tokens),
                                ("emitted", spec_stats.emitted_tokens)):
                seen[name] = _advance(self._spec_counters[name].labels(spec_stats.proposer), seen[name], total)

    def charge(self, tenant: str | None, cost_usd: float) -> None:
        """Add a finished request's cost to its tenant's counter."""
        if cost_usd <= 0:
            return
        child = self._tenant_cost.get(tenant or "default")
        if child is None:
            child = self._tenant_child(tenant or "default")
        child.inc(cost_usd)

    def _tenant_child(self, tenant: str):
        # Named tenants up to the cap, each bound once; later ones share the OTHER_TENANT series.
        named = sum(1 for t in self._tenant_cost if t != OTHER_TENANT)
        label = tenant if named < self.max_tenant_labels or tenant == OTHER_TENANT else OTHER_TENANT
        child = self._cost.labels(label)
        if label == tenant:
            self._tenant_cost[tenant] = child
        else:
            self._tenant_cost.setdefault(OTHER_TENANT, child)
        return child

    def rate_limit_throttled(self, tenant: str, tokens: int) -> None:
        """A request of a limited tenant was refused by its bucket for the first time."""
        self._throttled_tokens.labels(self._limit_label(tenant)).inc(tokens)

    def rate_limit_waited(self, tenant: str, seconds: float) -> None:
        """A request that waited on its tenant's limit stopped waiting (admitted, expired, cancelled)."""
        self._throttled_seconds.labels(self._limit_label(tenant)).inc(seconds)

    def _limit_label(self, tenant: str) -> str:
        # Only configured tenants are limited; beyond the label cap they share OTHER_TENANT.
        return tenant if tenant in self._limited_tenants else OTHER_TENANT

    # -- what is read when Prometheus scrapes ------------------------------------------------------
    def track_rate_limits(self, limits, waiting_by_tenant: Callable[[], dict[str, int]]) -> None:
        """Export each limited tenant's limits (``limits``: tenant -> ``TenantLimit``) and how many
        of its requests wait on them here (``waiting_by_tenant``, read at scrape time)."""
        self._limited_tenants = set(sorted(limits)[: self.max_tenant_labels])
        self.registry.register(RateLimitCollector(dict(limits), waiting_by_tenant, self._limited_tenants))

    def track_engine(self, engine, num_waiting_outside: Callable[[], int] = lambda: 0) -> None:
        """Read the running / waiting counts and KV usage from ``engine`` (the engine or its
        ``Scheduler``: ``num_running``, ``num_waiting``, ``kv_usage``) at each scrape.

        ``num_waiting_outside`` counts requests the worker holds that the engine has not seen
        yet (its batcher). These are plain integer reads, safe from the HTTP thread, and current
        even while the engine is idle between steps.
        """
        self.requests_running.set_function(lambda: engine.num_running)
        self.requests_waiting.set_function(lambda: engine.num_waiting + num_waiting_outside())
        self.kv_cache_usage.set_function(lambda: engine.kv_usage)

    def track_meter(self, meter) -> None:
        """Export a ``workers.costs.Meter``'s time totals and batch idle ratio."""
        self.registry.register(MeterCollector(meter))

    def watch_stream(self, client, stream_key: str, group: str, clock: Callable[[], float] = time.time,
                     lanes: Callable[[], dict[str, str]] | None = None) -> None:
        """Export the stream's lag, pending count and queueing delay (``client``: a redis.Redis),
        over the plain stream and its lanes (``lanes()``: lane name -> stream key, the lanes the
        worker reads), in total and per lane (label ``lane``; the plain stream is ``plain``)."""
        self.registry.register(StreamCollector(client, stream_key, group, clock, lanes))

    def watch_memory(self, device: str = "cpu", *other_ranks: str) -> None:
        """Export the memory utilisation of ``device`` (``cpu``, ``cuda`` or ``cuda:N``).
        ``other_ranks``: the devices of a tensor-parallel worker's other ranks; where the ranks
        have devices of their own, one series per rank, labelled ``rank``."""
        self.registry.register(MemoryCollector([str(device), *map(str, other_ranks)]))

    def watch_kv_tiers(self, snapshot: Callable[[], list[dict]]) -> None:
        """Export the KV tiers' counters (``snapshot``: ``KVTiers.snapshot``; ops/kv_tier_metrics.py)."""
        from mqinfer.ops.kv_tier_metrics import KVTierCollector

        self.registry.register(KVTierCollector(snapshot))

    def watch_budgets(self, guard, client=None) -> None:
        """Export each budgeted tenant's and group's budget, spend and warning thresholds reached
        (``guard``: an ``ops.budgets.BudgetGuard``;
        ``client``: the Redis client scrapes read spend with, by default the guard's)."""
        self.registry.register(BudgetCollector(guard, client, self.max_tenant_labels))

    # -- HTTP --------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics, /healthz and /readyz in a daemon thread; returns the bound port."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok = metrics.healthy
                    body, ctype, code = (b"ok\n" if ok else b"unhealthy\n"), "text/plain", 200 if ok else 503
                elif path == "/readyz":
                    ok = metrics.ready and metrics.healthy
                    body, ctype, code = (b"ready\n" if ok else b"not ready\n"), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep scrapes out of the worker's log
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _advance(counter: Counter, seen: int, current: int) -> int:
    """Add the growth of a cumulative count to ``counter``; returns the new high-water mark."""
    if current > seen:
        counter.inc(current - seen)
    # A smaller value means the source was rebuilt: count from its new value on.
    return current


__all__ = ["DEFAULT_MAX_TENANT_LABELS", "FINISH_REASONS", "OTHER_TENANT", "WorkerMetrics", "memory_utilization"]
