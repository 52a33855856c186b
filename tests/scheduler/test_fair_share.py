"""Fair share between tenants: virtual token counters within a priority level.

Each tenant's counter is the service it received (prompt tokens computed at first admission plus
output tokens, weighted) divided by its weight; admission takes the next request of the tenant
with the smallest counter among those whose next request has the best priority. These tests
drive the real scheduler with the fake model of test_scheduler.py (which checks every KV read).
A single-tenant workload keeps the plain order: every other test of this folder runs one tenant
and pins that order.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.config import SchedulerConfig, format_tenant_weights, parse_tenant_weights
from mqinfer.scheduler.fair import OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from tests.scheduler.test_scheduler import EOS, Driver

_fresh = itertools.count(70_000)


def req(rid: str, tenant: str, arrival: float, prompt=8, max_tokens: int = 8, priority: int = 0) -> EngineRequest:
    if isinstance(prompt, int):  # fresh tokens: shares no prefix with any other request
        prompt = [next(_fresh) for _ in range(prompt)]
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, priority=priority, tenant=tenant)


def config(**kw) -> SchedulerConfig:
    settings = dict(block_size=4, num_kv_blocks=1024, max_num_seqs=4, max_num_batched_tokens=256)
    settings.update(kw)
    return SchedulerConfig(**settings)


def admission_order(driver: Driver) -> list[str]:
    """Request ids in the order they were first scheduled (within a step, in admission order)."""
    seen: dict[str, None] = {}
    for step in driver.steps:
        for rid in step:
            seen.setdefault(rid)
    return list(seen)


def admitted_at(driver: Driver) -> dict[str, int]:
    """Request id -> the step in which it was first scheduled."""
    first: dict[str, int] = {}
    for i, step in enumerate(driver.steps):
        for rid in step:
            first.setdefault(rid, i)
    return first


# -- a flood does not hold a light tenant back -------------------------------------------------

def test_a_light_tenant_is_admitted_within_a_few_steps_despite_a_flood_queued_before_it():
    driver = Driver(config())
    flood = [driver.add(req(f"h{i}", "heavy", arrival=float(i))) for i in range(60)]
    for _ in range(5):
        driver.step()
    added_at = len(driver.steps)
    light = [driver.add(req(f"l{i}", "light", arrival=100.0 + i)) for i in range(3)]
    for _ in range(40):
        if all(r.status is not RequestStatus.WAITING for r in light):
            break
        driver.step()
    first = admitted_at(driver)
    # Each heavy request holds a slot for 8 steps and four run at once, so a slot frees about
    # every other step; the light tenant takes about every other freed slot. Behind the whole
    # flood it would have waited some 120 steps.
    assert all(r.request_id in first for r in light)
    assert max(first[r.request_id] for r in light) - added_at <= 16
    assert sum(1 for r in flood if r.status is RequestStatus.WAITING) >= 40
    driver.run()


# -- weights ------------------------------------------------------------------------------------

@pytest.mark.parametrize("gold_shape, std_shape", [
    ((8, 8), (8, 8)),  # the same requests: service ratio = token ratio
    ((4, 12), (16, 4)),  # different shapes: the counters weigh prompt and output tokens
])
def test_weights_share_service_two_to_one_between_backlogged_tenants(gold_shape, std_shape):
    driver = Driver(config(max_num_seqs=6, tenant_weights={"gold": 2, "std": 1}))
    made = {}
    # The standard tenant's backlog is queued first: first come first served would serve it alone.
    for i in range(150):
        made[f"s{i}"] = driver.add(req(f"s{i}", "std", arrival=float(i), prompt=std_shape[0],
                                       max_tokens=std_shape[1]))
    for i in range(150):
        made[f"g{i}"] = driver.add(req(f"g{i}", "gold", arrival=1000.0 + i, prompt=gold_shape[0],
                                       max_tokens=gold_shape[1]))
    window = range(30, 230)
    for _ in range(window.stop):
        driver.step()
    # Service as the counters count it: prompt tokens computed, and tokens sampled (one each time
    # a request's scheduled tokens reach the end of its known tokens). Prompts share nothing and
    # the cache is big enough never to preempt, so every scheduled token is computed once.
    service = {"gold": 0.0, "std": 0.0}
    done: dict[str, int] = {}
    for i, step in enumerate(driver.steps):
        for rid, n in step.items():
            request, before = made[rid], done.get(rid, 0)
            done[rid] = before + n
            if i in window:
                prompt_part = max(0, min(n, request.num_prompt_tokens - before))
                sampled = 1 if before + n >= request.num_prompt_tokens else 0
                service[request.tenant] += prompt_part * PROMPT_TOKEN_WEIGHT + sampled * OUTPUT_TOKEN_WEIGHT
    tenant_of = {rid: r.tenant for rid, r in made.items()}
    # Both still backlogged at the end of the window.
    waiting = {tenant_of[rid] for rid, r in driver.scheduler._requests.items() if r.status is RequestStatus.WAITING}
    assert waiting == {"gold", "std"}
    ratio = service["gold"] / service["std"]
    assert 1.8 <= ratio <= 2.2, service


# -- idling earns no credit --------------------------------------------------------------------

@pytest.mark.parametrize("other_active", [True, False])
def test_a_tenant_back_from_idle_is_lifted_to_the_active_tenants_and_banks_no_credit(other_active):
    driver = Driver(config())
    # b is served a little, then goes idle.
    for i in range(2):
        driver.add(req(f"b-early{i}", "b", arrival=float(i)))
    while driver.scheduler.has_unfinished_requests():
        driver.step()
    b_before = driver.scheduler.tenant_counter("b")
    # a is then served a lot, alone.
    a_requests = [driver.add(req(f"a{i}", "a", arrival=10.0 + i)) for i in range(80)]
    for _ in range(60):
        driver.step()
    if not other_active:  # a's work all ends: no tenant is active when b comes back
        driver.run()
    a_counter = driver.scheduler.tenant_counter("a")
    assert a_counter > 10 * b_before
    added_at = len(driver.steps)
    for i in range(40):
        driver.add(req(f"b{i}", "b", arrival=1000.0 + i))
    # Lifted to the smallest counter among the active tenants (a alone), or, with none active,
    # to the counter of the last tenant to go idle (a again).
    assert driver.scheduler.tenant_counter("b") == pytest.approx(a_counter)
    if not other_active:
        for i in range(80, 120):
            a_requests.append(driver.add(req(f"a{i}", "a", arrival=1000.5 + i)))
    for _ in range(40):
        driver.step()
    first = admitted_at(driver)
    admitted_after = [rid for rid, step in first.items() if step >= added_at]
    from_a = sum(1 for rid in admitted_after if rid.startswith("a"))
    from_b = len(admitted_after) - from_a
    # Both tenants share the admissions; with credit banked while idle, b would have taken
    # every one of them until its counter caught up with a's.
    assert from_a >= 5 and from_b >= 5, (from_a, from_b)
    assert abs(from_a - from_b) <= 0.4 * len(admitted_after), (from_a, from_b)
    driver.run()


def test_counters_of_idle_tenants_below_the_lift_floor_are_forgotten_and_owe_nothing_on_return():
    """Memory follows the active tenants: an idle tenant whose counter the lift would overwrite
    anyway is dropped (from time to time), and when it comes back it starts at the floor."""
    driver = Driver(config(max_num_seqs=8))
    for i in range(300):  # many tenants served once, then idle
        driver.add(req(f"old{i}", f"old{i}", arrival=float(i), prompt=4, max_tokens=2))
    driver.run()
    # A tenant served far more than any of them, then hundreds of new tenants beside it.
    big = [driver.add(req(f"big{i}", "big", arrival=1000.0 + i)) for i in range(200)]
    for _ in range(100):
        driver.step()
    for i in range(400):
        driver.add(req(f"new{i}", f"new{i}", arrival=2000.0 + i, prompt=4, max_tokens=2))
        driver.step()
    scheduler = driver.scheduler
    # Every old tenant's counter is below the floor the new ones were lifted to: all forgotten.
    assert not any(scheduler.tenant_counter(f"old{i}") is not None for i in range(300))
    assert len(scheduler._waiting._tenants) <= 401
    floor = min(scheduler.tenant_counter(t) for t in {r.tenant for r in scheduler._requests.values()})
    driver.add(req("old0-back", "old0", arrival=9000.0))
    assert scheduler.tenant_counter("old0") == pytest.approx(floor)
    driver.run()
    assert all(r.is_finished for r in big)


# -- priority before fairness ------------------------------------------------------------------

@pytest.mark.parametrize("aging", [None, 60.0])
def test_a_better_priority_goes_first_even_for_the_tenant_with_the_bigger_counter(aging):
    driver = Driver(config(priority_aging_s=aging))
    flood = [driver.add(req(f"h{i}", "heavy", arrival=0.01 * i, priority=1)) for i in range(40)]
    for _ in range(6):
        driver.step()
    light = [driver.add(req(f"l{i}", "light", arrival=0.5 + 0.01 * i, priority=1)) for i in range(6)]
    # Until the heavy tenant has received more service than the light one since the light one
    # came (the light tenant's first request runs at once, on its guaranteed slot).
    for _ in range(10):
        driver.step()
        if driver.scheduler.tenant_counter("heavy") > driver.scheduler.tenant_counter("light"):
            break
    assert driver.scheduler.tenant_counter("heavy") > driver.scheduler.tenant_counter("light")
    urgent_added_at = len(driver.steps)
    urgent = driver.add(req("h-urgent", "heavy", arrival=0.6, priority=0))
    for _ in range(40):
        driver.step()
    first = admitted_at(driver)
    order = admission_order(driver)
    # Priority wins over the counters: the urgent request takes the first freed slot...
    later_light = [r.request_id for r in light if first.get(r.request_id, 10**9) >= urgent_added_at]
    assert later_light and order.index(urgent.request_id) < min(order.index(rid) for rid in later_light)
    # ...and within priority 1 the light tenant is still served ahead of the heavy backlog.
    assert all(r.request_id in first for r in light)
    assert sum(1 for r in flood if r.status is RequestStatus.WAITING) >= 20
    driver.run()


def test_a_request_aged_past_the_best_level_goes_before_it():
    """With aging, a worse-priority request that has waited more than a level's worth goes before
    the best level, whatever the counters say: nothing starves."""
    driver = Driver(config(max_num_seqs=1, priority_aging_s=10.0))
    # The old tenant's request has waited 30 s at priority 1: worth priority -2 now.
    old = driver.add(req("old", "old", arrival=0.0, priority=1))
    for i in range(5):
        driver.add(req(f"n{i}", "new", arrival=30.0 + i, priority=0))
    driver.step()
    assert list(driver.steps[0]) == [old.request_id]
    driver.run()


# -- holding back a request whose prefix another computes ------------------------------------------

def test_a_held_request_keeps_its_tenants_turn_and_then_takes_the_cached_prefix():
    """b (light tenant) shares a prefix with a (heavy) that a is computing: b is held back in that
    step and the heavy tenant's next request goes ahead; once a slot frees, b is still the light
    tenant's turn ahead of the heavy backlog, and finds the prefix cached. Tenants share cached
    prefixes only under the global scope, which this test needs."""
    prefix = list(range(500, 512))  # three full blocks of 4
    driver = Driver(config(max_num_seqs=2, prefix_cache_scope="global"))
    a = driver.add(req("a", "heavy", arrival=0.0, prompt=prefix + [1, 2], max_tokens=4))
    heavy = [driver.add(req(f"h{i}", "heavy", arrival=1.0 + i, max_tokens=4)) for i in range(10)]
    b = driver.add(req("b", "light", arrival=50.0, prompt=prefix + [3, 4], max_tokens=4))
    out = driver.step()
    assert [sr.request.request_id for sr in out.scheduled] == ["a", "h0"]
    assert b.status is RequestStatus.WAITING
    driver.run()
    order = admission_order(driver)
    assert order.index("b") < order.index("h1")
    assert b.num_cached_tokens == len(prefix)
    assert a.num_cached_tokens == 0 and all(r.is_finished for r in heavy)


def test_under_the_tenant_scope_another_tenants_prefix_is_neither_waited_for_nor_hit():
    """Under the default scope b cannot use the heavy tenant's prefix, so it is not held back for it
    (it is admitted with a, in the same step) and computes its whole prompt; later, each tenant's
    request with that prefix hits its own tenant's copy."""
    prefix = list(range(500, 512))
    driver = Driver(config(max_num_seqs=2))
    a = driver.add(req("a", "heavy", arrival=0.0, prompt=prefix + [1, 2], max_tokens=4))
    b = driver.add(req("b", "light", arrival=50.0, prompt=prefix + [3, 4], max_tokens=4))
    out = driver.step()
    assert [sr.request.request_id for sr in out.scheduled] == ["a", "b"]
    driver.run()
    a2 = driver.add(req("a2", "heavy", arrival=60.0, prompt=prefix + [5, 6], max_tokens=4))
    b2 = driver.add(req("b2", "light", arrival=60.0, prompt=prefix + [5, 6], max_tokens=4))
    driver.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    # Each tenant's second request finds its own tenant's prefix, never the other's.
    assert a2.num_cached_tokens == len(prefix) and b2.num_cached_tokens == len(prefix)


# -- the waiting head in admission order --------------------------------------------------------

def test_the_protected_waiting_head_follows_the_fair_order():
    """The requests whose prefix hits are protected from eviction are those the scheduler will
    admit next, in fair-share order: here, what one admission pass then admits."""
    driver = Driver(config(max_num_seqs=64, max_num_batched_tokens=1024))
    for i in range(12):
        driver.add(req(f"h{i}", "heavy", arrival=float(i)))
    for i in range(4):
        driver.add(req(f"l{i}", "light", arrival=100.0 + i, prompt=4))
    head = [r.request_id for r in driver.scheduler._waiting_head()]
    out = driver.step()
    assert head == [sr.request.request_id for sr in out.scheduled]
    assert head[:2] == ["h0", "l0"]  # the light tenant's first request goes second, not 13th
    driver.run()


# -- many tenants at random ---------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(
    num_kv_blocks=st.integers(6, 40),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    aging=st.sampled_from([None, 5.0]),
    requests=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.booleans()),
        min_size=1, max_size=30,
    ),
    cancel_every=st.integers(0, 7),
)
def test_random_tenants_all_finish_and_each_tenant_keeps_its_own_order(num_kv_blocks, max_num_seqs, caching,
                                                                      aging, requests, cancel_every):
    driver = Driver(SchedulerConfig(
        block_size=4, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
        max_model_len=64, enable_prefix_caching=caching, priority_aging_s=aging,
        tenant_weights={"t0": 3, "t1": 0.5},
    ))
    made = []
    for i, (tenant, prompt_len, max_tokens, priority, shared) in enumerate(requests):
        # Some prompts share a prefix, so requests are held back while another computes it.
        prompt = [5] * min(prompt_len, 8) + [900 + i] * max(0, prompt_len - 8) if shared else prompt_len
        made.append(driver.add(req(f"r{i}", f"t{tenant}", arrival=float(i), prompt=prompt,
                                   max_tokens=max_tokens, priority=priority)))
        if cancel_every and i % cancel_every == cancel_every - 1:
            driver.step()
            driver.scheduler.finish_requests([f"r{i - 1}"], RequestStatus.FINISHED_CANCELLED)
    driver.run()
    assert all(r.is_finished for r in made)
    if caching:
        return  # a request held back while another computes its prefix is overtaken: that is the point
    # Within a tenant, requests of one priority are first admitted in arrival order.
    first = admitted_at(driver)
    for tenant in {r.tenant for r in made}:
        mine = [r for r in made if r.tenant == tenant and r.request_id in first]
        for a, b in itertools.combinations(mine, 2):
            if a.priority == b.priority and a.arrival_time < b.arrival_time:
                assert first[a.request_id] <= first[b.request_id]


# -- --tenant-weights ------------------------------------------------------------------------

def test_tenant_weights_parse_and_round_trip():
    assert parse_tenant_weights("gold=2, std=1,batch=0.25") == {"gold": 2.0, "std": 1.0, "batch": 0.25}
    assert parse_tenant_weights("") == {} and parse_tenant_weights(None) == {}
    assert parse_tenant_weights("team=a=3") == {"team=a": 3.0}  # split at the last '='
    weights = {"a": 2.0, "b": 1.0 / 3}
    assert parse_tenant_weights(format_tenant_weights(weights)) == weights
    assert format_tenant_weights({"a": 2.0, "b": 0.5}) == "a=2,b=0.5"


@pytest.mark.parametrize("text, message", [
    ("gold=two", r"the weight of tenant 'gold' must be a number, got 'two'"),
    ("gold=0", r"the weight of tenant 'gold' must be a finite number > 0, got '0'"),
    ("gold=-1", r"must be a finite number > 0, got '-1'"),
    ("gold=inf", r"must be a finite number > 0, got 'inf'"),
    ("gold=nan", r"must be a finite number > 0"),
    ("gold=2,gold=3", r"tenant 'gold' is given twice"),
    ("gold", r"entry 'gold' is not tenant=weight"),
    ("=2", r"entry '=2' is not tenant=weight"),
    ("gold=2,,std=1", r"entry 2 is empty"),
])
def test_bad_tenant_weights_are_refused_naming_the_entry(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tenant_weights(text)


def test_scheduler_config_checks_and_keeps_tenant_weights():
    cfg = SchedulerConfig(tenant_weights={"b": 2, "a": 0.5})
    assert cfg.tenant_weights == (("a", 0.5), ("b", 2.0))
    assert (cfg.weight_of("a"), cfg.weight_of("b"), cfg.weight_of("other")) == (0.5, 2.0, 1.0)
    assert SchedulerConfig(tenant_weights=cfg.tenant_weights) == cfg
    for bad, message in [({"a": 0}, "finite number > 0"), ({"a": float("nan")}, "finite number > 0"),
                         ({"": 1}, "non-empty string"), ([("a", 1), ("a", 2)], "given twice"),
                         ("a=1", "mapping of tenant to weight")]:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(tenant_weights=bad)


# -- fair share of the running slots --------------------------------------------------------

def running_by_group(driver: Driver) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in driver.scheduler._running:
        counts[r.fair_key] = counts.get(r.fair_key, 0) + 1
    return counts


def test_a_light_tenant_takes_its_share_of_full_slots_at_once_by_preempting_the_flood():
    driver = Driver(config(max_num_seqs=4))
    flood = [driver.add(req(f"h{i}", "heavy", arrival=float(i), max_tokens=40)) for i in range(12)]
    for _ in range(3):
        driver.step()
    assert running_by_group(driver) == {"heavy": 4}
    light = [driver.add(req(f"l{i}", "light", arrival=100.0 + i, max_tokens=8)) for i in range(3)]
    # Half of its share of the slots (one of two) is the light tenant's at once: the next step
    # takes one back. The rest is taken back while the heavy tenant has received more service:
    # the light tenant came back lifted to the heavy one's counter, and was charged its first
    # prompt, so after the heavy tenant has got ahead again, three steps later.
    driver.step()
    assert driver.preempted_at[-1] == ["h3"] and light[0].status is RequestStatus.RUNNING
    preempted = []
    for _ in range(3):
        driver.step()
        preempted += driver.preempted_at[-1]
    assert preempted == ["h2"]
    # Half of four slots each: two light requests run, in their own order, and the two heavy
    # requests preempted for them are the flood's last in scheduling order.
    assert [r.status for r in light] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    assert running_by_group(driver) == {"heavy": 2, "light": 2}
    # At its share the light tenant preempts nothing more: its third request waits for a free slot.
    for _ in range(5):
        driver.step()
        assert not driver.preempted_at[-1]
    driver.run()
    assert all(r.is_finished for r in flood + light)
    # And once more, for the third light request: when the first two finish, their slots go to
    # heavy requests (the light tenant's counter is then at or above the heavy one's); the third
    # takes one back a step after the heavy tenant is ahead again.
    assert driver.scheduler.num_preemptions_total == 3


def test_running_slots_follow_the_weights():
    driver = Driver(config(max_num_seqs=6, tenant_weights={"gold": 2, "std": 1}))
    for i in range(20):
        driver.add(req(f"s{i}", "std", arrival=float(i), max_tokens=60))
    driver.step()
    assert running_by_group(driver) == {"std": 6}
    for i in range(20):
        driver.add(req(f"g{i}", "gold", arrival=50.0 + i, max_tokens=60))
    # Long before the standard requests finish (60 tokens), the gold tenant holds two slots
    # in three, taken back as its counter falls behind.
    seen = []
    for _ in range(45):
        driver.step()
        seen.append(running_by_group(driver).get("gold", 0))
    assert seen[-1] == 4 and running_by_group(driver) == {"gold": 4, "std": 2}
    assert all(a <= b for a, b in zip(seen, seen[1:]))
    assert driver.scheduler.num_preemptions_total == 4


def test_one_group_alone_preempts_nothing_for_its_own_requests():
    driver = Driver(config(max_num_seqs=2))
    made = [driver.add(req(f"r{i}", "only", arrival=float(i), max_tokens=10)) for i in range(6)]
    driver.run()
    assert all(r.is_finished for r in made)
    assert driver.scheduler.num_preemptions_total == 0


def test_a_better_priority_running_request_is_not_preempted_for_a_worse_one():
    driver = Driver(config(max_num_seqs=2))
    urgent = [driver.add(req(f"u{i}", "heavy", arrival=float(i), max_tokens=20, priority=0)) for i in range(2)]
    driver.step()
    late = driver.add(req("l0", "light", arrival=10.0, max_tokens=5, priority=1))
    for _ in range(5):
        driver.step()
        assert late.status is RequestStatus.WAITING
    driver.run()
    assert all(r.is_finished for r in urgent + [late])
    assert driver.scheduler.num_preemptions_total == 0


def test_share_groups_split_one_tenant_fairly_so_a_small_job_behind_a_big_one_finishes_first():
    driver = Driver(config(max_num_seqs=8))

    def job_request(job: str, i: int, arrival: float) -> EngineRequest:
        r = req(f"{job}-{i}", "acme", arrival=arrival, max_tokens=30)
        r.share_group = f"acme/{job}"
        return r

    big = [driver.add(job_request("big", i, float(i))) for i in range(150)]
    driver.step()
    small = [driver.add(job_request("small", i, 200.0 + i)) for i in range(8)]
    steps = 0
    while not all(r.is_finished for r in small):
        driver.step()
        steps += 1
    # Half of the eight slots as its counter falls behind, the other four as the first of them
    # finish: about two rounds of 30 tokens, where behind the whole big job it would have waited
    # some 560 steps.
    assert steps <= 100
    assert sum(r.is_finished for r in big) < 40
    assert driver.scheduler.tenant_counter("acme/small") is not None
    driver.run()
    assert all(r.is_finished for r in big)


def test_kv_blocks_are_taken_from_a_group_above_its_share_of_slots_too():
    # Slots are free but the cache is full: the heavy tenant runs six of eight slots (its share
    # is four), and the light tenant's request gets the blocks of a preempted heavy one.
    driver = Driver(config(max_num_seqs=8, num_kv_blocks=18))
    heavy = [driver.add(req(f"h{i}", "heavy", arrival=float(i), prompt=8, max_tokens=24)) for i in range(8)]
    driver.step()
    assert running_by_group(driver) == {"heavy": 6}
    light = driver.add(req("l0", "light", arrival=50.0, prompt=8, max_tokens=4))
    for _ in range(6):
        driver.step()
        if light.status is RequestStatus.RUNNING:
            break
    assert light.status is RequestStatus.RUNNING
    assert driver.preempted_at[-1] and all(rid.startswith("h") for rid in driver.preempted_at[-1])
    assert driver.scheduler.num_running < 8
    driver.run()
    assert all(r.is_finished for r in heavy + [light])
