"""Interactive arrivals during a bulk step, through a real worker (the in-process harness: the tiny
model in float32, real Parquet rows, the embedded server) and the watch on its own thread: a request
with latency targets that arrives while a bulk step runs makes the worker give the step up; a bulk
arrival does not; every row comes once and the float32 greedy outputs are those of a run with
``--no-interrupt-steps``."""

from __future__ import annotations

import time

from mqinfer.client import Producer
from mqinfer.schemas import keys
from mqinfer.schemas.lanes import NOTICE_FIELD
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.queue.arrivals import ArrivalWatch, interactive_entry
from mqinfer.workers.queue.slo import LatencyTargets
from tests.workers.harness import STREAM, WorkerHarness, submit

WAIT_S = 10.0  # how long a test waits for the watch's thread to see an entry (it takes milliseconds)


def backlog(n: int = 12) -> list[dict]:
    return [{"id": f"bulk{i}", "prompt_token_ids": [256] + [(i * 37 + j * 11) % 250 + 1 for j in range(30 + i * 5)],
             "max_tokens": 12 + i % 5, "temperature": 0, "ignore_eos": True, "tenant": "batch"} for i in range(n)]


def chat(i: int, **targets) -> dict:
    return {"id": f"chat{i}", "prompt_token_ids": [256] + [(i * 53 + j) % 250 + 1 for j in range(10 + i)],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "tenant": "chat", **targets}


class MidStep:
    """Runs ``action`` once, inside the first decoder layer of the next step that has prompt
    tokens, then waits until the worker's watch has looked at what the action added."""

    def __init__(self, harness: WorkerHarness) -> None:
        self.harness = harness
        self.action = None
        mlp = harness.worker.engine.runner.model.model.layers[0].mlp
        forward = mlp.forward

        def hooked(x, *args, **kw):
            action, self.action = self.action, None
            if action is not None and x.shape[0] > 64:
                watch = harness.worker.arrivals
                seen = watch.num_entries
                added = action()
                deadline = time.monotonic() + WAIT_S
                while watch.num_entries < seen + added and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert watch.num_entries >= seen + added, "the watch did not see the entries"
            elif action is not None:
                self.action = action  # not a prompt step: wait for one
            return forward(x, *args, **kw)

        mlp.forward = hooked


def run(redis_url, redis_client, out, *, interrupt: bool, targets: bool) -> tuple[dict, float]:
    """The backlog and three chats through tenant lanes (the chats' lane announced while a bulk
    prompt step runs, when ``interrupt``); the rows' outputs, and the steps given up."""
    redis_client.flushall()
    w = WorkerHarness(redis_url, out, max_batch=64, interrupt_steps=interrupt,
                      engine=EngineConfig(num_threads=1, dtype="float32")).start()
    producer = Producer(client=redis_client, lanes="tenant")
    mid = MidStep(w) if interrupt else None
    for obj in backlog():
        producer.submit(obj)
    chats = [chat(i, **({"slo_ttft_ms": 2000, "slo_tpot_ms": 500} if targets else {})) for i in range(3)]
    if mid is not None:
        mid.action = lambda: sum(1 for obj in chats if producer.submit(obj)) + 1  # and the lane's notice
        w.until(lambda: mid.action is None, what="a bulk prompt step")
        if targets:
            # The step the chats arrived in was given up; the next turn reads them and starts them.
            assert w.worker.engine.num_interrupted == 1
            w.turn()
            started = {item.request.id for item in w.worker.ownership.inflight.values() if item.started_at is not None}
            assert {c["id"] for c in chats} <= started
    else:
        for obj in chats:
            producer.submit(obj)
    w.until(lambda: len(w.results()) == 15, max_turns=3000, what="every row")
    rows = w.results()
    interrupted = w.metrics.registry.get_sample_value("mqinfer_steps_interrupted_total") or 0.0
    assert interrupted == w.worker.engine.num_interrupted
    w.stop()
    w.worker.redis.close()
    assert len(rows) == 15 and len({r["id"] for r in rows}) == 15  # none lost, none twice
    assert all(r["finish_reason"] == "length" for r in rows)
    return {r["id"]: r["output_token_ids"] for r in rows}, interrupted


def test_an_interactive_arrival_gives_the_bulk_step_up_and_changes_no_output(redis_url, redis_client, tmp_path):
    plain, none = run(redis_url, redis_client, tmp_path / "plain", interrupt=False, targets=False)
    assert none == 0
    mixed, interrupted = run(redis_url, redis_client, tmp_path / "mixed", interrupt=True, targets=True)
    assert interrupted == 1
    assert mixed == plain


def test_a_bulk_arrival_gives_no_step_up(redis_url, redis_client, tmp_path):
    _, interrupted = run(redis_url, redis_client, tmp_path / "bulk", interrupt=True, targets=False)
    assert interrupted == 0


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_the_watch_flags_targets_tenant_defaults_and_new_lanes_only_while_armed(redis_client):
    redis_client.flushall()
    watched: list[str] = []
    watch = ArrivalWatch(redis_client, lambda: list(watched),
                         interactive_entry(LatencyTargets({"chat": (500, 50)}), max_entry_bytes=1 << 20,
                                           lane_key=lambda lane: keys.request_stream(f"requests:{lane}")))
    try:
        # Disarmed: nothing is looked at.
        watched[:] = [keys.request_stream("requests:lane-idle")]
        redis_client.xadd(watched[0], {"json": '{"id": "a", "prompt": "x", "slo_tpot_ms": 50}', "v": "1"})
        time.sleep(0.2)
        assert watch.num_entries == 0 and not watch.arrived.is_set()
        cases = [
            ({"json": '{"id": "b", "prompt": "x", "tenant": "batch"}', "v": "1"}, False),
            ({"json": '{"id": "c", "prompt": "x", "slo_ttft_ms": 300}', "v": "1"}, True),
            ({"json": "not json", "v": "1"}, False),
            ({"json": '{"id": "d", "prompt": "x", "tenant": "chat"}', "v": "1"}, True),
        ]
        for n, (fields, interactive) in enumerate(cases):
            # Each case on a stream of its own (a lane's), so that no case sees another's entry.
            watched[:] = [keys.request_stream(f"requests:lane{n}")]
            watch.arm()
            seen = watch.num_entries
            redis_client.xadd(watched[0], fields)
            wait_for(lambda: watch.num_entries > seen, f"the watch looking at {fields}")
            assert watch.arrived.is_set() is interactive, fields
            assert watch.num_entries == seen + 1
            assert watch.flagged == ({watched[0]} if interactive else set())
            watch.disarm()
        # A notice of a new lane adds the lane to the watch: the request that follows it there is seen.
        watched[:] = [STREAM]
        watch.arm()
        seen = watch.num_entries
        redis_client.xadd(STREAM, {NOTICE_FIELD: "fresh"})
        new_lane = keys.request_stream("requests:fresh")
        redis_client.xadd(new_lane, {"json": '{"id": "e", "prompt": "x", "slo_tpot_ms": 40}', "v": "1"})
        wait_for(lambda: watch.num_entries >= seen + 2, "the watch following the notice")
        assert watch.arrived.is_set() and watch.flagged == {new_lane}
        watch.disarm()
    finally:
        watch.close()
    assert not watch._thread.is_alive()  # closed: its thread ended


def test_a_watch_does_not_flag_again_what_an_earlier_watch_looked_at(redis_client):
    """The request whose arrival gave one step up is in the next step: that step's watch, which
    starts a margin before its moment, must not see the same entry and give its own step up. A
    margin of a minute puts the first entry inside every later watch's start."""
    redis_client.flushall()
    stream = keys.request_stream("requests:lane-again")
    watch = ArrivalWatch(redis_client, lambda: [stream],
                         interactive_entry(LatencyTargets({}), max_entry_bytes=1 << 20,
                                           lane_key=lambda lane: keys.request_stream(f"requests:{lane}")),
                         margin_ms=60_000)
    try:
        watch.arm()
        redis_client.xadd(stream, {"json": '{"id": "a", "prompt": "x", "slo_ttft_ms": 300}', "v": "1"})
        wait_for(lambda: watch.num_entries == 1, "the first watch looking at the interactive entry")
        assert watch.arrived.is_set() and watch.disarm() == [stream]
        # The next watch: only a bulk entry arrives during it.
        watch.arm()
        redis_client.xadd(stream, {"json": '{"id": "b", "prompt": "x"}', "v": "1"})
        wait_for(lambda: watch.num_entries >= 2, "the second watch looking at the bulk entry")
        time.sleep(0.2)  # and at nothing else
        assert watch.num_entries == 2
        assert not watch.arrived.is_set() and watch.disarm() == []
        # An interactive entry in a later watch is flagged as before.
        watch.arm()
        redis_client.xadd(stream, {"json": '{"id": "c", "prompt": "x", "slo_tpot_ms": 50}', "v": "1"})
        wait_for(lambda: watch.num_entries == 3, "the third watch looking at the interactive entry")
        assert watch.arrived.is_set() and watch.disarm() == [stream]
    finally:
        watch.close()
