"""A real worker process, scraped over HTTP: every metric is exported and moves when its event happens.

One worker, one scenario, scraped all along:

* held in the batcher (a long --max-wait-ms while the engine is idle, and --max-num-seqs 2 so it
  reads two entries at a time): requests waiting, stream lag and queueing delay go up;
* two entries pending under a consumer that never acks: the worker takes them over after
  --claim-idle-ms (redeliveries); an entry without an id (dead letters);
* a KV cache too small for two requests at once (preemptions, KV usage); then a request whose
  prompt prefix an earlier one computed (prefix cache hits); tenants with budgets, one of them
  spent (--enforce-budgets: budget_exceeded error rows).

At the end the counters equal what the Parquet rows say.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import urllib.error
import urllib.request

import pytest

from mqinfer.schemas import keys
from mqinfer.ops.budgets import spend_key
from tests.helpers import rows, start_worker, wait_exit, wait_until

STREAM = keys.request_stream("requests")
# The stream-level gauges carry the stream they describe.
LAG, PENDING, DELAY = (f'{name}{{stream="{STREAM}"}}' for name in
                       ("mqinfer_stream_lag", "mqinfer_stream_pending", "mqinfer_queueing_delay_seconds"))
# A sample line: name, labels (quoted values may hold braces: stream="mqinfer:{requests}"), value.
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')

NAMES = [
    "mqinfer_num_requests_running", "mqinfer_num_requests_waiting", "mqinfer_kv_cache_usage_ratio",
    "mqinfer_prefix_cache_queries_total", "mqinfer_prefix_cache_hits_total", "mqinfer_num_preemptions_total",
    "mqinfer_prompt_tokens_total", "mqinfer_generation_tokens_total", "mqinfer_request_success_total",
    "mqinfer_time_to_first_token_seconds_count", "mqinfer_inter_token_latency_seconds_count",
    "mqinfer_e2e_request_latency_seconds_count", "mqinfer_request_queue_time_seconds_count",
    "mqinfer_batch_idle_ratio", "mqinfer_device_seconds_total", "mqinfer_queueing_delay_seconds",
    "mqinfer_memory_utilization_ratio", "mqinfer_stream_lag", "mqinfer_stream_pending",
    "mqinfer_dead_letters_total", "mqinfer_redeliveries_total", "mqinfer_tenant_budget_usd",
    "mqinfer_tenant_spend_usd", "mqinfer_process_resident_memory_bytes", "mqinfer_worker_busy_seconds_total",
    'mqinfer_engine_phase_seconds_total{phase="forward"}',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def scrape(port: int) -> dict[str, float]:
    """Samples as {'name{labels}': value} (labels as exported)."""
    code, body = get(port, "/metrics")
    assert code == 200, body
    out = {}
    for line in body.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def request(rid: str, tenant: str, prompt_token_ids: list[int], max_tokens: int) -> dict:
    return {"id": rid, "tenant": tenant, "prompt_token_ids": prompt_token_ids, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}


def add(redis_client, obj: dict) -> None:
    redis_client.xadd(STREAM, {"json": json.dumps(obj), "v": "1"})


def test_every_metric_is_exported_and_moves(redis_url, redis_client, tmp_path):
    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[tenants]\ncapped = 0.000000001\nzero = 0\nacme = 100.0\n')
    port = free_port()
    out = tmp_path / "out"
    worker = start_worker(
        redis_url, out, "--metrics-port", str(port), "--max-num-seqs", "2", "--max-batch", "8",
        "--max-wait-ms", "2500", "--num-kv-blocks", "10", "--block-size", "16", "--claim-idle-ms", "1500",
        "--flush-interval-s", "0.1", "--budgets", str(budgets), "--enforce-budgets", "--consumer", "w1",
        "--price-per-device-hour", "36",
    )
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200, timeout=90, what="the worker to be ready")
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/nope")[0] == 404
        m0 = scrape(port)
        for name in NAMES:
            assert any(k == name or k.startswith(name + "{") for k in m0), f"{name} is not exported"
        assert m0[LAG] == 0 and m0["mqinfer_num_requests_running"] == 0
        assert m0['mqinfer_tenant_budget_usd{tenant="acme"}'] == 100.0
        assert 0 < m0["mqinfer_memory_utilization_ratio"] <= 1

        # Two entries pending under a consumer that never acks. In one transaction, so the
        # worker (blocked in XREADGROUP) cannot read them first.
        pipe = redis_client.pipeline(transaction=True)
        for i in (1, 2):
            pipe.xadd(STREAM, {"json": json.dumps(request(f"ghost-{i}", "acme", [256, 70 + i, 71], 3)), "v": "1"})
        pipe.xreadgroup(keys.GROUP, "ghost", {STREAM: ">"}, count=2)
        pipe.execute()
        redis_client.xadd(STREAM, {"json": json.dumps({"prompt": "no id"}), "v": "1"})  # a dead letter
        work = [request("q1", "acme", list(range(100, 140)), 56), request("q2", "beta", list(range(140, 180)), 56),
                request("q3", "beta", list(range(190, 230)), 56),
                request("capped-1", "capped", [256, 1, 2, 3], 4), request("zero-1", "zero", [256, 4, 5], 4)]
        for obj in work:
            add(redis_client, obj)

        # Read ahead into the batcher, which holds them up to --max-wait-ms (2.5 s) while the engine
        # is idle and the batch is short: four requests waiting, none acked but the dead letter and
        # zero-1 (refused as read). The queueing delay (the age of the oldest entry no worker has
        # read) stays 0 here, as this worker reads everything ahead; test_metrics.py checks it.
        seen = wait_until(lambda: (lambda m: m if m["mqinfer_num_requests_waiting"] >= 4
                                   and m[LAG] >= len(work) + 1 else None)(scrape(port)),
                          timeout=30, interval=0.05, what="requests waiting in the batcher")
        assert seen[PENDING] >= len(work) + 1  # the two ghost entries, and what the worker read

        peaks = {"mqinfer_num_requests_running": 0.0, "mqinfer_kv_cache_usage_ratio": 0.0}

        def all_rows_written():
            m = scrape(port)
            for k in peaks:
                peaks[k] = max(peaks[k], m[k])
            done = {r["id"] for r in rows(out / "results")} if (out / "results").exists() else set()
            return m if len(done) == len(work) + 2 and m[LAG] == 0 else None

        wait_until(all_rows_written, timeout=120, interval=0.05, what="every row to be written and acked")
        assert peaks["mqinfer_num_requests_running"] >= 1 and peaks["mqinfer_kv_cache_usage_ratio"] > 0.5

        def row_of(rid):
            return lambda: next((r for r in rows(out / "results") if r["id"] == rid), None)

        # A prompt prefix computed once and found in the cache by the next request that has it.
        prefix = list(range(10, 42))  # two full blocks
        add(redis_client, request("p1", "acme", prefix + [1, 2, 3], 2))
        wait_until(row_of("p1"), timeout=30, what="p1's row")
        add(redis_client, request("p2", "acme", prefix + [4, 5, 6], 2))
        # capped-1's cost is acked: capped is over its budget, and its next request is refused.
        wait_until(lambda: redis_client.hget(spend_key("requests"), "capped"), timeout=10, what="capped's spend")
        add(redis_client, request("capped-2", "capped", [256, 1, 2, 3], 4))
        wait_until(row_of("p2"), timeout=30, what="p2's row")
        wait_until(row_of("capped-2"), timeout=30, what="capped-2's row")
        wait_until(lambda: scrape(port)[LAG] == 0, timeout=30, what="every entry acked")
        m1 = scrape(port)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    code, err = wait_exit(worker)
    assert code == 0, err[-3000:]

    results = {r["id"]: r for r in rows(out / "results")}
    costs = [c for c in rows(out / "costs") if c["kind"] == "request"]
    ran = [r for r in results.values() if r["finish_reason"] == "length"]
    refused = [r for r in results.values() if r["finish_reason"] == "error"]
    assert {r["id"] for r in refused} == {"zero-1", "capped-2"}
    assert {r["error_code"] for r in refused} == {"budget_exceeded"}
    assert "budget" in results["capped-2"]["error"] and results["capped-1"]["finish_reason"] == "length"
    assert results["ghost-1"]["attempt"] == 2  # taken over from the ghost consumer

    def delta(name):
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    assert delta("mqinfer_redeliveries_total") == 2
    assert delta("mqinfer_dead_letters_total") == 1
    assert delta('mqinfer_request_success_total{finished_reason="length"}') == len(ran)
    assert delta('mqinfer_request_success_total{finished_reason="error"}') == len(refused)
    assert delta("mqinfer_generation_tokens_total") == sum(r["output_tokens"] for r in ran)
    assert delta("mqinfer_prompt_tokens_total") == sum(r["prompt_tokens"] for r in ran)
    # One inter-token gap per generated token after each request's first.
    assert delta("mqinfer_inter_token_latency_seconds_count") == sum(r["output_tokens"] - 1 for r in ran)
    assert delta("mqinfer_time_to_first_token_seconds_count") == len(ran)
    assert delta("mqinfer_e2e_request_latency_seconds_count") == len(ran)
    assert delta("mqinfer_request_queue_time_seconds_count") == len(ran)
    assert delta("mqinfer_num_preemptions_total") >= 1
    assert delta("mqinfer_prefix_cache_queries_total") >= sum(r["prompt_tokens"] for r in ran)
    assert delta("mqinfer_prefix_cache_hits_total") >= 32  # p2 found p1's two prefix blocks
    assert next(c for c in costs if c["id"] == "p2")["cached_prompt_tokens"] == 32
    for tenant in ("acme", "beta", "capped"):
        billed = sum(c["cost_usd"] for c in costs if c["tenant"] == tenant)
        assert billed > 0 and m1[f'mqinfer_cost_usd_total{{tenant="{tenant}"}}'] == pytest.approx(billed)
    assert 'mqinfer_cost_usd_total{tenant="zero"}' not in m1  # refused requests cost nothing
    assert m1['mqinfer_tenant_spend_usd{tenant="capped"}'] == pytest.approx(
        sum(c["cost_usd"] for c in costs if c["tenant"] == "capped"))
    assert m1['mqinfer_tenant_spend_usd{tenant="acme"}'] == pytest.approx(
        sum(c["cost_usd"] for c in costs if c["tenant"] == "acme"))
    assert delta('mqinfer_device_seconds_total{state="busy"}') > 0
    # Busy time and where it went: every engine phase lies inside busy time, the forward pass in it.
    busy = delta("mqinfer_worker_busy_seconds_total")
    phases = {p: delta(f'mqinfer_engine_phase_seconds_total{{phase="{p}"}}')
              for p in ("schedule", "prepare", "forward", "sample", "postprocess")}
    assert busy > 0 and phases["forward"] > 0 and phases["schedule"] > 0
    assert sum(phases.values()) <= busy * 1.01
    assert delta('mqinfer_device_seconds_total{state="idle"}') > 0
    assert 0 < m1["mqinfer_batch_idle_ratio"] < 1
    assert m1["mqinfer_num_requests_running"] == 0 and m1["mqinfer_num_requests_waiting"] == 0
    assert m1[PENDING] == 0 and m1[DELAY] == 0
