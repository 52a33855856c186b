"""The meter and the work model: every second billed once, split by work, KV blocks shared fairly."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.kv_cache_manager import KVCacheManager
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.workers.queue.costs import (
    IDLE_RATIO_TAU_S,
    Meter,
    RequestMeter,
    WorkModel,
    kv_block_shares,
    process_start_time,
    wasted_work_row,
)

MODEL = WorkModel.for_model(num_params=5_000_000, vocab_size=260, hidden_size=128, num_layers=4, num_heads=4,
                            head_dim=32)


@dataclass
class Work:
    """Stands in for the engine's StepWork record (same fields)."""

    request_id: str
    num_tokens: int
    context_len: int
    is_prefill: bool = False
    num_recomputed_tokens: int = 0
    sampled: bool = True
    num_spec_tokens: int = 0


def test_work_model_terms():
    m = WorkModel.for_model(num_params=1000, vocab_size=10, hidden_size=5, num_layers=2, num_heads=3, head_dim=4)
    assert m.linear_flops_per_token == 2 * (1000 - 2 * 10 * 5)
    assert m.attn_flops_per_pair == 4 * 2 * 3 * 4
    assert m.lm_head_flops == 2 * 10 * 5
    tied = WorkModel.for_model(num_params=1000, vocab_size=10, hidden_size=5, num_layers=2, num_heads=3, head_dim=4,
                               tied=True)
    assert tied.linear_flops_per_token == 2 * (1000 - 10 * 5)
    # One decode token at context 7: 7 (query, key) pairs, plus the LM head.
    assert m.work(1, 7, True) == m.linear_flops_per_token + 7 * m.attn_flops_per_pair + m.lm_head_flops
    assert m.work(1, 7, False) == m.work(1, 7, True) - m.lm_head_flops


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), before=st.integers(0, 2000))
def test_attention_pairs_are_the_causal_pairs_of_the_chunk(n, before):
    m = WorkModel(linear_flops_per_token=0.0, attn_flops_per_pair=1.0, lm_head_flops=0.0)
    context = before + n
    # Token i of the chunk (0-based) attends to the `before` earlier tokens and to i + 1 of the chunk.
    assert m.work(n, context, False) == sum(before + i + 1 for i in range(n))


def test_a_long_prefill_costs_more_than_a_decode_and_long_contexts_more_than_short():
    assert MODEL.work(100, 100, True) > 50 * MODEL.work(1, 100, True)
    assert MODEL.work(1, 2000, True) > MODEL.work(1, 10, True)


def test_startup_idle_and_steps_cover_the_timeline_exactly():
    meter = Meter(MODEL, start=100.0, block_size=4)
    assert meter.startup_done(103.0) == 3.0
    meter.idle_until(104.5)
    meter.idle_until(104.0)  # going back in time bills nothing
    meter.step(105.0, [Work("a", 8, 8, is_prefill=True), Work("b", 8, 8, is_prefill=True)], {"a": 2.0, "b": 2.0})
    meter.step(105.2, [Work("a", 1, 9), Work("b", 1, 9)], {"a": 3.0, "b": 3.0})
    meter.step(105.5, [], {})  # nothing scheduled (only ended requests reported): idle
    assert meter.take_idle() == pytest.approx(1.8)
    assert meter.take_idle() == 0.0
    a, b = meter.pop("a"), meter.pop("b")
    # Same shape, same steps: the same bill, half of each step each.
    assert a == b
    assert a.prefill_s == pytest.approx(0.25) and a.decode_s == pytest.approx(0.1)
    assert a.device_s == pytest.approx(0.35)
    assert a.kv_block_s == pytest.approx(2.0 * 0.5 + 3.0 * 0.2)
    assert meter.pop("a") == RequestMeter()  # forgotten once popped
    assert meter.startup_s + meter.idle_total_s + meter.busy_total_s == pytest.approx(105.5 - 100.0)
    assert meter.busy_total_s == pytest.approx(0.7)


def test_a_step_is_split_by_work_and_recomputation_is_the_recomputed_part_of_the_chunk():
    meter = Meter(MODEL, start=0.0)
    work = [Work("long", 64, 64, is_prefill=True, num_recomputed_tokens=16), Work("short", 1, 30)]
    meter.step(1.0, work, {})
    w_long, w_short = MODEL.work(64, 64, True), MODEL.work(1, 30, True)
    long, short = meter.pop("long"), meter.pop("short")
    assert long.prefill_s == pytest.approx(w_long / (w_long + w_short))
    assert short.decode_s == pytest.approx(w_short / (w_long + w_short))
    assert long.recomputed_s == pytest.approx(long.prefill_s * 16 / 64)
    assert long.device_s + short.device_s == pytest.approx(1.0)


def test_blocks_of_a_finished_request_are_billed_from_its_last_step_or_its_context():
    meter = Meter(MODEL, start=0.0, block_size=16)
    meter.step(1.0, [Work("a", 40, 40, is_prefill=True)], {"a": 2.5})
    meter.step(2.0, [Work("a", 1, 41)], {})  # finished in this step: its blocks are already free
    assert meter.pop("a").kv_block_s == pytest.approx(2.5 + 2.5)
    meter.step(3.0, [Work("b", 40, 40, is_prefill=True)], {"b": 0.0})  # first and last step at once
    assert meter.pop("b").kv_block_s == pytest.approx(math.ceil(40 / 16) * 1.0)


@settings(max_examples=40, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["idle", "step", "empty_step", "flush"]),
                                 st.floats(0.0, 5.0, allow_nan=False),
                                 st.lists(st.tuples(st.integers(1, 64), st.integers(0, 500)), max_size=4)),
                       max_size=30),
       startup=st.floats(0.0, 10.0, allow_nan=False))
def test_conservation_every_second_is_billed_exactly_once(events, startup):
    """Whatever the sequence, startup + idle rows + per-request device time == wall time."""
    meter = Meter(MODEL, start=1000.0)
    now = 1000.0 + startup
    billed = meter.startup_done(now)
    request_ids = set()
    for i, (kind, dt_s, shapes) in enumerate(events):
        now += dt_s
        if kind == "idle":
            meter.idle_until(now)
        elif kind == "flush":
            billed += meter.take_idle()
        else:
            work = [] if kind == "empty_step" else [
                Work(f"r{i}-{j}", n, n + c, is_prefill=n > 1) for j, (n, c) in enumerate(shapes)]
            request_ids.update(w.request_id for w in work)
            meter.step(now, work, {})
    meter.idle_until(now)
    billed += meter.take_idle()
    billed += sum(meter.pop(rid).device_s for rid in request_ids)
    assert billed == pytest.approx(now - 1000.0, rel=1e-9, abs=1e-9)
    assert 0.0 <= meter.idle_ratio <= 1.0


def test_idle_ratio_follows_recent_time():
    meter = Meter(MODEL, start=0.0)
    meter.startup_done(0.0)
    meter.idle_until(IDLE_RATIO_TAU_S)
    assert meter.idle_ratio == pytest.approx(1 - math.exp(-1))
    meter.step(IDLE_RATIO_TAU_S * 20, [Work("a", 1, 1)], {})
    assert meter.idle_ratio < 1e-6  # a long busy stretch forgets the idle one
    meter.idle_until(IDLE_RATIO_TAU_S * 40)
    assert meter.idle_ratio > 0.999


def _admit(manager: KVCacheManager, rid: str, tokens: list[int]) -> EngineRequest:
    request = EngineRequest(rid, list(tokens), SamplingParams(max_tokens=8))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_cached_tokens = num_hit_tokens
    request.num_computed_tokens = request.num_tokens
    return request


def test_kv_block_shares_split_shared_prefix_blocks_among_their_holders():
    manager = KVCacheManager(block_size=4, num_blocks=32)
    prefix = list(range(100, 108))  # two full blocks
    a = _admit(manager, "a", prefix + [1, 2, 3])
    manager.allocate_slots(a, 1)  # registers a's full blocks in the prefix cache
    b = _admit(manager, "b", prefix + [7, 8])
    c = _admit(manager, "c", [50, 51, 52, 53, 54])
    assert manager.owned_blocks("b")[:2] == manager.owned_blocks("a")[:2]  # the prefix is shared
    shares = kv_block_shares(manager, ["a", "b", "c", "gone"])
    assert shares == {"a": pytest.approx(0.5 + 0.5 + 1), "b": pytest.approx(0.5 + 0.5 + 1), "c": 2.0, "gone": 0.0}
    # The shares add up to the blocks in use: shared blocks are not billed twice.
    assert sum(shares.values()) == pytest.approx(manager.usage * manager.num_blocks)
    b.status = RequestStatus.FINISHED_STOPPED
    manager.free(b)
    assert kv_block_shares(manager, ["a", "b"]) == {"a": 3.0, "b": 0.0}


def test_wasted_work_row_bills_nobody_but_keeps_the_time():
    meter = RequestMeter(prefill_s=0.5, decode_s=1.5, recomputed_s=0.1, kv_block_s=7.0)
    row = wasted_work_row(meter, job_id="j", request_id="r1", tenant="acme", model="tiny@x", request_type="chat",
                          prompt_tokens=12, worker="w1", price_per_device_hour=3.6, finished_at=10.0,
                          device_share=0.25)
    assert row.kind == "duplicate" and row.id == "r1" and row.tenant == "acme" and row.device_share == 0.25
    assert row.device_s == 2.0 and row.cost_usd == pytest.approx(2.0 * 3.6 / 3600)
    assert (row.prefill_s, row.decode_s, row.recomputed_s, row.kv_block_s) == (0.5, 1.5, 0.1, 7.0)


def test_process_start_time_is_this_process_start():
    started = process_start_time()
    assert started is not None
    assert 0.0 <= time.time() - started < 24 * 3600
    assert started <= time.time()


def test_meter_rejects_a_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        Meter(MODEL, start=0.0, block_size=0)


@pytest.mark.parametrize("share", [2.0, 0.5, 0.125])
def test_a_worker_bills_its_share_of_a_device_for_every_interval(share):
    # Two tensor-parallel ranks on CUDA (2.0), or a share of a CPU machine (one thread of 2 or 8
    # cores): each interval's wall seconds count `share` times, split among requests as on one device.
    one, mine = Meter(MODEL, start=0.0, block_size=4), Meter(MODEL, start=0.0, block_size=4, device_share=share)
    for meter in (one, mine):
        assert meter.startup_done(3.0) == 3.0 * meter.device_share
        meter.idle_until(4.0)
        meter.step(5.0, [Work("a", 8, 8, is_prefill=True), Work("b", 1, 20)], {"a": 2.0, "b": 5.0})
        meter.step(5.5, [], {})
    assert one.take_idle() == pytest.approx(1.5)
    assert mine.take_idle() == pytest.approx(share * 1.5)
    billed = 3.0 * share + 1.5 * share
    for rid in ("a", "b"):
        a1, a2 = one.pop(rid), mine.pop(rid)
        billed += a2.device_s
        assert a2.device_s == pytest.approx(share * a1.device_s) and a2.kv_block_s == pytest.approx(a1.kv_block_s)
    # Startup, idle and steps add up to the wall time times the share...
    assert billed == pytest.approx(5.5 * share)
    # ...and the wall-clock totals (metrics) stay wall clock.
    assert mine.startup_s + mine.idle_total_s + mine.busy_total_s == pytest.approx(5.5)


@pytest.mark.parametrize("share", [0.0, -1.0, float("nan"), float("inf")])
def test_meter_rejects_a_share_that_is_not_a_positive_number(share):
    with pytest.raises(ValueError, match="device_share must be a number > 0"):
        Meter(MODEL, start=0.0, device_share=share)
