"""Priority with aging: lower priority first, first come first served within a level, and
waiting time raising a request's effective priority (priority - waited_s / priority_aging_s) so
that nothing starves. Time is the requests' arrival times and an injected clock; no sleeping."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from tests.helpers import FakeClock

FILL = 7


def req(rid: str, arrival: float, priority: int = 0, prompt_len: int = 2, max_tokens: int = 2) -> EngineRequest:
    prompt = [100 + (hash(rid) % 1000)] + [1] * (prompt_len - 1)
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival, priority=priority)


def step(scheduler: Scheduler) -> list[str]:
    """One engine step with a model that always samples FILL; returns the scheduled ids."""
    out = scheduler.schedule()
    sampled = [FILL if sr.needs_sample else None for sr in out.scheduled]
    scheduler.update_from_output(out, sampled)
    return [sr.request.request_id for sr in out.scheduled]


def start_order(scheduler: Scheduler, max_steps: int = 10_000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return order
        for rid in step(scheduler):
            if rid not in order:
                order.append(rid)
    raise AssertionError("not done")


def one_at_a_time(aging: float | None = 60.0, **kw) -> Scheduler:
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=1,
                             priority_aging_s=aging, **kw)
    return Scheduler(config)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1e9, 1.7e9, 1.7e9 + 1e-6]), min_size=1, max_size=12),
    priority=st.integers(-3, 3),
    aging=st.sampled_from([None, 0.001, 1.0, 60.0]),
)
def test_equal_priorities_start_strictly_first_come_first_served(arrivals, priority, aging):
    scheduler = one_at_a_time(aging)
    for i, arrival in enumerate(arrivals):
        scheduler.add_request(req(f"r{i}", arrival, priority))
    expected = [f"r{i}" for i, _ in sorted(enumerate(arrivals), key=lambda x: (x[1], x[0]))]
    assert start_order(scheduler) == expected


@pytest.mark.parametrize(
    "young_arrival, first",
    [
        (9.9, "young"),  # the old one waited 9.9 s more: not yet a whole level (10 s)
        (10.0, "young"),  # exactly one level: a tie, and the lower priority number wins ties
        (10.1, "old"),  # more than one level: the old one has aged past it
    ],
)
def test_waiting_one_aging_period_is_worth_one_priority_level(young_arrival, first):
    scheduler = one_at_a_time(aging=10.0)
    scheduler.add_request(req("old", 0.0, priority=1))
    scheduler.add_request(req("young", young_arrival, priority=0))
    assert start_order(scheduler)[0] == first


def test_priority_levels_in_order_when_arrivals_are_close():
    scheduler = one_at_a_time(aging=60.0)
    specs = [("a", 0.0, 2), ("b", 1.0, 0), ("c", 2.0, 1), ("d", 3.0, 0), ("e", 4.0, -1)]
    for rid, arrival, priority in specs:
        scheduler.add_request(req(rid, arrival, priority))
    assert start_order(scheduler) == ["e", "b", "d", "c", "a"]


def run_stream(aging: float | None, max_steps: int) -> tuple[int | None, list[str]]:
    """A priority-5 request waits while a priority-0 request arrives every second (one step =
    one second) and each needs two steps: the high-priority queue only ever grows.
    Returns the step at which the low one started (None if never) and the start order."""
    clock = FakeClock(0.0)
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=1,
                             priority_aging_s=aging)
    scheduler = Scheduler(config, clock=clock)
    scheduler.add_request(req("low", 0.0, priority=5))
    order: list[str] = []
    for n in range(max_steps):
        scheduler.add_request(req(f"h{n}", clock.now, priority=0))
        for rid in step(scheduler):
            if rid not in order:
                order.append(rid)
        if "low" in order:
            return n, order
        clock.now += 1.0
    return None, order


def test_a_low_priority_request_runs_under_a_constant_high_priority_stream():
    # With 4 s per level, priority 5 at time 0 ranks like priority 0 at time 20: it goes after
    # the high-priority request that arrived at 20 (a tie, which the lower number wins) and
    # before the one that arrived at 21.
    started, order = run_stream(aging=4.0, max_steps=200)
    assert started is not None
    assert order[-2:] == ["h20", "low"]
    assert order[:-1] == [f"h{i}" for i in range(21)]
    # Without aging it starves for as long as the stream lasts.
    started, order = run_stream(aging=None, max_steps=200)
    assert started is None and len(order) == 100


def test_the_preemption_victim_is_the_last_by_effective_priority():
    # "old" has priority 1 but arrived 100 s before "new" (priority 0): with 10 s per level it
    # ranks first, so when the cache runs out "new" is the one preempted.
    config = SchedulerConfig(block_size=2, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=2,
                             priority_aging_s=10.0, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    old = req("old", 0.0, priority=1, prompt_len=4, max_tokens=6)
    new = req("new", 100.0, priority=0, prompt_len=4, max_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert step(scheduler) == ["old", "new"]  # the running order is the scheduling order
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    assert old.status is new.status is RequestStatus.FINISHED_LENGTH
    # Without aging the priority decides alone.
    config = SchedulerConfig(block_size=2, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=2,
                             priority_aging_s=None, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    old = req("old", 0.0, priority=1, prompt_len=4, max_tokens=6)
    new = req("new", 100.0, priority=0, prompt_len=4, max_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert step(scheduler) == ["new", "old"]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert new.num_preemptions == 0 and old.num_preemptions >= 1


@pytest.mark.parametrize("aging", [0, -1.0, math.inf, math.nan, True, "60"])
def test_bad_aging_is_refused(aging):
    with pytest.raises(ValueError, match="priority_aging_s must be a finite number of seconds > 0"):
        SchedulerConfig(priority_aging_s=aging)


def test_aging_defaults_to_a_minute_and_can_be_off():
    assert SchedulerConfig().priority_aging_s == 60.0
    assert SchedulerConfig(priority_aging_s=None).priority_aging_s is None
