"""The adaptive dual threshold (``max_wait_ms="auto"``), driven by an injected clock (no sleeping)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.batcher import AdaptiveWait, DynamicBatcher
from tests.helpers import FakeClock


def make(max_batch=64, **adaptive_kwargs):
    clock = FakeClock(5000.0)
    adaptive = AdaptiveWait(**adaptive_kwargs) if adaptive_kwargs else None
    return DynamicBatcher(max_batch=max_batch, max_wait_ms="auto", clock=clock, adaptive=adaptive), clock


def feed(batcher, clock, rate: float, seconds: float, release: bool = True) -> None:
    """Items arriving evenly at ``rate`` per second for ``seconds``, released as they come."""
    n = int(rate * seconds)
    for i in range(n):
        clock.advance(1.0 / rate)
        batcher.add(("warm", i))
        if release:
            batcher.poll(engine_idle=False)


def test_before_any_step_is_seen_it_does_not_hold_items():
    batcher, clock = make()
    batcher.add("a")
    assert batcher.wait_s() == 0.0
    assert batcher.poll(engine_idle=True) == ["a"]


def test_light_load_gives_a_short_wait():
    batcher, clock = make()
    batcher.observe_step(0.020)
    feed(batcher, clock, rate=2.0, seconds=1.0)  # 2 requests a second, 20 ms steps
    # Expected arrivals in one step: 0.04; the wait is step * 0.04 = 0.8 ms.
    assert batcher.wait_s() == pytest.approx(0.0008)
    stats = batcher.stats()
    assert stats.arrival_rate == pytest.approx(2.0) and stats.step_time_s == pytest.approx(0.020)
    clock.advance(0.5)
    batcher.add("x")
    assert batcher.poll(engine_idle=True) == []
    clock.advance(0.001)
    assert batcher.poll(engine_idle=True) == ["x"]


def test_heavy_load_waits_about_one_step_for_a_fuller_batch():
    batcher, clock = make(max_batch=64)
    batcher.observe_step(0.020)
    feed(batcher, clock, rate=400.0, seconds=1.0)  # 8 arrivals per 20 ms step
    assert batcher.stats().arrival_rate == pytest.approx(400.0, rel=0.01)
    assert batcher.wait_s() == pytest.approx(0.020)
    # A burst at 400/s into an idle engine: held until a step's worth of time has passed.
    released: list = []
    for i in range(10):
        batcher.add(i)
        released += batcher.poll(engine_idle=True)
        if released:
            break
        clock.advance(0.0025)
    assert released == list(range(9))  # 9 items gathered over 20 ms instead of 1


def test_wait_is_bounded_above_and_below():
    batcher, clock = make(min_wait_ms=2.0, max_wait_ms=30.0)
    batcher.observe_step(0.500)  # slow steps: one step would be 500 ms
    feed(batcher, clock, rate=100.0, seconds=1.0)
    assert batcher.wait_s() == pytest.approx(0.030)
    light, clock2 = make(min_wait_ms=2.0, max_wait_ms=30.0)
    light.observe_step(0.001)
    feed(light, clock2, rate=1.0, seconds=2.0)
    assert light.wait_s() == pytest.approx(0.002)


def test_size_threshold_still_releases_a_full_batch_at_once():
    batcher, clock = make(max_batch=4)
    batcher.observe_step(0.050)
    feed(batcher, clock, rate=200.0, seconds=1.0)
    assert batcher.wait_s() == pytest.approx(0.050)
    for i in range(5):
        batcher.add(i)
    assert batcher.time_until_release(engine_idle=True) == 0.0
    assert batcher.poll(engine_idle=True) == [0, 1, 2, 3]


def test_rate_decays_when_arrivals_stop_and_the_wait_shrinks_with_it():
    batcher, clock = make()
    batcher.observe_step(0.020)
    feed(batcher, clock, rate=400.0, seconds=1.0)
    heavy = batcher.wait_s()
    clock.advance(0.9)  # the window still holds the last 0.1 s: 40 arrivals -> 40/s
    assert batcher.stats().arrival_rate == pytest.approx(40.0, rel=0.05)
    mid = batcher.wait_s()
    clock.advance(0.2)  # nothing left in the window
    assert batcher.stats().arrival_rate == 0.0
    assert heavy > mid > batcher.wait_s() == 0.0


def test_step_time_is_a_moving_average_that_ignores_bogus_values():
    wait = AdaptiveWait(step_alpha=0.5)
    assert wait.step_time_s is None
    wait.on_step(0.010)
    wait.on_step(0.030)
    assert wait.step_time_s == pytest.approx(0.020)
    wait.on_step(-1.0)
    wait.on_step(float("nan"))
    assert wait.step_time_s == pytest.approx(0.020)


def _simulate(batcher, clock, rate: float, step_s: float, steps_per_request: int, n: int,
              seed: int) -> tuple[float, float]:
    """Poisson arrivals into a continuous-batching engine: every running request advances one token
    per step of ``step_s``, and is done after ``steps_per_request`` steps; released items join at
    the next step. Returns (mean time items spent in the batcher, mean size of the batches released
    to an idle engine)."""
    rng = random.Random(seed)
    t = clock.now
    arrivals = []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    waits, idle_batches = [], []
    added: dict[int, float] = {}
    running: list[int] = []  # steps left per running request
    next_step = None  # when the running step ends
    i = 0
    while i < n or len(batcher) or running:
        idle = not running
        advised = batcher.time_until_release(engine_idle=idle)
        candidates = [arrivals[i] if i < n else float("inf")]
        if next_step is not None:
            candidates.append(next_step)
        if advised is not None and idle:
            candidates.append(clock.now + advised)
        clock.now = max(clock.now, min(candidates))
        if next_step is not None and clock.now >= next_step:
            running = [left - 1 for left in running if left > 1]
            next_step = None
            batcher.observe_step(step_s)
        while i < n and arrivals[i] <= clock.now:
            batcher.add(i)
            added[i] = clock.now
            i += 1
        idle = not running
        if next_step is None:  # between steps: admit what is due, start the next step
            batch = batcher.poll(engine_idle=idle)
            if batch:
                waits += [clock.now - added[item] for item in batch]
                if idle:
                    idle_batches.append(len(batch))
                running += [steps_per_request] * len(batch)
            if running:
                next_step = clock.now + step_s
    return sum(waits) / len(waits), sum(idle_batches) / max(1, len(idle_batches))


def test_against_fixed_thresholds_in_a_simulated_engine():
    step = 0.020
    # Light load (2 req/s): a fixed 10 ms wait holds nearly every item the full 10 ms; auto does not
    # (both include the time items arriving during a step wait for it to end).
    c1 = FakeClock(5000.0)
    fixed_wait, _ = _simulate(DynamicBatcher(max_batch=64, max_wait_ms=10.0, clock=c1), c1, rate=2.0,
                              step_s=step, steps_per_request=4, n=200, seed=1)
    auto, c2 = make()
    auto_wait, _ = _simulate(auto, c2, rate=2.0, step_s=step, steps_per_request=4, n=200, seed=1)
    assert fixed_wait > 0.010
    assert auto_wait < fixed_wait / 3
    # Heavier load (60 req/s, one arrival per step on average, the engine idle between bursts):
    # auto gathers fuller batches for the idle engine than releasing at once does.
    c0 = FakeClock(5000.0)
    _, zero_batch = _simulate(DynamicBatcher(max_batch=64, max_wait_ms=0.0, clock=c0), c0, rate=60.0,
                              step_s=step, steps_per_request=1, n=3000, seed=2)
    auto2, c3 = make()
    _, auto_batch = _simulate(auto2, c3, rate=60.0, step_s=step, steps_per_request=1, n=3000, seed=2)
    assert auto_batch > 1.3 * zero_batch


@settings(max_examples=150, deadline=None)
@given(
    step_ms=st.floats(min_value=0.0, max_value=2000.0, allow_nan=False),
    gaps_ms=st.lists(st.floats(min_value=0.0, max_value=300.0, allow_nan=False), min_size=1, max_size=40),
    later_ms=st.floats(min_value=0.0, max_value=5000.0, allow_nan=False),
)
def test_sleeping_the_advised_time_is_always_enough(step_ms, gaps_ms, later_ms):
    batcher, clock = make(max_batch=1000)
    batcher.observe_step(step_ms / 1000.0)
    for gap in gaps_ms:
        clock.advance(gap / 1000.0)
        batcher.add("x")
    clock.advance(later_ms / 1000.0)
    wait = batcher.time_until_release(engine_idle=True)
    assert 0.0 <= wait <= 0.050 + 1e-9
    clock.advance(wait)
    assert len(batcher.poll(engine_idle=True)) == len(gaps_ms)


def test_remove_takes_one_waiting_item_out():
    batcher = DynamicBatcher(max_batch=8, max_wait_ms=10.0, clock=FakeClock(5000.0))
    for item in "abc":
        batcher.add(item)
    assert batcher.remove("b") is True
    assert batcher.remove("zz") is False
    assert batcher.drain() == ["a", "c"]


def test_fixed_mode_reports_its_wait_and_ignores_steps():
    batcher = DynamicBatcher(max_batch=8, max_wait_ms=7.5, clock=FakeClock(5000.0))
    batcher.observe_step(1.0)
    assert batcher.wait_s() == pytest.approx(0.0075)
    assert batcher.stats().wait_s == pytest.approx(0.0075) and batcher.stats().step_time_s is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_wait_ms": "fast"}, "max_wait_ms"),
        ({"max_wait_ms": 5.0, "adaptive": AdaptiveWait()}, "adaptive"),
    ],
)
def test_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_wait_ms": -1}, "min_wait_ms"),
        ({"min_wait_ms": 10, "max_wait_ms": 5}, "max_wait_ms"),
        ({"window_s": 0}, "window_s"),
        ({"step_alpha": 0}, "step_alpha"),
    ],
)
def test_adaptive_bounds_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveWait(**kwargs)


def test_auto_is_accepted_in_any_case():
    assert DynamicBatcher(max_wait_ms=" Auto ").max_wait_ms == "auto"
