"""n choices and the sampling parameters through a worker (the embedded Redis server, the tiny model,
real Parquet rows): one row per choice with its index, written together and acked once all are
durable; one final reply carrying every choice; the prompt billed once (choice 0's cost row), the
rows adding up to the worker's uptime; hand-back and cancel of every choice; OpenAI Batch lines
with these parameters; out-of-range values as error rows naming the field."""

from __future__ import annotations

import json

import pytest

from mqinfer.client import Client, parse_reply
from mqinfer.kernels.sampling import choice_seed
from mqinfer.ops.compact import compact
from mqinfer.workers.devices import usable_cores
from tests.workers.harness import STREAM, WorkerHarness, pending, submit

PROMPT = [256] + [(7 * i) % 250 + 3 for i in range(39)]  # 40 tokens: two full blocks of 16 and 8 more
SHARE = min(1.0, 1 / usable_cores())


@pytest.fixture
def harness(redis_url, tmp_path):
    made = []

    def make(**config) -> WorkerHarness:
        h = WorkerHarness(redis_url, tmp_path / "out", **config).start()
        made.append(h)
        return h

    yield make
    for h in made:
        h.worker.redis.close()


def _replies(client, stream: str) -> list:
    return [parse_reply(fields) for _, fields in client.xrange(stream)]


def _assert_conserved(costs: list[dict]) -> None:
    """The worker's rows add up to its uptime times its share (one worker, a fake clock)."""
    (startup,) = [c for c in costs if c["kind"] == "startup"]
    begin = startup["finished_at"].timestamp() - startup["device_s"] / startup["device_share"]
    end = max(c["finished_at"].timestamp() for c in costs)
    # Timestamps are stored in microseconds.
    assert sum(c["device_s"] for c in costs) == pytest.approx((end - begin) * SHARE, rel=1e-4, abs=1e-5)


def test_choices_are_rows_of_their_own_written_and_acked_together(harness, redis_client):
    h = harness()
    entry = submit(redis_client, {"id": "c", "job_id": "j", "prompt_token_ids": PROMPT, "n": 3, "max_tokens": 6,
                                  "temperature": 0.9, "seed": 42, "ignore_eos": True, "reply_to": "mqinfer:reply:c",
                                  "presence_penalty": 0.5, "metadata": {"k": "v"}})
    single = submit(redis_client, {"id": "one", "job_id": "j", "prompt_token_ids": PROMPT, "max_tokens": 6,
                                   "temperature": 0.9, "seed": 42, "ignore_eos": True, "presence_penalty": 0.5})
    # Choice 0 computes the prompt; the others join a step later, so it finishes first: its row
    # waits for theirs, and the entry stays pending.
    h.until(lambda: h.worker.ownership.get(entry) is not None and h.worker.ownership.get(entry).choices,
            advance_s=0.01, what="choice 0 finished")
    assert sorted(h.worker.ownership.get(entry).choices) == [0]
    h.worker._flush()  # a flush now writes nothing of c and acks nothing
    assert "c" not in {r["id"] for r in h.results()} and entry in pending(redis_client)
    assert entry not in h.worker.acks.holds()
    h.until(lambda: len(h.results()) == 4, advance_s=0.01, what="four rows")
    h.turn(advance_s=0.6)
    assert pending(redis_client) == {} and redis_client.xlen(STREAM) == 0

    rows = sorted((r for r in h.results() if r["id"] == "c"), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert all((r["job_id"], r["finish_reason"], r["output_tokens"], r["metadata"]) == ("j", "length", 6, [("k", "v")])
               for r in rows)
    assert len({r["finished_at"] for r in rows}) == 1  # written together
    assert len({tuple(r["output_token_ids"]) for r in rows}) == 3
    [one] = [r for r in h.results() if r["id"] == "one"]
    assert one["index"] == 0 and one["output_token_ids"] == rows[0]["output_token_ids"]  # choice 0 is n = 1

    # One final message, once every row is durable, carrying every choice; deltas name their choice.
    events = _replies(redis_client, "mqinfer:reply:c")
    finals = [e for e in events if e.type == "final"]
    assert len(finals) == 1 and events[-1] is finals[0]
    assert [r.index for r in finals[0].rows] == [0, 1, 2] and finals[0].row == finals[0].rows[0]
    assert [r.output_token_ids for r in finals[0].rows] == [r["output_token_ids"] for r in rows]
    for i in range(3):
        tokens = [t for e in events if e.type == "delta" and e.choice == i for t in e.token_ids]
        assert tokens == rows[i]["output_token_ids"]

    # The prompt is billed once: choice 0 computed it, the others took its two full blocks from the
    # prefix cache and computed the last 8 tokens themselves.
    costs = {c["index"]: c for c in h.costs() if c["kind"] == "request" and c["id"] == "c"}
    assert sorted(costs) == [0, 1, 2]
    assert [costs[i]["cached_prompt_tokens"] for i in range(3)] == [0, 32, 32]
    assert all(costs[i]["prompt_tokens"] == 40 for i in range(3))
    assert all(costs[i]["device_s"] > 0 for i in range(3))
    h.stop()
    _assert_conserved(h.costs())


def test_choices_are_reproducible_alone_and_batched_and_compact_keeps_each(harness, redis_client, tmp_path):
    h = harness()
    line = {"id": "x", "prompt_token_ids": PROMPT, "n": 4, "max_tokens": 8, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "repetition_penalty": 1.2, "logit_bias": {"65": 2.0}}
    submit(redis_client, {**line, "job_id": "alone"})
    h.until(lambda: len(h.results()) == 4, advance_s=0.01, what="x alone")
    for i in range(12):
        submit(redis_client, {"id": f"o{i}", "job_id": "batch", "prompt_token_ids": [256, i + 3, 9],
                              "max_tokens": 5 + i, "temperature": 0.7, "seed": i, "n": 1 + i % 3,
                              "frequency_penalty": 0.3 * (i % 2)})
        if i == 5:
            submit(redis_client, {**line, "job_id": "batch"})
    h.until(lambda: len(h.results()) == 4 + 4 + sum(1 + i % 3 for i in range(12)), advance_s=0.01, what="all rows")
    h.turn(advance_s=0.6)
    by_job = {}
    for r in h.results():
        if r["id"] == "x":
            by_job.setdefault(r["job_id"], {})[r["index"]] = r["output_token_ids"]
    assert by_job["alone"] == by_job["batch"] and sorted(by_job["alone"]) == [0, 1, 2, 3]
    h.stop()
    _assert_conserved(h.costs())
    compact(h.out)
    assert len(h.results()) == 4 + 4 + sum(1 + i % 3 for i in range(12))  # one row per (job_id, id, index)


def test_choice_seeds_come_from_the_request_seed(harness, redis_client):
    h = harness()
    submit(redis_client, {"id": "n", "prompt_token_ids": PROMPT, "n": 3, "max_tokens": 5, "temperature": 0.8,
                          "seed": 99, "ignore_eos": True})
    for i in range(3):
        submit(redis_client, {"id": f"s{i}", "prompt_token_ids": PROMPT, "max_tokens": 5, "temperature": 0.8,
                              "seed": choice_seed(99, i), "ignore_eos": True})
    h.until(lambda: len(h.results()) == 6, advance_s=0.01, what="six rows")
    rows = {(r["id"], r["index"]): r["output_token_ids"] for r in h.results()}
    assert [rows[("n", i)] for i in range(3)] == [rows[(f"s{i}", 0)] for i in range(3)]


def test_the_client_gets_every_choice(harness, redis_url):
    h = harness()
    with Client(redis_url) as client:
        client.submit({"id": "cl", "prompt_token_ids": PROMPT, "n": 2, "max_tokens": 4, "temperature": 1.0,
                       "seed": 1, "ignore_eos": True})
        h.until(lambda: len(h.results()) == 2, advance_s=0.01, what="two rows")
        h.turn(advance_s=0.6)
        rows = client.choices("cl", timeout=10)
        assert [r.index for r in rows] == [0, 1] and [r.id for r in rows] == ["cl", "cl"]
        assert client.result("cl", timeout=10) == rows[0]
        written = sorted(h.results(), key=lambda r: r["index"])
        assert [r.output_token_ids for r in rows] == [r["output_token_ids"] for r in written]


def test_drain_hands_back_every_choice_and_bills_their_time_once(harness, redis_client):
    h = harness(drain_timeout_s=0)
    entry = submit(redis_client, {"id": "long", "prompt_token_ids": PROMPT, "n": 3, "max_tokens": 60,
                                  "temperature": 0.0, "ignore_eos": True})
    h.until(lambda: h.worker.engine.scheduler.num_running == 3, advance_s=0.01, what="three choices running")
    h.turn(2, advance_s=0.01)
    h.stop()
    assert h.results() == [] and pending(redis_client)[entry]["consumer"] == "mqinfer-handback"
    [wasted] = [c for c in h.costs() if c["kind"] == "duplicate"]
    assert wasted["id"] == "long" and wasted["device_s"] > 0
    _assert_conserved(h.costs())

    h2 = harness(consumer="harness-2")
    h2.until(lambda: len(h2.results()) == 3, advance_s=0.01, what="the handed-back request's rows")
    assert sorted(r["index"] for r in h2.results()) == [0, 1, 2]
    assert all(r["output_tokens"] == 60 for r in h2.results())


def test_a_cancelled_request_ends_every_choice(harness, redis_client):
    h = harness()
    with Client(h.worker.config.redis_url) as client:
        client.submit({"id": "stop-me", "prompt_token_ids": PROMPT, "n": 3, "max_tokens": 500, "temperature": 0.0,
                       "ignore_eos": True})
        h.until(lambda: h.worker.engine.scheduler.num_running == 3, advance_s=0.01, what="three choices running")
        client.cancel("stop-me")
        h.until(lambda: len(h.results()) == 3, advance_s=0.4, what="three cancelled rows")
        assert {(r["index"], r["finish_reason"]) for r in h.results()} == {(0, "cancelled"), (1, "cancelled"),
                                                                          (2, "cancelled")}
        assert [r.index for r in client.choices("stop-me", timeout=10)] == [0, 1, 2]
    assert not h.worker.engine.has_unfinished()


def test_openai_lines_with_the_parameters_and_out_of_range_values(harness, redis_client):
    h = harness()

    def openai(custom_id: str, url: str, body: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 5, "seed": 3, **body}}

    chat = {"messages": [{"role": "user", "content": "Say something"}]}
    submit(redis_client, openai("oa-chat", "/v1/chat/completions", {
        **chat, "n": 2, "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"65": 100},
        "temperature": 0}))
    submit(redis_client, openai("oa-comp", "/v1/completions", {
        "prompt": "Once", "n": 3, "repetition_penalty": 1.3, "min_tokens": 5, "temperature": 0.9}))
    submit(redis_client, openai("oa-range", "/v1/chat/completions", {**chat, "presence_penalty": 3}))
    submit(redis_client, openai("oa-best", "/v1/completions", {"prompt": "x", "best_of": 2}))
    submit(redis_client, openai("oa-vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"5000": 1}}))
    submit(redis_client, {"id": "native-vocab", "prompt": "x", "logit_bias": {"264": 1}})
    submit(redis_client, {"id": "native-n", "prompt": "x", "n": 200})
    h.until(lambda: len(h.results()) == 2 + 3 + 5, advance_s=0.01, what="ten rows")
    rows = {(r["id"], r["index"]): r for r in h.results()}
    assert [rows[("oa-chat", i)]["output_token_ids"] for i in range(2)] == [[65] * 5] * 2
    comp = [rows[("oa-comp", i)] for i in range(3)]
    assert all(r["finish_reason"] in ("stop", "length") and r["output_tokens"] >= 5 for r in comp)
    errors = {rid: rows[(rid, 0)] for rid in ("oa-range", "oa-best", "oa-vocab", "native-vocab", "native-n")}
    assert errors["oa-range"]["error_code"] == "invalid_request"
    assert "at `$.body.presence_penalty`" in errors["oa-range"]["error"]
    assert errors["oa-best"]["error_code"] == "unsupported_parameter" and "best_of" in errors["oa-best"]["error"]
    assert errors["oa-vocab"]["error_code"] == "invalid_token_id"
    assert "at `$.body.logit_bias`" in errors["oa-vocab"]["error"] and "5000" in errors["oa-vocab"]["error"]
    assert errors["native-vocab"]["error_code"] == "invalid_token_id"
    assert "at `$.logit_bias`" in errors["native-vocab"]["error"]
    assert errors["native-n"]["error_code"] == "invalid_request" and "`$.n`" in errors["native-n"]["error"]
    assert all(r["finish_reason"] == "error" and r["index"] == 0 for r in errors.values())


def test_a_copy_of_a_computed_request_is_answered_with_every_choice(harness, redis_client):
    h = harness()
    line = {"id": "dup", "job_id": "j", "prompt_token_ids": PROMPT, "n": 2, "max_tokens": 4, "temperature": 1.0,
            "seed": 5, "ignore_eos": True, "logit_bias": {"70": 1.5}}
    submit(redis_client, {**line, "reply_to": "mqinfer:reply:first"})
    h.until(lambda: len(h.results()) == 2, advance_s=0.01, what="two rows")
    h.until(lambda: not pending(redis_client), advance_s=0.3, what="the entry acked")
    copy = submit(redis_client, {**line, "reply_to": "mqinfer:reply:copy"})
    h.until(lambda: copy not in pending(redis_client) and redis_client.xlen("mqinfer:reply:copy"),
            advance_s=0.3, what="the copy answered")
    [first] = [e for e in _replies(redis_client, "mqinfer:reply:first") if e.type == "final"]
    [answer] = [e for e in _replies(redis_client, "mqinfer:reply:copy") if e.type == "final"]
    assert [r.index for r in answer.rows] == [0, 1] and answer.rows == first.rows
    assert len(h.results()) == 2  # computed once
