"""Cost attribution on real runs: every worker's rows add up to its uptime times its share of the
machine, duplicates bill nobody,
requests of the same shape that ran side by side cost the same, and the report equals the rows.

The fleet run has three workers, three tenants, a KV cache too small for the batches they run
(preemptions), and one worker that is killed right after writing its rows and before acking
them: the others take its entries over and run them again (a redelivery), and compaction marks
one copy of each such request ``duplicate``.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict

import pytest
import redis

from mqinfer.schemas import keys
from mqinfer.ops.compact import compact
from mqinfer.workers.devices import usable_cores
from mqinfer.ops.report import cost_report
from tests import zygote
from tests.helpers import LineCollector, mqinfer_cmd, rows, start_worker, wait_exit, wait_until, write_jsonl

PRICE = 36.0  # USD per device hour: 0.01 USD per device second
STREAM = keys.request_stream("requests")
# The test workers run one model thread each (tests/helpers.py): each bills that thread's share of
# this machine, one device.
SHARE = min(1.0, 1 / usable_cores())


def uptime_by_worker(costs: list[dict]) -> dict[str, tuple[float, float, float, float]]:
    """worker -> (uptime, device share, sum of device_s, sum of cost_usd). Uptime runs from the
    start of its startup row (finished_at - device_s / device_share) to the finished_at of its last
    row."""
    out = {}
    by_worker = defaultdict(list)
    for c in costs:
        by_worker[c["worker"]].append(c)
    for worker, mine in by_worker.items():
        (startup,) = [c for c in mine if c["kind"] == "startup"]
        (share,) = {c["device_share"] for c in mine}  # every row of a worker says the same share
        begin = startup["finished_at"].timestamp() - startup["device_s"] / share
        end = max(c["finished_at"].timestamp() for c in mine)
        out[worker] = (end - begin, share, sum(c["device_s"] for c in mine), sum(c["cost_usd"] for c in mine))
    return out


def assert_conserved(costs: list[dict], workers: set[str]) -> None:
    totals = uptime_by_worker(costs)
    assert set(totals) == workers
    for worker, (uptime, share, device_s, cost_usd) in totals.items():
        assert uptime > 0
        assert share == pytest.approx(SHARE), worker
        assert device_s == pytest.approx(uptime * share, rel=0.005), worker
        assert cost_usd == pytest.approx(uptime * share * PRICE / 3600, rel=0.005), worker


def side_by_side_pairs(results: list[dict], costs: list[dict]) -> list[tuple[dict, dict]]:
    """Billed cost rows of two requests of the same shape that ran in exactly the same steps:
    same worker, first token in the same step, same prompt and output lengths, and neither
    preempted (no recomputation) nor served from the prefix cache."""
    by_key = {(c["job_id"], c["id"], c["worker"], c["finished_at"]): c for c in costs if c["kind"] == "request"}
    groups = defaultdict(list)
    for r in results:
        c = by_key[(r["job_id"], r["id"], r["worker"], r["finished_at"])]
        if r["first_token_at"] is None or c["recomputed_s"] > 0 or c["cached_prompt_tokens"]:
            continue
        groups[(r["worker"], r["first_token_at"], r["prompt_tokens"], r["output_tokens"])].append(c)
    return [(g[0], g[i]) for g in groups.values() for i in range(1, len(g))]


def shaped(rid: str, letter: int, prompt_len: int, max_tokens: int, tenant: str, request_type: str = "chat") -> dict:
    # Prompts start with different bytes: no two share a prefix block.
    return {"id": rid, "prompt_token_ids": [letter] + [(letter * 7 + i) % 250 for i in range(prompt_len - 1)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "tenant": tenant,
            "request_type": request_type}


def test_fleet_run_conserves_time_and_bills_duplicates_to_nobody(redis_url, redis_client, tmp_path, monkeypatch):
    out = tmp_path / "out"
    # Every request fits the KV cache alone (at most 128 tokens: 8 blocks of 16), no two of them
    # at their full length do: a worker running two or more preempts.
    common = ["--max-num-seqs", "4", "--num-kv-blocks", "9", "--block-size", "16", "--claim-idle-ms", "1500",
              "--price-per-device-hour", str(PRICE), "--max-wait-ms", "20"]
    # w3 flushes rows only when its engine is empty, so it dies holding no unwritten work: its
    # second flush (the first holds its startup row) writes its request rows, then it is killed
    # before acking them.
    monkeypatch.setenv("MQINFER_FAULTS", "sink.after_write=kill@2")
    doomed = start_worker(redis_url, out, *common, "--consumer", "w3", "--flush-rows", "100000",
                          "--flush-interval-s", "600", "--idle-exit-s", "3")  # its last flush, at exit at the latest
    monkeypatch.delenv("MQINFER_FAULTS")
    others = []
    try:
        # w3 alone reads first, so that it surely holds requests when it is killed; the others
        # start once it does, and claim what it never acked.
        wait_until(lambda: (out / "costs").exists() and any(c["worker"] == "w3" for c in rows(out / "costs")),
                   timeout=120, what="w3's startup row")
        requests = _submit(redis_url, tmp_path)
        wait_until(lambda: _holds_entries(redis_client, "w3"), timeout=60, what="w3 holding entries")
        others = [start_worker(redis_url, out, *common, "--consumer", name, "--flush-interval-s", "0.1")
                  for name in ("w1", "w2")]
        _run_the_fleet(redis_client, out, doomed, others, requests)
    finally:
        for proc in (doomed, *others):  # a failed check leaves no worker behind
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _submit(redis_url, tmp_path) -> list[dict]:
    tenants = ["acme", "beta", "gamma"]
    requests = []
    for i in range(6):  # pairs of one shape, submitted one after the other
        prompt_len, max_tokens = (40 + 12 * (i % 3), 40 + 8 * (i % 4))
        # A pair shares its tenant: with a lane per tenant, its two entries are next to each other
        # in one lane, so a worker reads them together and runs them side by side.
        for j in range(2):
            requests.append(shaped(f"r{i}-{j}", 2 + 2 * i + j, prompt_len, max_tokens, tenants[i % 3],
                                   "chat" if i % 2 else "batch"))
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    sub = zygote.run(mqinfer_cmd("submit", str(src), "--redis", redis_url, "--job-id", "job-1"),
                     capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    return requests


def _holds_entries(redis_client, consumer: str) -> bool:
    """Whether ``consumer`` has read entries it has not acked, in the plain stream or any lane."""
    for key in redis_client.scan_iter(match="mqinfer:{requests*"):
        if redis_client.type(key) not in ("stream", b"stream"):
            continue
        try:
            readers = redis_client.xinfo_consumers(key, keys.GROUP)
        except redis.exceptions.ResponseError:  # no group on it yet
            continue
        for c in readers:
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == consumer and c["pending"] > 0:
                return True
    return False


def _run_the_fleet(redis_client, out, doomed, others, requests) -> None:
    wait_until(lambda: len({c["worker"] for c in rows(out / "costs")}) == 3, timeout=120,
               what="the three workers' startup rows")
    code, err = wait_exit(doomed)
    assert code == -9, f"w3 should have been killed at its second flush; exit {code}: {err[-2000:]}"
    # The survivors claim what w3 read and never acked, run it and ack it; then they are stopped
    # (however long that took on a busy machine: an idle timeout could stop them before the claim).
    ids = {r["id"] for r in requests}
    wait_until(lambda: (out / "results").exists() and {r["id"] for r in rows(out / "results") if r["worker"] != "w3"}
               == ids, timeout=180, what="every request's row from w1 or w2, w3's claimed and run again")
    for w in others:
        w.send_signal(signal.SIGTERM)
    for w in others:
        code, err = wait_exit(w)
        assert code == 0, err[-3000:]
    # Nothing is left unacked, in the plain stream or in any tenant's lane.
    streams = [k for k in redis_client.scan_iter(match="mqinfer:{requests*")
               if redis_client.type(k) in ("stream", b"stream")]
    assert streams and {k: redis_client.xlen(k) for k in streams} == dict.fromkeys(streams, 0)

    before = rows(out / "costs")
    assert_conserved(before, {"w1", "w2", "w3"})
    w3_ids = {c["id"] for c in before if c["worker"] == "w3" and c["kind"] == "request"}
    assert w3_ids, "the killed worker wrote no request rows"
    redone = {c["id"] for c in before if c["worker"] != "w3" and c["kind"] == "request"} & w3_ids
    assert redone == w3_ids  # every one of its requests ran again elsewhere

    stats = compact(out)
    assert stats.cost_rows_marked_duplicate == stats.results_before - len(requests) >= len(w3_ids)
    results = rows(out / "results")
    costs = rows(out / "costs")
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in requests)
    assert all(r["finish_reason"] == "length" for r in results)
    assert_conserved(costs, {"w1", "w2", "w3"})  # compaction keeps every cost row

    # Exactly one billed row per request, the kept result's; the other copy bills nobody.
    billed = [c for c in costs if c["kind"] == "request"]
    kept = {(r["id"], r["worker"], r["finished_at"]) for r in results}
    assert sorted(c["id"] for c in billed) == sorted(r["id"] for r in requests)
    assert {(c["id"], c["worker"], c["finished_at"]) for c in billed} == kept
    duplicates = [c for c in costs if c["kind"] == "duplicate"]
    assert {c["id"] for c in duplicates} >= w3_ids and all(c["device_s"] > 0 for c in duplicates)

    # A preemption happened, and its recomputation is billed to the request that was preempted.
    assert any(c["recomputed_s"] > 0 for c in costs if c["kind"] in ("request", "duplicate"))
    for c in costs:
        if c["kind"] in ("idle", "startup"):
            assert c["id"] is None and c["tenant"] is None and c["prefill_s"] == c["decode_s"] == 0
            continue
        assert 0 <= c["recomputed_s"] <= c["prefill_s"] + 1e-12
        assert c["device_s"] == pytest.approx(c["prefill_s"] + c["decode_s"])
        if c["kind"] == "request":
            assert c["kv_block_s"] > 0 and c["device_s"] > 0 and c["model"].startswith("tiny@")

    for a, b in side_by_side_pairs(results, costs):
        # Ran in exactly the same steps: billed the same to rounding (docs/costs.md).
        assert a["cost_usd"] == pytest.approx(b["cost_usd"], rel=1e-9), (a["id"], b["id"])

    # The report's totals are the rows' sums; duplicates count in no tenant.
    report = cost_report(out, by=["tenant"])
    assert report.totals.device_s == pytest.approx(sum(c["device_s"] for c in costs))
    assert report.totals.device_s_by_kind["duplicate"] == pytest.approx(sum(c["device_s"] for c in duplicates))
    assert report.totals.requests == len(requests)
    for g in report.groups:
        mine = [c for c in billed if c["tenant"] == g.key["tenant"]]
        assert g.requests == len(mine)
        assert g.cost_usd == pytest.approx(sum(c["cost_usd"] for c in mine))
        assert g.output_tokens == sum(c["output_tokens"] for c in mine)
    assert sum(g.cost_usd for g in report.groups) == pytest.approx(report.totals.cost_usd_by_kind["request"])
    by_job = cost_report(out, by=["job_id", "request_type"])
    assert {g.key["job_id"] for g in by_job.groups} == {"job-1"}
    assert sum(g.requests for g in by_job.groups) == len(requests)


def test_one_worker_same_shape_same_cost_logs_and_handback(redis_url, redis_client, tmp_path):
    """One worker, one batch: pairs of the same shape cost the same (to rounding), bigger shapes
    cost more; one JSON log line per finished request and one per step at debug level. Then
    SIGTERM with no drain time while two long requests run: they are handed back, and the work
    already spent on them is written as duplicate rows, so the worker's rows still add up."""
    shapes = {"small": (20, 24), "long_prompt": (80, 24), "long_output": (20, 72)}
    requests = []
    for k, (name, (prompt_len, max_tokens)) in enumerate(shapes.items()):
        for j in range(2):
            requests.append(shaped(f"{name}-{j}", 10 + 2 * k + j, prompt_len, max_tokens, "acme"))
    src = write_jsonl(tmp_path / "in.jsonl", requests)
    sub = zygote.run(mqinfer_cmd("submit", str(src), "--redis", redis_url), capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    out = tmp_path / "out"
    worker = start_worker(redis_url, out, "--flush-interval-s", "0.1", "--max-num-seqs", "8", "--drain-timeout-s", "0",
                          "--consumer", "solo", "--price-per-device-hour", str(PRICE), "--log-format", "json",
                          log_level="debug")
    stderr = LineCollector(worker.stderr)  # read as it comes: the step lines say how far it got

    def steps() -> int:
        return stderr.count(lambda line: line.startswith("{") and json.loads(line)["msg"].startswith("step "))

    try:
        wait_until(lambda: (out / "results").exists() and len(rows(out / "results")) == len(requests), timeout=120,
                   what="the first batch's rows")
        for i in range(2):
            redis_client.xadd(STREAM, {"json": json.dumps(shaped(f"long-{i}", 30 + i, 30, 1500, "beta")), "v": "1"})
        wait_until(lambda: redis_client.xpending(STREAM, keys.GROUP)["pending"] == 2, timeout=30,
                   what="the long requests to be read")
        before = steps()
        wait_until(lambda: steps() >= before + 3, timeout=60, what="the long requests to run a few steps")
    finally:
        worker.send_signal(signal.SIGTERM)
    try:
        code = worker.wait(timeout=180)
    finally:
        if worker.poll() is None:
            worker.kill()
    err = stderr.text()
    assert code == 0, err[-3000:]

    costs = rows(out / "costs")
    assert_conserved(costs, {"solo"})
    by_id = {c["id"]: c for c in costs if c["kind"] == "request"}
    assert set(by_id) == {r["id"] for r in requests}
    for name in shapes:
        a, b = by_id[f"{name}-0"], by_id[f"{name}-1"]
        assert a["cost_usd"] == pytest.approx(b["cost_usd"], rel=1e-9)
        assert a["kv_block_s"] == pytest.approx(b["kv_block_s"], rel=0.02)
    assert by_id["long_prompt-0"]["prefill_s"] > 2 * by_id["small-0"]["prefill_s"]
    assert by_id["long_output-0"]["decode_s"] > 2 * by_id["small-0"]["decode_s"]
    assert len(side_by_side_pairs(rows(out / "results"), costs)) == 3

    # Handed back unfinished: no result row, their work so far billed to nobody, claimable at once.
    handed_back = [c for c in costs if c["kind"] == "duplicate"]
    assert sorted(c["id"] for c in handed_back) == ["long-0", "long-1"]
    assert all(c["device_s"] > 0 and c["tenant"] == "beta" and c["cost_usd"] > 0 for c in handed_back)
    assert {r["id"] for r in rows(out / "results")} == set(by_id)
    pending = redis_client.xpending_range(STREAM, keys.GROUP, "-", "+", 10)
    assert len(pending) == 2 and all(p["consumer"] == b"mqinfer-handback" for p in pending)

    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    finished = [x for x in lines if x["logger"] == "mqinfer.worker" and x["msg"].startswith("finished")]
    assert sorted(x["id"] for x in finished) == sorted(by_id)
    for x in finished:
        assert x["level"] == "info"
        assert x["cost_usd"] == pytest.approx(by_id[x["id"]]["cost_usd"])
        for field in ("tenant", "model", "worker", "attempt", "finish_reason", "prompt_tokens", "output_tokens",
                      "queue_s", "ttft_s", "e2e_s", "device_s", "preemptions"):
            assert field in x, field
    steps = [x for x in lines if x["msg"].startswith("step ")]
    assert steps and all(x["level"] == "debug" for x in steps)
    first = json.loads(steps[0]["msg"][len("step "):])
    assert first["requests"] == 6 and first["tokens"] == sum(len(r["prompt_token_ids"]) for r in requests)
