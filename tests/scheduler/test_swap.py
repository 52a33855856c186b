"""Swap preemption in the KV cache manager and the scheduler, checked against a shadow KV cache.

The shadow stores, per device slot and per host slot, the token prefix whose KV it holds. The
fake model executes the step's block copies the way the runner does (all swap-outs, then all
swap-ins, then the forward pass) and asserts that every position a request reads holds its own
prefix, so a wrong pair, a copy in the wrong order or a block reused too early fails the test.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.kv_cache_manager import KVCacheManager
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from tests.helpers import FakeClock, ShadowKV

FILL = 7
EOS = 0


class ShadowModel(ShadowKV):
    """Runs a SchedulerOutput against shadow device and host caches."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.copies_out = 0
        self.copies_in = 0

    def run(self, out: SchedulerOutput) -> list[int | None]:
        assert len({h for _, h in out.swap_out}) == len(out.swap_out), "two blocks swapped out to one host block"
        assert len({d for _, d in out.swap_in}) == len(out.swap_in), "two host blocks swapped into one block"
        self.copy(out.swap_out, self.device, self.host)
        self.copy(out.swap_in, self.host, self.device)
        self.copies_out += len(out.swap_out)
        self.copies_in += len(out.swap_in)
        sampled: list[int | None] = []
        for sr in out.scheduled:
            request = sr.request
            start = request.num_computed_tokens
            assert len(request.block_ids) * self.block_size >= start + sr.num_new_tokens
            self.check_reads(request, start)
            self.write(request, start, sr.num_new_tokens)
            sampled.append(FILL if sr.needs_sample else None)
        return sampled


_fresh = itertools.count(10_000)


def req(rid, prompt, arrival=0.0, priority=0, max_tokens=4) -> EngineRequest:
    if isinstance(prompt, int):
        prompt = [next(_fresh) for _ in range(prompt)]
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, priority=priority)


def run_all(scheduler: Scheduler, model: ShadowModel, max_steps: int = 20_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        outs.append(out)
        scheduler.update_from_output(out, model.run(out))
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_swap_blocks == kv.num_swap_blocks
    return outs


# -- the cache manager ------------------------------------------------------------------------

def computed(manager: KVCacheManager, request: EngineRequest, model: ShadowModel, num_new: int) -> None:
    assert manager.allocate_slots(request, num_new)
    model.write(request, request.num_computed_tokens, num_new)
    request.num_computed_tokens += num_new


def test_swap_out_then_in_copies_every_computed_block_when_nothing_is_cached():
    manager = KVCacheManager(block_size=4, num_blocks=6, enable_prefix_caching=False, num_swap_blocks=5)
    model = ShadowModel(4)
    a = EngineRequest("a", list(range(100, 110)), SamplingParams(max_tokens=8))
    computed(manager, a, model, 10)  # blocks for positions 0-3, 4-7, 8-9
    device_blocks = list(a.block_ids)
    a.status = RequestStatus.PREEMPTED
    pairs = manager.swap_out(a)
    assert [d for d, _ in pairs] == device_blocks
    assert len({h for _, h in pairs}) == 3
    assert a.block_ids == [] and manager.num_free_blocks == 6
    assert manager.num_free_swap_blocks == 2 and manager.is_swapped_out(a)
    assert a.num_computed_tokens == 10  # the KV is kept, not dropped
    model.copy(pairs, model.device, model.host)
    model.device.clear()  # whatever the device held is overwritten by others

    pairs_in = manager.swap_in(a, 1)
    assert [h for h, _ in pairs_in] == [h for _, h in pairs]
    assert [d for _, d in pairs_in] == a.block_ids
    assert not manager.is_swapped_out(a) and manager.num_free_swap_blocks == 5
    model.copy(pairs_in, model.host, model.device)
    model.check_reads(a, 10)


def test_swap_in_takes_blocks_still_in_the_prefix_cache_without_copying():
    manager = KVCacheManager(block_size=4, num_blocks=8, num_swap_blocks=8)
    model = ShadowModel(4)
    a = EngineRequest("a", list(range(100, 110)), SamplingParams(max_tokens=8))
    computed(manager, a, model, 10)
    old = list(a.block_ids)
    a.status = RequestStatus.PREEMPTED
    pairs = manager.swap_out(a)
    model.copy(pairs, model.device, model.host)
    # The two full blocks stayed cached on the device: only the partial third one is copied back.
    pairs_in = manager.swap_in(a, 1)
    assert a.block_ids[:2] == old[:2]
    assert pairs_in == [(pairs[2][1], a.block_ids[2])]
    model.copy(pairs_in, model.host, model.device)
    model.check_reads(a, 10)


def test_swap_in_copies_what_was_evicted_meanwhile():
    manager = KVCacheManager(block_size=2, num_blocks=4, num_swap_blocks=4)
    model = ShadowModel(2)
    a = EngineRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    computed(manager, a, model, 5)
    a.status = RequestStatus.PREEMPTED
    pairs = manager.swap_out(a)
    model.copy(pairs, model.device, model.host)
    # Another request takes three of the four blocks: a's tail first, then its second block.
    b = EngineRequest("b", [9, 9, 9, 9, 9, 9], SamplingParams(max_tokens=8))
    computed(manager, b, model, 6)
    b.status = RequestStatus.FINISHED_STOPPED
    manager.free(b)
    assert manager.get_computed_blocks(a)[1] == 2  # only the first block is still cached
    pairs_in = manager.swap_in(a, 1)
    assert len(pairs_in) == 2 and [h for h, _ in pairs_in] == [h for _, h in pairs[1:]]
    model.copy(pairs_in, model.host, model.device)
    model.check_reads(a, 5)


def test_swap_refusals_change_nothing():
    manager = KVCacheManager(block_size=4, num_blocks=4, enable_prefix_caching=False, num_swap_blocks=2)
    model = ShadowModel(4)
    a = EngineRequest("a", list(range(9)), SamplingParams(max_tokens=8))
    computed(manager, a, model, 9)  # 3 blocks: more than the host pool holds
    a.status = RequestStatus.PREEMPTED
    before = list(a.block_ids)
    assert manager.swap_out(a) is None
    assert a.block_ids == before and manager.num_free_swap_blocks == 2 and not manager.is_swapped_out(a)
    manager.free(a)

    b = EngineRequest("b", list(range(20, 27)), SamplingParams(max_tokens=8))
    computed(manager, b, model, 7)
    b.status = RequestStatus.PREEMPTED
    assert len(manager.swap_out(b)) == 2
    filler = EngineRequest("f", list(range(50, 62)), SamplingParams(max_tokens=8))
    computed(manager, filler, model, 12)  # 3 of 4 blocks: b needs 2 to come back
    assert manager.swap_in(b, 1) is None
    assert b.block_ids == [] and manager.is_swapped_out(b) and manager.num_free_swap_blocks == 0
    assert manager.num_free_blocks == 1
    filler.status = RequestStatus.FINISHED_STOPPED
    manager.free(filler)
    assert manager.swap_in(b, 1, num_reserved_blocks=3) is None
    assert len(manager.swap_in(b, 1, num_reserved_blocks=2)) == 2

    with pytest.raises(ValueError, match="not swapped out"):
        manager.swap_in(b, 1)
    # Nothing computed yet: nothing to keep, so the caller recomputes (for free).
    c = EngineRequest("c", [1, 2], SamplingParams(max_tokens=8))
    assert manager.swap_out(c) is None
    # No host pool at all.
    assert KVCacheManager(block_size=4, num_blocks=4).swap_out(b) is None


def test_a_swapped_request_that_ends_releases_its_host_blocks():
    manager = KVCacheManager(block_size=4, num_blocks=4, num_swap_blocks=4)
    model = ShadowModel(4)
    a = EngineRequest("a", list(range(6)), SamplingParams(max_tokens=8))
    computed(manager, a, model, 6)
    a.status = RequestStatus.PREEMPTED
    assert manager.swap_out(a)
    assert manager.num_free_swap_blocks == 2
    a.status = RequestStatus.FINISHED_CANCELLED
    manager.free(a)
    assert manager.num_free_swap_blocks == 4 and not manager.is_swapped_out(a)
    assert manager._req_hashes == {}


class SwapMachine(RuleBasedStateMachine):
    """Random admit / step / swap out / swap in / recompute-preempt / finish over shared prefixes."""

    BS = 3
    NUM_BLOCKS = 7
    NUM_SWAP = 5
    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5])

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(self.BS, self.NUM_BLOCKS, num_swap_blocks=self.NUM_SWAP)
        self.model = ShadowModel(self.BS)
        self.waiting: dict[str, EngineRequest] = {}
        self.swapped: dict[str, EngineRequest] = {}
        self.running: dict[str, EngineRequest] = {}
        self.count = 0

    def compute(self, request: EngineRequest, num_new: int, token: int) -> None:
        self.model.compute(self.manager, request, num_new, token)

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 9), suffix=st.lists(st.integers(0, 9), max_size=5))
    def new_request(self, prefix, cut, suffix):
        rid = f"r{self.count}"
        self.count += 1
        self.waiting[rid] = EngineRequest(rid, prefix[:cut] + suffix or [0], SamplingParams(max_tokens=64))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request = self.waiting[rid]
        hits, num_hit = self.manager.get_computed_blocks(request)
        num_new = data.draw(st.integers(1, request.num_tokens - num_hit))
        if not self.manager.allocate_slots(request, num_new, hits):
            return
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running[rid] = self.waiting.pop(rid)
        self.compute(request, num_new, data.draw(st.integers(0, 9)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        if self.manager.allocate_slots(request, num_new):
            self.compute(request, num_new, data.draw(st.integers(0, 9)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), clobber=st.booleans())
    def swap_out(self, data, clobber):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        request.status = RequestStatus.PREEMPTED
        free_host = self.manager.num_free_swap_blocks
        pairs = self.manager.swap_out(request)
        if pairs is None:  # the scheduler would recompute
            assert self.manager.num_free_swap_blocks == free_host
            self.manager.free(request)
            request.num_computed_tokens = 0
            self.waiting[rid] = request
            return
        assert len(pairs) == -(-request.num_computed_tokens // self.BS)
        self.model.copy(pairs, self.model.device, self.model.host)
        if clobber:
            # Device blocks nobody holds may be rewritten by anyone; only cached ones keep KV.
            for block in self.manager.block_pool.free_blocks():
                if block.block_hash is None:
                    for j in range(self.BS):
                        self.model.device[block.block_id * self.BS + j] = ("garbage",)
        self.swapped[rid] = request

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        request = self.swapped[rid]
        num_new = data.draw(st.integers(0, request.num_tokens - request.num_computed_tokens))
        pairs = self.manager.swap_in(request, num_new)
        if pairs is None:
            assert request.block_ids == [] and self.manager.is_swapped_out(request)
            return
        self.model.copy(pairs, self.model.host, self.model.device)
        request.status = RequestStatus.RUNNING
        self.running[rid] = self.swapped.pop(rid)
        self.model.check_reads(request, request.num_computed_tokens)
        if num_new:
            self.compute(request, num_new, data.draw(st.integers(0, 9)))

    @precondition(lambda self: self.running or self.waiting or self.swapped)
    @rule(data=st.data())
    def finish(self, data):
        pools = (self.running, self.waiting, self.swapped)
        rid = data.draw(st.sampled_from(sorted(itertools.chain(*pools))))
        request = next(p.pop(rid) for p in pools if rid in p)
        request.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(request)
        assert request.block_ids == [] and not self.manager.is_swapped_out(request)

    @invariant()
    def device_and_host_ownership_is_consistent(self):
        holders: dict[int, int] = {}
        for rid, request in self.running.items():
            ids = [b.block_id for b in self.manager.owned_blocks(rid)]
            assert ids == request.block_ids and len(set(ids)) == len(ids)
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for request in (*self.waiting.values(), *self.swapped.values()):
            assert request.block_ids == [] and self.manager.owned_blocks(request.request_id) == []
        free = {b.block_id for b in self.manager.block_pool.free_blocks()}
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.block_id in free) == (block.ref_cnt == 0)

        host_owned: list[int] = []
        for rid, request in self.swapped.items():
            host = self.manager._req_swap_blocks[rid]
            assert len(host) == -(-request.num_computed_tokens // self.BS)
            host_owned.extend(b.block_id for b in host)
            # The host copy holds exactly the request's computed prefix.
            for pos in range(request.num_computed_tokens):
                slot = host[pos // self.BS].block_id * self.BS + pos % self.BS
                assert self.model.host.get(slot) == tuple(request.all_token_ids[: pos + 1])
        assert set(self.manager._req_swap_blocks) == set(self.swapped)
        assert len(set(host_owned)) == len(host_owned), "a host block owned twice"
        pool = self.manager.swap_pool
        host_free = {b.block_id for b in pool.free_blocks()}
        assert host_free.isdisjoint(host_owned)
        assert len(host_free) + len(host_owned) == self.NUM_SWAP
        assert all(b.ref_cnt == (b.block_id in host_owned) for b in pool.blocks)

    def teardown(self):
        for request in (*self.running.values(), *self.waiting.values(), *self.swapped.values()):
            request.status = RequestStatus.FINISHED_CANCELLED
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.NUM_BLOCKS
        assert self.manager.num_free_swap_blocks == self.NUM_SWAP


SwapMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSwapMachine = SwapMachine.TestCase


# -- the scheduler ----------------------------------------------------------------------------

def swap_config(**kw) -> SchedulerConfig:
    return SchedulerConfig(preemption_mode="swap", **kw)


def test_swapped_requests_keep_their_kv_and_finish():
    # 10 requests of up to 7 blocks each in a cache of 16, and room for everything in host memory.
    config = swap_config(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=8,
                         num_swap_blocks=64)
    scheduler = Scheduler(config)
    model = ShadowModel(4)
    made = [req(f"r{i}", 6 + 2 * i, arrival=float(i), max_tokens=14) for i in range(10)]
    for r in made:
        scheduler.add_request(r)
    outs = run_all(scheduler, model)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 14 for r in made)
    assert scheduler.num_preemptions_total > 0
    # Host memory never ran out: every preemption was a swap and nothing was recomputed.
    assert scheduler.num_swaps_total == scheduler.num_preemptions_total == sum(r.num_swaps for r in made)
    assert all(r.num_recompute_tokens == 0 for r in made)
    assert model.copies_out > 0 and model.copies_in > 0
    assert sum(len(o.swap_out) for o in outs) == model.copies_out
    # Each swapped request's preemption shows up with the same step's copies.
    for out in outs:
        assert bool(out.swap_out) == bool(out.preempted)
    assert made[0].num_preemptions == 0 and max(r.num_preemptions for r in made) <= 2


def test_a_full_host_pool_falls_back_to_recompute():
    config = swap_config(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=8,
                         num_swap_blocks=4, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    model = ShadowModel(4)
    made = [req(f"r{i}", 6 + 2 * i, arrival=float(i), max_tokens=14) for i in range(10)]
    for r in made:
        scheduler.add_request(r)
    run_all(scheduler, model)
    assert all(r.num_output_tokens == 14 for r in made)
    swaps, total = scheduler.num_swaps_total, scheduler.num_preemptions_total
    assert 0 < swaps < total
    recomputed = [r for r in made if r.num_recompute_tokens]
    assert recomputed and all(r.num_preemptions > r.num_swaps for r in recomputed)


def test_swap_out_and_back_in_within_one_step_copies_out_first():
    # Two requests with the same one-block prompt, admitted in the same step (a prompt's last
    # block is never a prefix-cache hit, so neither waits for the other's): b's first block
    # duplicates a's cached one. When a needs a block, b is swapped out; it needs back only its
    # unshared tail, so the same step swaps it in again, into a device block it has just given
    # up. Copying in before out would read a host block not written yet; the shadow model then
    # fails the reads.
    config = swap_config(block_size=2, num_kv_blocks=6, max_num_batched_tokens=3, max_num_seqs=2,
                         num_swap_blocks=40)
    scheduler = Scheduler(config)
    model = ShadowModel(2)
    a = EngineRequest("a", [1, 2], SamplingParams(max_tokens=8), arrival_time=0.0)
    b = EngineRequest("b", [1, 2], SamplingParams(max_tokens=6), arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outs = run_all(scheduler, model)
    same_step = [o for o in outs if {d for d, _ in o.swap_out} & {d for _, d in o.swap_in}]
    assert len(same_step) == 1
    assert [r.request_id for r in same_step[0].preempted] == ["b"]
    assert a.num_output_tokens == 8 and b.num_output_tokens == 6
    assert b.num_swaps == 1 and b.num_recompute_tokens == 0 and a.num_preemptions == 0


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_a_swapped_request_that_expires_or_is_cancelled_frees_host_memory(ending):
    clock = FakeClock(100.0)
    config = swap_config(block_size=2, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=3,
                         num_swap_blocks=8, enable_prefix_caching=False)
    scheduler = Scheduler(config, clock=clock)
    model = ShadowModel(2)
    a = req("a", 4, arrival=0.0, max_tokens=8)
    b = EngineRequest("b", [40, 41, 42, 43], SamplingParams(max_tokens=8), arrival_time=1.0, deadline=105.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    kv = scheduler.kv_cache_manager
    while not kv.is_swapped_out(b):
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.run(out))
    assert b.output_token_ids == [FILL] * 3 and kv.num_free_swap_blocks == 5
    if ending == "expired":
        clock.now = 105.0
        out = scheduler.schedule()
        assert out.finished == [b] and b.status is RequestStatus.FINISHED_EXPIRED
        scheduler.update_from_output(out, model.run(out))
    else:
        assert scheduler.finish_requests(["b"], RequestStatus.FINISHED_CANCELLED) == [b]
    assert b.output_token_ids == [FILL] * 3  # what it generated is kept
    assert kv.num_free_swap_blocks == 8 and not kv.is_swapped_out(b)
    assert scheduler.num_waiting == 0
    run_all(scheduler, model)
    assert a.num_output_tokens == 8


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.integers(1, 6),
    num_kv_blocks=st.integers(4, 30),
    num_swap_blocks=st.integers(1, 30),
    max_num_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 30),
    caching=st.booleans(),
    requests=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 25), st.integers(0, 2), st.integers(0, 3)),
                      min_size=1, max_size=20),
)
def test_random_requests_with_swap_all_finish_reading_only_their_own_kv(
        block_size, num_kv_blocks, num_swap_blocks, max_num_seqs, extra_budget, caching, requests):
    config = swap_config(
        block_size=block_size, num_kv_blocks=num_kv_blocks, num_swap_blocks=num_swap_blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs + extra_budget, max_model_len=80,
        enable_prefix_caching=caching,
    )
    scheduler = Scheduler(config)
    model = ShadowModel(block_size)
    made = []
    for i, (prompt_len, max_tokens, priority, shared) in enumerate(requests):
        prompt = [1 + shared] * min(prompt_len, 10) + [200 + i] * max(0, prompt_len - 10)
        r = req(f"r{i}", prompt, arrival=float(i), priority=priority, max_tokens=max_tokens)
        r.max_model_len = 80
        made.append(r)
        scheduler.add_request(r)
    run_all(scheduler, model)
    capacity = config.num_cache_tokens
    for r in made:
        assert r.is_finished and r.block_ids == []
        if r.num_prompt_tokens > capacity:
            assert r.error_code == "kv_cache_too_small"
            continue
        full = min(r.sampling.max_tokens, 80 - r.num_prompt_tokens)
        if r.num_prompt_tokens + full - 1 <= capacity:
            assert r.num_output_tokens == full
        assert r.num_swaps <= r.num_preemptions
        if r.num_preemptions == r.num_swaps:
            assert r.num_recompute_tokens == 0
    assert scheduler.num_swaps_total == sum(r.num_swaps for r in made)
    event(f"swapped: {scheduler.num_swaps_total > 0}")
    event(f"fell back to recompute: {scheduler.num_preemptions_total > scheduler.num_swaps_total}")


def test_swap_config_is_checked():
    with pytest.raises(ValueError, match="preemption_mode must be recompute or swap"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="needs swap space"):
        SchedulerConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="num_swap_blocks must be an integer >= 0"):
        SchedulerConfig(num_swap_blocks=-1)
    # Swap blocks are only used in swap mode.
    scheduler = Scheduler(SchedulerConfig(num_swap_blocks=8))
    assert scheduler.kv_cache_manager.num_swap_blocks == 0
