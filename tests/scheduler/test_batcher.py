"""The dual-threshold batcher, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.batcher import DynamicBatcher
from tests.helpers import FakeClock


def make(max_batch=4, max_wait_ms=10.0):
    clock = FakeClock(1000.0)
    return DynamicBatcher(max_batch=max_batch, max_wait_ms=max_wait_ms, clock=clock), clock


def test_idle_engine_holds_items_until_a_threshold():
    batcher, clock = make(max_batch=4, max_wait_ms=10.0)
    assert batcher.poll(engine_idle=True) == []
    assert batcher.time_until_release(engine_idle=True) is None
    batcher.add("a")
    clock.advance_ms(3)
    batcher.add("b")
    assert batcher.poll(engine_idle=True) == []
    assert len(batcher) == 2
    # The wait is measured from the oldest arrival: 7 ms left.
    assert batcher.time_until_release(engine_idle=True) == pytest.approx(0.007)
    clock.advance_ms(6.9)
    assert batcher.poll(engine_idle=True) == []


def test_idle_engine_releases_at_max_wait_with_fewer_items():
    batcher, clock = make(max_batch=4, max_wait_ms=10.0)
    batcher.add("a")
    clock.advance_ms(4)
    batcher.add("b")
    clock.advance_ms(6)
    assert batcher.time_until_release(engine_idle=True) == 0.0
    assert batcher.poll(engine_idle=True) == ["a", "b"]
    assert len(batcher) == 0
    assert batcher.poll(engine_idle=True) == []


def test_idle_engine_releases_at_max_batch_without_waiting():
    batcher, clock = make(max_batch=3, max_wait_ms=1000.0)
    for item in range(7):
        batcher.add(item)
    assert batcher.time_until_release(engine_idle=True) == 0.0
    assert batcher.poll(engine_idle=True) == [0, 1, 2]
    assert batcher.poll(engine_idle=True) == [3, 4, 5]
    # One left, younger than max_wait: it waits.
    assert batcher.poll(engine_idle=True) == []
    assert len(batcher) == 1
    clock.advance_ms(1000)
    assert batcher.poll(engine_idle=True) == [6]


def test_busy_engine_releases_at_once_up_to_max_batch():
    batcher, _ = make(max_batch=2, max_wait_ms=10_000.0)
    batcher.add("a")
    assert batcher.time_until_release(engine_idle=False) == 0.0
    assert batcher.poll(engine_idle=False) == ["a"]
    for item in "bcd":
        batcher.add(item)
    assert batcher.poll(engine_idle=False) == ["b", "c"]
    assert batcher.poll(engine_idle=False) == ["d"]
    assert batcher.time_until_release(engine_idle=False) is None


def test_wait_restarts_from_the_next_oldest_item():
    batcher, clock = make(max_batch=2, max_wait_ms=10.0)
    batcher.add("a")
    batcher.add("b")
    clock.advance_ms(8)
    batcher.add("c")
    assert batcher.poll(engine_idle=True) == ["a", "b"]
    assert batcher.time_until_release(engine_idle=True) == pytest.approx(0.010)
    clock.advance_ms(10)
    assert batcher.poll(engine_idle=True) == ["c"]


@settings(max_examples=200, deadline=None)
@given(
    start=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    wait_ms=st.floats(min_value=0, max_value=60_000, allow_nan=False),
    gap_ms=st.floats(min_value=0, max_value=60_000, allow_nan=False),
)
def test_sleeping_the_advised_time_is_always_enough(start, wait_ms, gap_ms):
    # Float rounding must never make poll say "not yet" after the caller slept as advised.
    clock = FakeClock(start)
    batcher = DynamicBatcher(max_batch=10, max_wait_ms=wait_ms, clock=clock)
    batcher.add("x")
    clock.advance_ms(gap_ms)
    wait = batcher.time_until_release(engine_idle=True)
    assert wait >= 0.0
    clock.now += wait
    assert batcher.poll(engine_idle=True) == ["x"]


def test_zero_wait_releases_immediately_when_idle():
    batcher, _ = make(max_batch=8, max_wait_ms=0)
    batcher.add(1)
    assert batcher.time_until_release(engine_idle=True) == 0.0
    assert batcher.poll(engine_idle=True) == [1]


def test_drain_takes_everything():
    batcher, _ = make(max_batch=2, max_wait_ms=10.0)
    for item in range(5):
        batcher.add(item)
    assert batcher.drain() == [0, 1, 2, 3, 4]
    assert len(batcher) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": 2.0}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"max_wait_ms": math.inf}, "max_wait_ms"),
        ({"max_wait_ms": math.nan}, "max_wait_ms"),
        ({"max_wait_ms": "5"}, "max_wait_ms"),
        ({"clock": 3}, "clock"),
    ],
)
def test_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(**kwargs)
