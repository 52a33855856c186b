"""Latency targets through a real worker (the in-process harness: real engine with the tiny model
in float32, real Parquet rows, the embedded server): bad target values end as error rows naming
the field while the rest of the batch runs; tenant defaults and the slo_met column; the planned
steps change no greedy output and lose or repeat no request."""

from __future__ import annotations

import statistics
import time

from mqinfer.workers.config import EngineConfig
from tests.workers.harness import WorkerHarness, request, submit


def harness(redis_url, out, **config) -> WorkerHarness:
    engine = config.pop("engine", EngineConfig(num_threads=1, dtype="float32"))
    return WorkerHarness(redis_url, out, engine=engine, **config).start()


def openai_line(rid: str, **body) -> dict:
    return {"custom_id": rid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": [256, 10, 11], "max_tokens": 3, "temperature": 0, **body}}


HOSTILE = [0, -1, -(2**63), 2**70, 86_400_001, 1.5, 1e300, 50.0, "100", True, [], {"ms": 5}]


def test_hostile_target_values_end_as_error_rows_naming_the_field(redis_url, redis_client, tmp_path):
    w = harness(redis_url, tmp_path / "out")
    sent = {}
    for i, value in enumerate(HOSTILE):
        sent[f"t{i}"] = "$.slo_ttft_ms"
        submit(redis_client, request(f"t{i}", slo_ttft_ms=value))
        sent[f"p{i}"] = "$.slo_tpot_ms"
        submit(redis_client, request(f"p{i}", slo_ttft_ms=500, slo_tpot_ms=value))
        sent[f"o{i}"] = "$.body.slo_tpot_ms"
        submit(redis_client, openai_line(f"o{i}", slo_tpot_ms=value))
    good = {"g1": request("g1", slo_ttft_ms=1, slo_tpot_ms=86_400_000), "g2": openai_line("g2", slo_ttft_ms=2000),
            "g3": request("g3", slo_tpot_ms=None)}
    for obj in good.values():
        submit(redis_client, obj)
    total = len(sent) + len(good)
    w.until(lambda: len(w.results()) >= total, what="every row")
    rows = {r["id"]: r for r in w.results()}
    assert len(w.results()) == total and set(rows) == set(sent) | set(good)  # none lost, none twice
    for rid, path in sent.items():
        row = rows[rid]
        assert row["finish_reason"] == "error" and row["error_code"] == "invalid_request", row
        assert f"`{path}`" in row["error"], row["error"]
        assert row["slo_met"] is None
    for rid in good:
        assert rows[rid]["finish_reason"] == "length" and rows[rid]["output_tokens"] >= 3
    assert rows["g3"]["slo_met"] is None  # null targets: a bulk request
    assert rows["g1"]["slo_met"] is not None and rows["g2"]["slo_met"] is not None


def test_tenant_defaults_and_slo_met_on_the_workers_clock(redis_url, redis_client, tmp_path):
    # Each loop turn is one engine step and 10 ms on the worker's clock: a request's tokens come
    # 10 ms apart, so a 30 ms TPOT target is met and a 5 ms one is missed.
    w = harness(redis_url, tmp_path / "out", tenant_slos="chat=60000/30")
    submit(redis_client, request("default-targets", max_tokens=6, tenant="chat"))
    submit(redis_client, request("own-targets", max_tokens=6, tenant="chat", slo_tpot_ms=5))
    submit(redis_client, request("bulk", max_tokens=6, tenant="batch"))
    w.until(lambda: len(w.results()) == 3, advance_s=0.01, what="three rows")
    rows = {r["id"]: r for r in w.results()}
    assert rows["default-targets"]["slo_met"] is True
    assert rows["own-targets"]["slo_met"] is False  # its own target replaces the tenant's
    assert rows["bulk"]["slo_met"] is None
    sample = w.metrics.registry.get_sample_value
    assert sample("mqinfer_slo_requests_total", {"tenant": "chat"}) == 2
    assert sample("mqinfer_slo_misses_total", {"tenant": "chat", "kind": "tpot"}) == 1
    assert sample("mqinfer_slo_misses_total", {"tenant": "chat", "kind": "ttft"}) is None
    assert sample("mqinfer_slo_requests_total", {"tenant": "batch"}) is None


def backlog(n: int = 24) -> list[dict]:
    return [{"id": f"bulk{i}", "prompt_token_ids": [256] + [(i * 37 + j * 11) % 250 + 1 for j in range(20 + i * 3)],
             "max_tokens": 24 + i % 9, "temperature": 0, "ignore_eos": True, "tenant": "batch"} for i in range(n)]


def chats(targets: bool) -> list[dict]:
    extra = {"slo_ttft_ms": 2000, "slo_tpot_ms": 1} if targets else {}
    return [{"id": f"chat{i}", "prompt_token_ids": [256] + [(i * 53 + j) % 250 + 1 for j in range(12 + i)],
             "max_tokens": 16, "temperature": 0, "ignore_eos": True, "tenant": "chat", **extra} for i in range(6)]


def run_mix(redis_url, redis_client, out, targets: bool) -> tuple[dict[str, list[int]], int]:
    redis_client.flushall()
    w = harness(redis_url, out, max_batch=64)
    for obj in backlog():
        submit(redis_client, obj)
    w.until(lambda: w.worker.engine.scheduler.num_running >= 20, what="the backlog running")
    w.turn(12)  # decodes under way, the step-time model warm
    for obj in chats(targets):
        submit(redis_client, obj)
    w.until(lambda: len(w.results()) == 30, max_turns=3000, what="every row")
    rows = w.results()
    planned = w.worker.engine.scheduler.slo.num_planned_steps
    w.stop()
    w.worker.redis.close()
    assert len(rows) == 30 and len({r["id"] for r in rows}) == 30  # none lost, none twice
    assert all(r["finish_reason"] == "length" for r in rows)
    return {r["id"]: r["output_token_ids"] for r in rows}, planned


def test_float32_greedy_outputs_are_the_same_with_and_without_interactive_traffic(redis_url, redis_client, tmp_path):
    """The same 30 requests twice: all bulk, then six of them with targets no step can meet
    (1 ms per token), so that nearly every planned step leaves most bulk decodes out."""
    alone, planned_alone = run_mix(redis_url, redis_client, tmp_path / "alone", targets=False)
    mixed, planned_mixed = run_mix(redis_url, redis_client, tmp_path / "mixed", targets=True)
    assert planned_alone == 0 and planned_mixed > 10
    assert mixed == alone


class WallClock:
    """The real clock, for the harness (which moves its clock by nothing here)."""

    def __call__(self) -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        assert seconds == 0


def chat_tpot_ms(redis_url, redis_client, out, plans: bool) -> list[float]:
    """TPOT (ms, from the rows) of four chat requests with a 10 ms target that arrive while 120
    bulk requests decode."""
    redis_client.flushall()
    w = WorkerHarness(redis_url, out, clock=WallClock(), max_batch=256,
                      engine=EngineConfig(num_threads=1, dtype="float32")).start()
    if not plans:
        w.worker.engine.scheduler.slo = None  # every step composed as without targets
    for i in range(120):
        submit(redis_client, {"id": f"b{i}", "prompt_token_ids": [256] + [(i * 7 + j) % 250 + 1 for j in range(96)],
                              "max_tokens": 200, "temperature": 0, "ignore_eos": True, "tenant": "batch"})
    w.until(lambda: w.worker.engine.scheduler.num_running == 120, max_turns=5000, what="the backlog running")
    w.turn(12)
    for i in range(4):
        submit(redis_client, {"id": f"c{i}", "prompt_token_ids": [256] + [(i * 3 + j) % 250 + 1 for j in range(48)],
                              "max_tokens": 24, "temperature": 0, "ignore_eos": True, "tenant": "chat",
                              "slo_ttft_ms": 1000, "slo_tpot_ms": 10})
    w.until(lambda: sum(r["id"][0] == "c" for r in w.results()) == 4, max_turns=20000, what="the chat rows")
    rows = [r for r in w.results() if r["id"][0] == "c"]
    w.worker.redis.close()
    return [(r["finished_at"] - r["first_token_at"]).total_seconds() * 1000 / (r["output_tokens"] - 1) for r in rows]


def test_planned_steps_keep_interactive_tpot_well_below_its_time_beside_the_backlog(redis_url, redis_client, tmp_path):
    """Beside 120 decoding bulk requests, a chat request decodes at the backlog's step time unless
    steps are planned; planned, it runs at a fraction of it: 0.42-0.48 in nine runs on a quiet
    2-core machine, once 0.71, and 0.62 beside the rest of the suite. Asserted below 0.75, where no
    absolute bound holds on a busy machine; without planning the ratio is about 1."""
    unplanned = statistics.median(chat_tpot_ms(redis_url, redis_client, tmp_path / "a", plans=False))
    planned = statistics.median(chat_tpot_ms(redis_url, redis_client, tmp_path / "b", plans=True))
    assert planned <= 0.75 * unplanned, (planned, unplanned)


def test_targets_combine_with_speculation_choices_and_structured_output(redis_url, redis_client, tmp_path):
    """With ngram speculation on and a backlog beside them, interactive requests with n = 2 choices
    or a regex response_format get the same rows as without targets."""
    def rows_of(out, targets: dict) -> dict:
        redis_client.flushall()
        w = harness(redis_url, out, engine=EngineConfig(
            num_threads=1, dtype="float32", speculative="ngram", num_speculative_tokens=3))
        for obj in backlog(16):
            submit(redis_client, obj)
        w.until(lambda: w.worker.engine.scheduler.num_running >= 12, what="the backlog running")
        w.turn(10)
        submit(redis_client, {"id": "choices", "prompt_token_ids": [256, 5, 6, 5, 6, 5, 6], "max_tokens": 12,
                              "temperature": 0, "ignore_eos": True, "n": 2, "tenant": "chat", **targets})
        submit(redis_client, {"id": "regex", "prompt": "Pets?", "max_tokens": 40, "temperature": 0,
                              "response_format": {"type": "regex", "regex": "(cat|dog)s? [0-9]{1,2}"},
                              "tenant": "chat", **targets})
        w.until(lambda: len(w.results()) == 19, max_turns=3000, what="every row")
        planned = w.worker.engine.scheduler.slo.num_planned_steps
        w.worker.redis.close()
        return {(r["id"], r["index"]): (r["output_token_ids"], r["schema_valid"], r["slo_met"])
                for r in w.results()}, planned

    plain, _ = rows_of(tmp_path / "plain", {})
    targeted, planned = rows_of(tmp_path / "targeted", {"slo_ttft_ms": 5000, "slo_tpot_ms": 1})
    assert planned > 0 and len(targeted) == 19
    assert {k: v[:2] for k, v in targeted.items()} == {k: v[:2] for k, v in plain.items()}
    assert targeted[("regex", 0)][1] is True and {("choices", 0), ("choices", 1)} <= set(targeted)
    assert all(targeted[k][2] is not None for k in (("choices", 0), ("choices", 1), ("regex", 0)))
    assert all(v[2] is None for k, v in plain.items())


def test_missed_targets_reads_ttft_and_tpot_from_the_row():
    from mqinfer.schemas.rows import ResultRow
    from mqinfer.workers.queue.slo import missed_targets

    def row(first: float | None, finished: float, tokens: int, reason: str = "length", started=1.0) -> ResultRow:
        return ResultRow(id="r", model="m", finish_reason=reason, output_tokens=tokens, enqueued_at=1.0,
                         started_at=started, first_token_at=first, finished_at=finished, worker="w")

    assert missed_targets((None, None), row(1.1, 2.0, 10)) is None  # bulk: no verdict
    # 200 ms to the first token, then 9 gaps of 88.9 ms.
    assert missed_targets((200, 89), row(1.2, 2.0, 10)) == ()
    assert missed_targets((199, 89), row(1.2, 2.0, 10)) == ("ttft",)
    assert missed_targets((200, 88), row(1.2, 2.0, 10)) == ("tpot",)
    assert missed_targets((None, 1), row(1.2, 9.0, 1)) == ()  # one token: no gap to measure
    assert missed_targets((500, 50), row(None, 3.0, 0, "expired")) == ("ttft",)  # ran, never got a token
    assert missed_targets((500, 50), row(None, 3.0, 0, "error", started=None)) is None  # never ran
