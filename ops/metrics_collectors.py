"""What a worker's metrics read when Prometheus scrapes (ops/metrics.py registers them): the
meter's time totals, the stream's lag and queueing delay, device memory, the tenants' rate
limits and budgets. Each collector reads its source in the HTTP thread; one whose source fails
(Redis away) exports nothing for that scrape rather than a stale value."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# Tenants beyond a metric's label cap are summed under this label.
OTHER_TENANT = "other"
_STREAM_CACHE_S = 1.0


class MeterCollector:
    def __init__(self, meter) -> None:
        self.meter = meter

    def describe(self):
        return list(self._families(with_values=False))

    def collect(self):
        return list(self._families(with_values=True))

    def _families(self, with_values: bool):
        m = self.meter
        seconds = CounterMetricFamily(
            "mqinfer_device_seconds", "Worker wall time by state: startup (model load), idle (nothing to run), "
            "busy (engine steps).", labels=["state"],
        )
        ratio = GaugeMetricFamily(
            "mqinfer_batch_idle_ratio", "Share of recent time (exponentially weighted, 60 s) in which the engine "
            "had capacity and nothing to run.",
        )
        if with_values:
            seconds.add_metric(["startup"], m.startup_s)
            seconds.add_metric(["idle"], m.idle_total_s)
            seconds.add_metric(["busy"], m.busy_total_s)
            ratio.add_metric([], m.idle_ratio)
        yield seconds
        yield ratio


class StreamCollector:
    """``XINFO GROUPS`` of the plain stream and of each lane at scrape time, cached briefly; nothing
    exported while Redis is away."""

    def __init__(self, client, stream_key: str, group: str, clock: Callable[[], float],
                 lanes: Callable[[], dict[str, str]] | None = None) -> None:
        self.client = client
        self.stream_key = stream_key
        self.group = group
        self.clock = clock
        self.lanes = lanes
        self._lock = threading.Lock()
        self._cached_at = float("-inf")
        self._cached: dict[str, tuple[int, int, int, float]] | None = None

    def describe(self):
        return list(self._families(None))

    def collect(self):
        return list(self._families(self._read()))

    def _read(self) -> dict[str, tuple[int, int, int, float]] | None:
        with self._lock:
            now = time.monotonic()
            if now - self._cached_at < _STREAM_CACHE_S:
                return self._cached
            try:
                self._cached = self._query_all()
            except Exception as exc:  # any Redis trouble: skip this scrape, never fail it
                log.debug("stream metrics unavailable: %s", exc)
                self._cached = None
            self._cached_at = now
            return self._cached

    def _query_all(self) -> dict[str, tuple[int, int, int, float]] | None:
        """lane -> (unread, pending, length, age of the oldest unread entry)."""
        plain = self._query(self.stream_key)
        if plain is None:
            return None
        found = {"plain": plain}
        for lane, key in (self.lanes() if self.lanes is not None else {}).items():
            try:
                values = self._query(key)
            except Exception:  # a lane removed meanwhile: no series for it
                values = None
            if values is not None:
                found[lane] = values
        return found

    def _query(self, key: str) -> tuple[int, int, int, float] | None:
        info = next((g for g in self.client.xinfo_groups(key) if _text(g.get("name")) == self.group), None)
        if info is None:
            return None
        pending = int(info.get("pending") or 0)
        length = int(self.client.xlen(key))
        lag = info.get("lag")
        if lag is None:
            # The server cannot count undelivered entries (a gap in entries-read). Workers
            # delete entries once acked, so what the stream holds is pending or undelivered.
            lag = max(0, length - pending)
        lag = int(lag)
        delay = 0.0
        if lag > 0:
            last = _text(info.get("last-delivered-id")) or "0-0"
            first = self.client.xrange(key, min="(" + last, max="+", count=1)
            if first:
                ms = int(_text(first[0][0]).split("-", 1)[0])
                delay = max(0.0, self.clock() - ms / 1000.0)
        return lag, pending, length, delay

    def _families(self, values: dict[str, tuple[int, int, int, float]] | None):
        # Every worker of a stream exports the same fleet-wide values, labelled with the stream:
        # the fleet's backlog is sum(max by (stream) (mqinfer_stream_lag)), never a sum over workers.
        lag = GaugeMetricFamily("mqinfer_stream_lag", "Entries of the request stream and its lanes not yet "
                                "delivered to a worker plus those delivered and not yet acknowledged (the same "
                                "value from every worker of the stream).", labels=["stream"])
        pending = GaugeMetricFamily("mqinfer_stream_pending", "Entries delivered and not yet acknowledged, "
                                    "over the stream and its lanes.", labels=["stream"])
        delay = GaugeMetricFamily("mqinfer_queueing_delay_seconds", "Age of the oldest request in the stream or "
                                  "its lanes that no worker has read yet (0 when none waits).", labels=["stream"])
        lane_length = GaugeMetricFamily("mqinfer_lane_length", "Entries in one lane's stream (unread or pending); "
                                        "lane plain is the plain stream.", labels=["lane"])
        lane_lag = GaugeMetricFamily("mqinfer_lane_lag", "Entries of one lane not yet delivered to a worker.",
                                     labels=["lane"])
        lane_age = GaugeMetricFamily("mqinfer_lane_oldest_age_seconds", "Age of the oldest unread entry of one "
                                     "lane (0 when none waits).", labels=["lane"])
        if values is not None:
            stream = [self.stream_key]
            lag.add_metric(stream, sum(v[0] + v[1] for v in values.values()))
            pending.add_metric(stream, sum(v[1] for v in values.values()))
            delay.add_metric(stream, max(v[3] for v in values.values()))
            for lane, (unread, _pending, length, age) in sorted(values.items()):
                lane_length.add_metric([lane], length)
                lane_lag.add_metric([lane], unread)
                lane_age.add_metric([lane], age)
        return lag, pending, delay, lane_length, lane_lag, lane_age


class MemoryCollector:
    def __init__(self, devices: list[str]) -> None:
        self.devices = devices
        # Ranks on one host memory (CPU) share one value: a label only where they differ.
        self.per_rank = len(set(devices)) > 1

    def describe(self):
        return [GaugeMetricFamily("mqinfer_memory_utilization_ratio", "")]

    def collect(self):
        family = GaugeMetricFamily(
            "mqinfer_memory_utilization_ratio",
            "Share of the device's memory in use by any process (0-1); for a CPU worker, host memory; "
            "per tensor-parallel rank (label rank) where the ranks have devices of their own.",
            labels=["rank"] if self.per_rank else None,
        )
        for rank, device in enumerate(self.devices if self.per_rank else self.devices[:1]):
            try:
                value = memory_utilization(device)
            except Exception as exc:  # a scrape must not fail because a driver call did
                log.debug("memory utilisation unavailable: %s", exc)
                value = None
            if value is not None:
                family.add_metric([str(rank)] if self.per_rank else [], value)
        return [family]


def memory_utilization(device: str = "cpu") -> float | None:
    """Used share of ``device``'s memory: CUDA via the driver, the host from /proc/meminfo."""
    if device.startswith("cuda"):
        import torch  # only a worker on a GPU gets here; producers never import torch

        index = torch.device(device).index
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device() if index is None else index)
        return 1.0 - free / total if total else None
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or available is None:
        return None
    return 1.0 - available / total


class RateLimitCollector:
    def __init__(self, limits: dict, waiting_by_tenant: Callable[[], dict[str, int]], named: set[str]) -> None:
        self.limits = limits
        self.waiting_by_tenant = waiting_by_tenant
        self.named = named

    def describe(self):
        return list(self._families(with_values=False))

    def collect(self):
        return list(self._families(with_values=True))

    def _families(self, with_values: bool):
        limit = GaugeMetricFamily("mqinfer_tenant_rate_limit", "A tenant's rate limit (--tenant-limits), by kind: "
                                  "tokens_per_second, requests_per_second.", labels=["tenant", "kind"])
        waiting = GaugeMetricFamily("mqinfer_num_requests_rate_limited", "Requests held by this worker waiting on "
                                    "their tenant's rate limit.", labels=["tenant"])
        if with_values:
            for tenant in sorted(self.named):
                spec = self.limits[tenant]
                limit.add_metric([tenant, "tokens_per_second"], spec.tokens_per_s)
                if spec.requests_per_s is not None:
                    limit.add_metric([tenant, "requests_per_second"], spec.requests_per_s)
            counts: dict[str, int] = {}
            for tenant, n in self.waiting_by_tenant().items():
                label = tenant if tenant in self.named else OTHER_TENANT
                counts[label] = counts.get(label, 0) + n
            for label, n in sorted(counts.items()):
                waiting.add_metric([label], n)
        yield limit
        yield waiting


class BudgetCollector:
    """Budgets and spend: the tenants' (as ever), and every budgeted group's with the warning
    thresholds it reached (tenants, jobs, ``metadata.KEY = VALUE`` groups; at most ``max_groups``
    of them, in the order the budgets file lists them)."""

    def __init__(self, guard, client, max_tenants: int) -> None:
        self.guard = guard
        self.client = client
        self.max_tenants = max_tenants

    def describe(self):
        return list(self._families(None))

    def collect(self):
        try:
            spend = self.guard.group_spend_snapshot(self.client)
        except Exception as exc:
            log.debug("budget spend unavailable: %s", exc)
            spend = None
        return list(self._families(spend))

    def _families(self, spend: dict[tuple[str, str], float] | None):
        budget = GaugeMetricFamily("mqinfer_tenant_budget_usd", "A tenant's budget for the current budget period.",
                                   labels=["tenant"])
        spent = GaugeMetricFamily("mqinfer_tenant_spend_usd", "A tenant's spend in the current budget period, "
                                  "over every worker (acknowledged requests).", labels=["tenant"])
        group_budget = GaugeMetricFamily(
            "mqinfer_budget_usd", "A budgeted group's budget for the current budget period (key: tenant, job_id "
            "or metadata.KEY; value: the tenant, job id or label value).", labels=["key", "value"])
        group_spent = GaugeMetricFamily(
            "mqinfer_budget_spend_usd", "A budgeted group's spend in the current budget period, over every worker "
            "(acknowledged requests).", labels=["key", "value"])
        reached = GaugeMetricFamily(
            "mqinfer_budget_threshold_reached", "1 once a budgeted group's spend this budget period reached the "
            "warning threshold (percent of its budget), else 0.", labels=["key", "value", "threshold"])
        budgets = self.guard.budgets
        tenants = sorted(budgets.tenants)[: self.max_tenants]
        for tenant in tenants:
            budget.add_metric([tenant], budgets.tenants[tenant])
        groups = budgets.listed()[: self.max_tenants]
        for key, value, usd in groups:
            group_budget.add_metric([key, value], usd)
        if spend is not None:
            for tenant in tenants:
                spent.add_metric([tenant], spend.get(("tenant", tenant), 0.0))
            for key, value, usd in groups:
                now = spend.get((key, value), 0.0)
                group_spent.add_metric([key, value], now)
                hit = budgets.reached(now, usd)
                for threshold in budgets.thresholds:
                    reached.add_metric([key, value, f"{threshold:g}"], 1.0 if threshold in hit else 0.0)
        return budget, spent, group_budget, group_spent, reached


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["BudgetCollector", "MemoryCollector", "MeterCollector", "OTHER_TENANT", "RateLimitCollector",
           "StreamCollector", "memory_utilization"]
