"""WorkerMetrics on its own: tenant label cap, per-step counters, scrape-time collectors, HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mqinfer.schemas import keys
from mqinfer.ops.budgets import Budgets, BudgetGuard, spend_key
from mqinfer.ops.metrics import OTHER_TENANT, WorkerMetrics, memory_utilization
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.workers.queue.costs import Meter, WorkModel


def samples(metrics: WorkerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_cost_by_tenant_caps_its_labels():
    m = WorkerMetrics(max_tenant_labels=2)
    for tenant, usd in [("t1", 1.0), ("t2", 2.0), ("t3", 3.0), ("t4", 4.0), ("t1", 0.5), (None, 0.0), ("t3", 1.0)]:
        m.charge(tenant, usd)
    got = {k: v for k, v in samples(m).items() if k.startswith("mqinfer_cost_usd_total")}
    assert got == {'mqinfer_cost_usd_total{tenant="t1"}': 1.5, 'mqinfer_cost_usd_total{tenant="t2"}': 2.0,
                   f'mqinfer_cost_usd_total{{tenant="{OTHER_TENANT}"}}': 8.0}
    with pytest.raises(ValueError, match="max_tenant_labels"):
        WorkerMetrics(max_tenant_labels=0)


@dataclass
class Out:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False


@dataclass
class Step:
    outputs: list[Out]
    end: float


@dataclass
class SchedulerCounts:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions_total: int = 0


def test_record_step_counts_tokens_gaps_and_cumulative_deltas():
    m = WorkerMetrics()
    counts = SchedulerCounts()
    m.record_step(Step([Out("a", [1]), Out("b", [2])], end=10.0), counts)  # first tokens: no gap yet
    counts.prefix_cache_queries, counts.prefix_cache_hits, counts.num_preemptions_total = 40, 16, 1
    m.record_step(Step([Out("a", [3]), Out("b", [4, 5], finished=True)], end=10.5), counts)
    m.record_step(Step([Out("a", [6], finished=True)], end=10.6), counts)
    counts.prefix_cache_queries = 50
    m.record_step(Step([Out("b", [7])], end=11.0), counts)  # a new request reusing the id "b"
    s = samples(m)
    assert s["mqinfer_generation_tokens_total"] == 7
    # a: 0.5 then 0.1; b: two tokens arriving together 0.5 s after its first -> 0.25 each.
    assert s["mqinfer_inter_token_latency_seconds_count"] == 4
    assert s["mqinfer_inter_token_latency_seconds_sum"] == pytest.approx(0.5 + 0.1 + 0.25 + 0.25)
    assert s["mqinfer_prefix_cache_queries_total"] == 50 and s["mqinfer_prefix_cache_hits_total"] == 16
    assert s["mqinfer_num_preemptions_total"] == 1


def test_engine_gauges_are_read_at_scrape_time():
    m = WorkerMetrics()
    scheduler = Scheduler(SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64))
    held = [3]
    m.track_engine(scheduler, lambda: held[0])
    s = samples(m)
    assert (s["mqinfer_num_requests_running"], s["mqinfer_num_requests_waiting"]) == (0, 3)
    scheduler.add_request(EngineRequest("r1", list(range(10)), SamplingParams(max_tokens=4)))
    held[0] = 0
    assert samples(m)["mqinfer_num_requests_waiting"] == 1
    scheduler.schedule()
    s = samples(m)
    assert (s["mqinfer_num_requests_running"], s["mqinfer_num_requests_waiting"]) == (1, 0)
    assert s["mqinfer_kv_cache_usage_ratio"] == pytest.approx(3 / 8)


def test_meter_totals_and_idle_ratio():
    m = WorkerMetrics()
    meter = Meter(WorkModel(1.0, 1.0, 1.0), start=0.0)
    m.track_meter(meter)
    meter.startup_done(2.0)
    meter.idle_until(5.0)
    s = samples(m)
    assert s['mqinfer_device_seconds_total{state="startup"}'] == 2.0
    assert s['mqinfer_device_seconds_total{state="idle"}'] == 3.0
    assert s['mqinfer_device_seconds_total{state="busy"}'] == 0.0
    assert s["mqinfer_batch_idle_ratio"] == pytest.approx(meter.idle_ratio) and s["mqinfer_batch_idle_ratio"] > 0


def test_stream_lag_pending_and_queueing_delay(redis_client):
    stream = keys.request_stream("lagtest")
    redis_client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [redis_client.xadd(stream, {"json": json.dumps({"id": f"r{i}"})}, id=f"{1_000_000 + i * 1000}-0")
           for i in range(5)]
    redis_client.xreadgroup(keys.GROUP, "someone", {stream: ">"}, count=2)
    m = WorkerMetrics()
    m.watch_stream(redis_client, stream, keys.GROUP, clock=lambda: 1_010.0)
    s = samples(m)
    label = f'{{stream="{stream}"}}'
    assert s["mqinfer_stream_lag" + label] == 5 and s["mqinfer_stream_pending" + label] == 2
    # The oldest entry nobody read was added at 1_002 s (its id's milliseconds).
    assert s["mqinfer_queueing_delay_seconds" + label] == pytest.approx(8.0)
    assert ids[2] == b"1002000-0"

    other = WorkerMetrics()
    other.watch_stream(redis_client, keys.request_stream("no-such-stream"), keys.GROUP)
    assert "mqinfer_stream_lag" not in samples(other)  # nothing to report, and no failed scrape


def test_stream_metrics_count_every_lane_in_total_and_per_lane(redis_client):
    plain = keys.request_stream("lanetest")
    lane = keys.request_stream("lanetest:lane:t-a-1")
    for key, n in ((plain, 1), (lane, 3)):
        redis_client.xgroup_create(key, keys.GROUP, id="0", mkstream=True)
        for i in range(n):
            redis_client.xadd(key, {"json": "{}"}, id=f"{1_000_000 + i * 1000}-0")
    redis_client.xreadgroup(keys.GROUP, "someone", {lane: ">"}, count=1)
    m = WorkerMetrics()
    m.watch_stream(redis_client, plain, keys.GROUP, clock=lambda: 1_010.0, lanes=lambda: {"t-a-1": lane})
    s = samples(m)
    label = f'{{stream="{plain}"}}'
    assert s["mqinfer_stream_lag" + label] == 4 and s["mqinfer_stream_pending" + label] == 1
    assert s['mqinfer_lane_length{lane="plain"}'] == 1 and s['mqinfer_lane_length{lane="t-a-1"}'] == 3
    assert s['mqinfer_lane_lag{lane="t-a-1"}'] == 2
    # The lane's oldest unread entry was added at 1_001 s; the plain stream's at 1_000 s.
    assert s['mqinfer_lane_oldest_age_seconds{lane="t-a-1"}'] == pytest.approx(9.0)
    assert s["mqinfer_queueing_delay_seconds" + label] == pytest.approx(10.0)


def test_budget_gauges(redis_client):
    guard = BudgetGuard(Budgets(tenants={"acme": 2.5, "beta": 1.0}), redis_client, "requests")
    redis_client.hincrbyfloat(spend_key("requests"), "acme", 0.75)
    m = WorkerMetrics()
    m.watch_budgets(guard)
    s = samples(m)
    assert s['mqinfer_tenant_budget_usd{tenant="acme"}'] == 2.5
    assert s['mqinfer_tenant_spend_usd{tenant="acme"}'] == 0.75
    assert s['mqinfer_tenant_spend_usd{tenant="beta"}'] == 0.0


def test_memory_utilization_of_the_host():
    value = memory_utilization("cpu")
    assert value is not None and 0.0 < value < 1.0
    m = WorkerMetrics()
    m.watch_memory("cpu")
    assert 0.0 < samples(m)["mqinfer_memory_utilization_ratio"] < 1.0


def test_memory_utilization_per_tensor_parallel_rank(monkeypatch):
    from mqinfer.ops import metrics_collectors

    used = {"cuda:0": 0.25, "cuda:1": 0.5, "cpu": 0.125}
    monkeypatch.setattr(metrics_collectors, "memory_utilization", lambda device: used[device])
    m = WorkerMetrics()
    m.watch_memory("cuda:0", "cuda:1")  # two ranks on two GPUs: a series each
    s = samples(m)
    assert s['mqinfer_memory_utilization_ratio{rank="0"}'] == 0.25
    assert s['mqinfer_memory_utilization_ratio{rank="1"}'] == 0.5
    m = WorkerMetrics()
    m.watch_memory("cpu", "cpu")  # two ranks on one host's memory: one value, no label
    assert samples(m)["mqinfer_memory_utilization_ratio"] == 0.125


def test_health_and_readiness_endpoints():
    m = WorkerMetrics()
    port = m.serve(0)

    def status(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert (status("/healthz"), status("/readyz"), status("/metrics"), status("/x")) == (200, 503, 200, 404)
        m.ready = True
        assert status("/readyz") == 200
        m.healthy = False
        assert (status("/healthz"), status("/readyz")) == (503, 503)
    finally:
        m.close()
