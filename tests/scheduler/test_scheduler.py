"""The continuous-batching scheduler, driven by a fake model over a shadow KV cache.

The fake model does what the real runner does with the scheduler's output, minus the maths:
for each scheduled request it reads the KV of every earlier position, writes the chunk's KV
into the slots given by ``block_ids`` and samples a token when ``needs_sample``. The shadow
stores, per slot, the token prefix its KV was computed from, so any read of wrong, stale or
overwritten KV (a bad block table, a prefix-cache hit on the wrong block, a block reused while
still held) fails the test.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from tests.helpers import FakeClock, ShadowKV

EOS = 0
FILL = 7  # the fake model's usual token: never EOS


class FakeModel:
    def __init__(self, scheduler: Scheduler, sample: Callable[[EngineRequest], int] | None = None) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.sample = sample or (lambda request: FILL)
        self.kv = ShadowKV(self.block_size)

    def run(self, out: SchedulerOutput) -> list[int | None]:
        sampled: list[int | None] = []
        for sr in out.scheduled:
            request = sr.request
            start = request.num_computed_tokens
            assert start + sr.num_new_tokens <= request.num_tokens
            assert len(request.block_ids) * self.block_size >= start + sr.num_new_tokens
            self.kv.check_reads(request, start)
            self.kv.write(request, start, sr.num_new_tokens)
            sampled.append(self.sample(request) if sr.needs_sample else None)
        return sampled


class Driver:
    """schedule → model → update, recording every step."""

    def __init__(self, config: SchedulerConfig, sample=None, clock=None) -> None:
        self.clock = clock or FakeClock(1_700_000_000.0)
        self.scheduler = Scheduler(config, clock=self.clock)
        self.model = FakeModel(self.scheduler, sample)
        self.steps: list[dict[str, int]] = []  # request id -> tokens scheduled, per step
        self.preempted_at: list[list[str]] = []
        self.finished: list[EngineRequest] = []

    def add(self, request: EngineRequest) -> EngineRequest:
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        scheduler = self.scheduler
        running_before = {r.request_id for r in scheduler._running}
        out = scheduler.schedule()
        config = scheduler.config
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(out.scheduled) <= config.max_num_seqs
        assert scheduler.num_running <= config.max_num_seqs
        assert all(sr.num_new_tokens >= 1 for sr in out.scheduled)
        scheduled_ids = [sr.request.request_id for sr in out.scheduled]
        assert len(set(scheduled_ids)) == len(scheduled_ids)
        # Every request that was running and is still running got tokens: none stalls.
        ended = {r.request_id for r in out.preempted} | {r.request_id for r in out.finished}
        assert running_before - ended <= set(scheduled_ids)
        self.steps.append({sr.request.request_id: sr.num_new_tokens for sr in out.scheduled})
        self.preempted_at.append([r.request_id for r in out.preempted])
        self.finished.extend(out.finished)
        finished = scheduler.update_from_output(out, self.model.run(out))
        self.finished.extend(finished)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError(f"not done after {max_steps} steps")
        kv = self.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0


_fresh_tokens = itertools.count(1000)


def req(rid, prompt, arrival=0.0, priority=0, deadline=None, max_model_len=2048, **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 4)
    if isinstance(prompt, int):  # fresh tokens: shares no prefix with any other request
        prompt = [next(_fresh_tokens) for _ in range(prompt)]
    return EngineRequest(
        rid, list(prompt), SamplingParams(**sampling), eos_token_ids=frozenset({EOS}),
        arrival_time=arrival, priority=priority, deadline=deadline, max_model_len=max_model_len,
    )


# -- many random requests ---------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 8),
    num_kv_blocks=st.integers(4, 40),
    max_num_seqs=st.integers(1, 8),
    extra_budget=st.integers(0, 40),
    caching=st.booleans(),
    requests=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 2), st.integers(0, 3)),
        min_size=1, max_size=25,
    ),
)
def test_random_requests_all_finish_within_limits(block_size, num_kv_blocks, max_num_seqs, extra_budget,
                                                  caching, requests):
    config = SchedulerConfig(
        block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget, max_model_len=80, enable_prefix_caching=caching,
    )
    driver = Driver(config)
    capacity = config.num_cache_tokens
    made = []
    for i, (prompt_len, max_tokens, priority, shared) in enumerate(requests):
        # Some prompts share a prefix, so prefix-cache hits happen under preemption too.
        prompt = [1 + shared] * min(prompt_len, 10) + [200 + i] * max(0, prompt_len - 10)
        made.append(driver.add(req(f"r{i}", prompt, arrival=float(i), priority=priority,
                                   max_tokens=max_tokens, max_model_len=80)))
    driver.run()

    assert {r.request_id for r in driver.finished} == {r.request_id for r in made}
    assert len(driver.finished) == len(made)
    for r in made:
        if r.num_prompt_tokens > capacity:
            assert r.status is RequestStatus.FINISHED_ERROR and r.error_code == "kv_cache_too_small"
            assert r.output_token_ids == []
            continue
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [FILL] * r.num_output_tokens
        full = min(r.sampling.max_tokens, 80 - r.num_prompt_tokens)
        if r.num_prompt_tokens + full - 1 <= capacity:
            assert r.num_output_tokens == full
        else:  # it outgrew the whole cache
            assert 1 <= r.num_output_tokens < full
        assert r.num_cached_tokens >= 0 and r.num_cached_tokens % block_size == 0
        if not caching:
            assert r.num_cached_tokens == 0
        assert r.block_ids == []
    assert driver.scheduler.num_preemptions_total == sum(r.num_preemptions for r in made)
    # Visible with --hypothesis-show-statistics: which paths the examples took.
    event(f"preempted: {driver.scheduler.num_preemptions_total > 0}")
    event(f"prefix hit: {driver.scheduler.prefix_cache_hits > 0}")
    event(f"rejected: {any(r.error_code for r in made)}")


# -- chunked prefill next to decodes ----------------------------------------------------------

def test_decodes_run_every_step_while_a_long_prompt_is_chunked():
    config = SchedulerConfig(block_size=4, num_kv_blocks=200, max_num_batched_tokens=16, max_num_seqs=4)
    driver = Driver(config)
    short = driver.add(req("short", 3, arrival=0.0, max_tokens=20))
    driver.step()  # short's prompt
    # A long prompt with a higher priority arrives while short decodes.
    long = driver.add(req("long", 100, arrival=1.0, priority=-1, max_tokens=2))
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        driver.step()
        step = driver.steps[-1]
        assert step["short"] == 1  # the decode never waits
        chunks.append(step["long"])
        assert sum(step.values()) <= 16
    assert chunks == [15] * 6 + [10]
    assert short.num_output_tokens == 1 + len(chunks)
    driver.run()
    assert short.num_output_tokens == 20 and long.num_output_tokens == 2


def test_a_running_prefill_leaves_one_token_to_each_request_after_it():
    config = SchedulerConfig(block_size=4, num_kv_blocks=200, max_num_batched_tokens=8, max_num_seqs=4)
    driver = Driver(config)
    driver.add(req("b", 2, arrival=1.0, max_tokens=30))
    driver.add(req("c", 2, arrival=2.0, max_tokens=30))
    driver.step()
    # "a" goes first in the running order (higher priority), but b and c still decode.
    a = driver.add(req("a", 40, arrival=3.0, priority=-1, max_tokens=3))
    driver.step()
    assert driver.steps[-1] == {"b": 1, "c": 1, "a": 6}
    for _ in range(5):
        driver.step()
        assert driver.steps[-1] == {"a": 6, "b": 1, "c": 1}
    assert a.num_computed_tokens == 36
    driver.step()
    assert driver.steps[-1] == {"a": 4, "b": 1, "c": 1}
    driver.run()


# -- preemption -------------------------------------------------------------------------------

def test_small_cache_finishes_everything_by_preemption_without_thrashing():
    # 10 requests of up to 7 blocks each, in a cache of 16 blocks.
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=8)
    driver = Driver(config)
    made = [driver.add(req(f"r{i}", 6 + 2 * i, arrival=float(i), max_tokens=14)) for i in range(10)]
    driver.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 14 for r in made)
    total = driver.scheduler.num_preemptions_total
    assert total > 0, "the cache was meant to be too small for all requests at once"
    assert total == sum(r.num_preemptions for r in made)
    # The oldest request is never the victim; nobody is preempted over and over.
    assert made[0].num_preemptions == 0
    assert max(r.num_preemptions for r in made) <= 2
    assert total <= len(made)
    # Re-admissions find their own blocks in the prefix cache, but num_cached_tokens is the
    # first admission's (these prompts share nothing).
    assert all(r.num_cached_tokens == 0 for r in made)
    # A preempted request recomputed what it lost.
    for r in made:
        if r.num_preemptions:
            assert r.num_recompute_tokens > 0
        else:
            assert r.num_recompute_tokens == 0


def test_admission_keeps_a_free_block_per_running_request():
    # 4 blocks of 2 slots. "a" will grow to 3 blocks. Admitting "b" (2 blocks, growing to 3)
    # into the 2 free blocks would leave "a" nowhere to grow and force a preemption two steps
    # later; keeping one block free per running request makes "b" wait for "a" instead.
    config = SchedulerConfig(block_size=2, num_kv_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    driver = Driver(config)
    a = driver.add(req("a", 2, arrival=0.0, max_tokens=5))
    driver.step()
    b = driver.add(req("b", 3, arrival=1.0, max_tokens=3))
    driver.run()
    assert driver.scheduler.num_preemptions_total == 0
    first_b = next(i for i, s in enumerate(driver.steps) if "b" in s)
    last_a = max(i for i, s in enumerate(driver.steps) if "a" in s)
    assert first_b > last_a
    assert a.num_output_tokens == 5 and b.num_output_tokens == 3


def test_preemption_takes_the_lowest_priority_then_latest_arrival():
    config = SchedulerConfig(block_size=2, num_kv_blocks=9, max_num_batched_tokens=16, max_num_seqs=4,
                             enable_prefix_caching=False)
    driver = Driver(config)
    # "low" arrived first but has the lowest priority (the largest number).
    low = driver.add(req("low", 4, arrival=0.0, priority=5, max_tokens=10))
    mid_early = driver.add(req("mid_early", 4, arrival=1.0, priority=1, max_tokens=10))
    mid_late = driver.add(req("mid_late", 4, arrival=2.0, priority=1, max_tokens=10))
    driver.step()
    assert set(driver.steps[-1]) == {"mid_early", "mid_late", "low"}
    victims = []
    for _ in range(40):
        if not driver.scheduler.has_unfinished_requests():
            break
        driver.step()
        victims.extend(driver.preempted_at[-1])
    assert victims[0] == "low"
    assert "mid_early" not in victims
    if "mid_late" in victims:
        assert victims.index("mid_late") > 0
    driver.run()
    assert all(r.num_output_tokens == 10 for r in (low, mid_early, mid_late))
    assert low.num_preemptions >= 1


def test_preempted_request_keeps_its_place_before_later_arrivals():
    config = SchedulerConfig(block_size=2, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2,
                             enable_prefix_caching=False)
    driver = Driver(config)
    a = driver.add(req("a", 4, arrival=0.0, max_tokens=8))
    b = driver.add(req("b", 4, arrival=1.0, max_tokens=8))
    while not b.num_preemptions:
        driver.step()
    assert b.status is RequestStatus.PREEMPTED
    c = driver.add(req("c", 2, arrival=2.0, max_tokens=2))
    order = []
    while driver.scheduler.has_unfinished_requests():
        driver.step()
        for rid in driver.steps[-1]:
            if rid not in order:
                order.append(rid)
    assert order.index("b") < order.index("c")
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_lone_request_that_outgrows_the_cache_ends_with_length():
    config = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=2)
    driver = Driver(config)
    r = driver.add(req("r", 10, max_tokens=100))
    driver.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    # 12 slots: 10 prompt tokens and 2 generated tokens have KV; the third token has none.
    assert r.num_output_tokens == 3
    assert r.num_preemptions == 0


def test_prompt_that_can_never_fit_is_an_error_at_admission():
    config = SchedulerConfig(block_size=4, num_kv_blocks=3, max_num_batched_tokens=16, max_num_seqs=2)
    driver = Driver(config)
    big = driver.add(req("big", 13))
    ok = driver.add(req("ok", 12, max_tokens=1))
    assert driver.scheduler.has_unfinished_requests()
    assert driver.scheduler.get_request("big") is None
    out = driver.step()
    assert out.finished == [big]
    assert big.status is RequestStatus.FINISHED_ERROR and big.status.finish_reason == "error"
    assert big.error_code == "kv_cache_too_small"
    assert "13 tokens" in big.error and "4 KV blocks" in big.error and "3 blocks (12 tokens)" in big.error
    driver.run()
    assert ok.status is RequestStatus.FINISHED_LENGTH and ok.num_output_tokens == 1


def test_prompt_longer_than_the_context_is_an_error():
    config = SchedulerConfig(max_model_len=32)
    driver = Driver(config)
    r = driver.add(req("r", 33, max_model_len=4096))
    assert r.max_model_len == 32
    out = driver.step()
    assert out.finished == [r]
    assert r.error_code == "prompt_too_long" and "33 tokens" in r.error and "32" in r.error


# -- deadlines, priority, seqs ----------------------------------------------------------------

def test_expired_requests_end_at_the_next_schedule_keeping_their_output():
    clock = FakeClock(1000.0)
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=1)
    driver = Driver(config, clock=clock)
    running = driver.add(req("running", 5, deadline=1010.0, max_tokens=50))
    waiting = driver.add(req("waiting", 5, arrival=1.0, deadline=1005.0, max_tokens=5))
    free = driver.add(req("free", 5, arrival=2.0, max_tokens=3))
    for _ in range(3):
        driver.step()
    assert running.num_output_tokens == 3
    clock.now = 1005.0
    out = driver.step()
    assert out.finished == [waiting]
    assert waiting.status is RequestStatus.FINISHED_EXPIRED and waiting.output_token_ids == []
    assert driver.scheduler.num_waiting == 1
    clock.now = 1010.5
    out = driver.step()
    assert out.finished == [running]
    assert running.status.finish_reason == "expired"
    assert running.output_token_ids == [FILL] * 4
    assert running.block_ids == []
    assert [sr.request for sr in out.scheduled] == [free]
    driver.run()
    assert free.num_output_tokens == 3


def test_waiting_requests_start_in_priority_then_arrival_order():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=1)
    driver = Driver(config)
    specs = [("a", 0.0, 2), ("b", 1.0, 0), ("c", 2.0, 1), ("d", 3.0, 0), ("e", 4.0, -1)]
    for rid, arrival, priority in specs:
        driver.add(req(rid, 3, arrival=arrival, priority=priority, max_tokens=2))
    driver.run()
    assert [r.request_id for r in driver.finished] == ["e", "b", "d", "c", "a"]


def test_max_num_seqs_caps_running_requests():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=3)
    driver = Driver(config)
    for i in range(7):
        driver.add(req(f"r{i}", 2, arrival=float(i), max_tokens=5))
    driver.step()
    assert driver.scheduler.num_running == 3 and driver.scheduler.num_waiting == 4
    driver.run()
    assert max(len(s) for s in driver.steps) == 3


# -- prefix caching ---------------------------------------------------------------------------

def test_prefix_cache_hit_sets_num_cached_tokens_and_shares_blocks():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    driver = Driver(config)
    system = list(range(10, 22))  # three full blocks
    a = driver.add(req("a", system + [1, 2], max_tokens=6))
    driver.step()
    driver.step()  # a's prompt blocks are cached once computed
    b = driver.add(req("b", system + [3], arrival=1.0, max_tokens=6))
    driver.step()
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 12
    assert driver.steps[-1]["b"] == 1  # only the uncached token is computed
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.block_ids[3] != a.block_ids[3]
    assert driver.scheduler.prefix_cache_queries == 14 + 13
    assert driver.scheduler.prefix_cache_hits == 12
    driver.run()
    assert a.num_output_tokens == b.num_output_tokens == 6


def test_requests_sharing_an_uncomputed_prefix_wait_for_the_first_to_cache_it():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    driver = Driver(config)
    system = list(range(10, 22))  # three full blocks, cached by nobody yet
    a = driver.add(req("a", system + [1], max_tokens=3))
    b = driver.add(req("b", system + [2], arrival=1.0, max_tokens=3))
    other = driver.add(req("other", 9, arrival=2.0, max_tokens=3))
    driver.step()
    # b would compute the same three blocks as a in the same step: it is held, and a later
    # arrival with a prefix of its own goes ahead of it.
    assert set(driver.steps[-1]) == {"a", "other"}
    assert b.status is RequestStatus.WAITING
    driver.step()
    # a's blocks are cached now: b computes only its last token.
    assert driver.steps[-1]["b"] == 1 and b.num_cached_tokens == 12
    assert b.block_ids[:3] == a.block_ids[:3]
    driver.run()
    assert a.num_output_tokens == b.num_output_tokens == other.num_output_tokens == 3


def test_a_held_request_waits_only_while_its_prefix_is_being_computed():
    """A prompt chunked over two steps: its sibling is not admitted beside the second chunk
    (it would compute the block that chunk computes), and is admitted in the step right after,
    with the whole shared prefix cached."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    driver = Driver(config)
    system = list(range(10, 34))  # six full blocks
    a = driver.add(req("a", system + [1], max_tokens=2))
    b = driver.add(req("b", system + [2], arrival=1.0, max_tokens=2))
    admitted_at = None
    for step in range(1, 6):
        driver.step()
        if admitted_at is None and "b" in driver.steps[-1]:
            admitted_at = step
    # a computes 16 then 9 prompt tokens in steps 1-2; the second step has budget left for b,
    # which would then have found only a's first four blocks cached.
    assert admitted_at == 3
    assert b.num_cached_tokens == 24
    driver.run()
    assert a.num_output_tokens == b.num_output_tokens == 2


def test_a_held_request_computes_the_prefix_itself_when_the_one_computing_it_ends():
    """The hold lasts only while another request computes the block: cancel that one in the
    middle of its prompt and the held request is admitted in the very next step."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)
    driver = Driver(config)
    system = list(range(10, 34))  # six full blocks, three steps of a's prompt at 8 tokens a step
    a = driver.add(req("a", system + [1], max_tokens=2))
    b = driver.add(req("b", system + [2], arrival=1.0, max_tokens=2))
    driver.step()
    assert driver.steps[-1] == {"a": 8} and b.status is RequestStatus.WAITING
    driver.scheduler.finish_requests(["a"], RequestStatus.FINISHED_CANCELLED)
    driver.step()
    # a's two computed blocks were cached when its blocks were freed: b starts after them.
    assert driver.steps[-1] == {"b": 8} and b.num_cached_tokens == 8
    driver.run()
    assert b.num_output_tokens == 2


def test_prefix_caching_off():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    driver = Driver(config)
    a = driver.add(req("a", list(range(12)) + [1], max_tokens=2))
    driver.run()
    b = driver.add(req("b", list(range(12)) + [2], max_tokens=2))
    driver.run()
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert driver.scheduler.prefix_cache_hits == 0


# -- stop rules -------------------------------------------------------------------------------

def scripted(tokens_by_request: dict[str, list[int]]):
    """A model that emits a fixed token sequence per request."""
    return lambda request: tokens_by_request[request.request_id][request.num_output_tokens]


def run_one(tokens: list[int], **sampling) -> EngineRequest:
    config = SchedulerConfig(block_size=4, num_kv_blocks=64)
    driver = Driver(config, sample=scripted({"r": tokens}))
    max_model_len = sampling.pop("max_model_len", 2048)
    r = driver.add(req("r", [5, 6, 7], max_model_len=max_model_len, **sampling))
    driver.run()
    return r


@pytest.mark.parametrize(
    "tokens, sampling, status, output",
    [
        ([3, EOS, 4, 4], {"max_tokens": 4}, RequestStatus.FINISHED_STOPPED, [3, EOS]),
        ([EOS, EOS, EOS, 4], {"max_tokens": 4, "min_tokens": 3}, RequestStatus.FINISHED_STOPPED, [EOS, EOS, EOS]),
        ([EOS, 4, 4, 4, 4], {"max_tokens": 5, "min_tokens": 2}, RequestStatus.FINISHED_LENGTH, [EOS, 4, 4, 4, 4]),
        ([EOS, 4, EOS], {"max_tokens": 3, "ignore_eos": True}, RequestStatus.FINISHED_LENGTH, [EOS, 4, EOS]),
        ([3, 9, 4], {"max_tokens": 3, "stop_token_ids": (9,)}, RequestStatus.FINISHED_STOPPED, [3, 9]),
        ([9, 9, 4], {"max_tokens": 3, "stop_token_ids": (9,), "ignore_eos": True, "min_tokens": 2},
         RequestStatus.FINISHED_STOPPED, [9, 9]),
        ([3, 4, EOS], {"max_tokens": 3}, RequestStatus.FINISHED_STOPPED, [3, 4, EOS]),
        ([3, 4, 5, 6], {"max_tokens": 4}, RequestStatus.FINISHED_LENGTH, [3, 4, 5, 6]),
        ([3, 4, 5, 6], {"max_tokens": 4, "max_model_len": 5}, RequestStatus.FINISHED_LENGTH, [3, 4]),
    ],
)
def test_stop_rules(tokens, sampling, status, output):
    r = run_one(tokens, **sampling)
    assert r.status is status
    assert r.output_token_ids == output


def test_prompt_as_long_as_the_context_generates_one_token():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_model_len=8)
    driver = Driver(config)
    r = driver.add(req("r", 8, max_tokens=10))
    driver.run()
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 1


# -- from outside -----------------------------------------------------------------------------

def test_finish_requests_from_outside():
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=1)
    driver = Driver(config)
    a = driver.add(req("a", 6, max_tokens=10))
    b = driver.add(req("b", 6, arrival=1.0, max_tokens=10))
    driver.step()
    assert a.block_ids
    ended = driver.scheduler.finish_requests(["a", "nope", "b"], RequestStatus.FINISHED_CANCELLED)
    assert ended == [a, b]
    assert a.status.finish_reason == "cancelled" and a.block_ids == []
    assert a.output_token_ids == [FILL]
    assert driver.scheduler.get_request("a") is None
    assert not driver.scheduler.has_unfinished_requests()
    assert driver.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == []
    kv = driver.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks

    c = driver.add(req("c", 3))
    [err] = driver.scheduler.finish_requests(["c"], RequestStatus.FINISHED_ERROR, "model_error", "NaN logits")
    assert (err.error_code, err.error) == ("model_error", "NaN logits")
    with pytest.raises(ValueError, match="finished status"):
        driver.scheduler.finish_requests(["c"], RequestStatus.RUNNING)


def test_request_cancelled_while_its_step_runs_is_skipped_by_the_update():
    driver = Driver(SchedulerConfig(block_size=4, num_kv_blocks=16))
    a = driver.add(req("a", 5, max_tokens=10))
    out = driver.scheduler.schedule()
    sampled = driver.model.run(out)
    driver.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert driver.scheduler.update_from_output(out, sampled) == []
    assert a.num_computed_tokens == 0 and a.output_token_ids == []


def test_bad_input_is_refused():
    driver = Driver(SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=4, max_num_seqs=1))
    a = driver.add(req("a", 6))
    with pytest.raises(ValueError, match="already in the scheduler"):
        driver.scheduler.add_request(req("a", 3))
    used = req("used", 3)
    used.num_computed_tokens = 2
    with pytest.raises(ValueError, match="must be new"):
        driver.scheduler.add_request(used)
    out = driver.scheduler.schedule()
    assert [sr.num_new_tokens for sr in out.scheduled] == [4]
    with pytest.raises(ValueError, match="got 0 sampled tokens for 1"):
        driver.scheduler.update_from_output(out, [])
    with pytest.raises(ValueError, match="prompt chunk samples nothing"):
        driver.scheduler.update_from_output(out, [5])
    assert a.num_computed_tokens == 0  # nothing was applied
    driver.scheduler.update_from_output(out, [None])
    out = driver.scheduler.schedule()
    with pytest.raises(ValueError, match="needs a sampled token"):
        driver.scheduler.update_from_output(out, [None])
