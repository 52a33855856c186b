"""The KV cache manager: slots, prefix-cache hits and sharing, freeing; a stateful property test.

The state machine keeps a shadow of the KV cache: every slot a request computes gets the exact
token prefix it was computed from (the real KV of a position depends on every token before it).
A request may only ever read slots whose shadow equals its own prefix, and every cached block
must hold what its hash says.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mqinfer.scheduler.block_pool import hash_block_tokens, partition_root_hash
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition
from mqinfer.scheduler.kv_cache_manager import KVCacheManager
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from tests.helpers import ShadowKV

# The root of the hash chain of a tenant "default" request under the manager's default scope.
ROOT = partition_root_hash(cache_partition(DEFAULT_PREFIX_CACHE_SCOPE, "default", None))


def make_request(rid: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(rid, list(tokens), SamplingParams(max_tokens=64))


def run_chunk(manager: KVCacheManager, request: EngineRequest, num_new: int, hits=None) -> bool:
    """Allocate and 'compute' a chunk the way the scheduler and the model runner would."""
    ok = manager.allocate_slots(request, num_new, hits)
    if ok:
        request.num_computed_tokens += num_new + (len(hits) * manager.block_size if hits else 0)
    return ok


def test_allocate_grows_by_whole_blocks_and_free_returns_them():
    manager = KVCacheManager(block_size=4, num_blocks=8)
    request = make_request("a", range(10))
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.allocate_slots(request, 6)
    assert len(request.block_ids) == 2
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 4)
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 10
    # Room for the token that will be sampled next: position 10 is still in block 2.
    assert manager.allocate_slots(request, 1)
    assert len(request.block_ids) == 3
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 8


def test_no_room_changes_nothing():
    manager = KVCacheManager(block_size=4, num_blocks=3)
    a = make_request("a", range(8))
    assert run_chunk(manager, a, 8)
    b = make_request("b", range(100, 108))
    before = (manager.num_free_blocks, list(a.block_ids))
    assert not manager.allocate_slots(b, 8)
    assert b.block_ids == []
    assert (manager.num_free_blocks, list(a.block_ids)) == before
    assert manager.allocate_slots(b, 4)
    assert manager.num_free_blocks == 0


def test_reserved_blocks_are_kept_free():
    manager = KVCacheManager(block_size=4, num_blocks=3)
    c = make_request("c", range(8))
    assert not manager.allocate_slots(c, 8, num_reserved_blocks=2)
    assert c.block_ids == [] and manager.num_free_blocks == 3
    assert manager.allocate_slots(c, 8, num_reserved_blocks=1)
    assert manager.num_free_blocks == 1


def test_prefix_hit_shares_blocks_and_never_covers_the_whole_prompt():
    manager = KVCacheManager(block_size=4, num_blocks=10)
    system = list(range(50, 58))  # two full blocks
    a = make_request("a", system + [1, 2, 3])
    assert run_chunk(manager, a, a.num_tokens)
    # Blocks are cached once full of computed tokens, at the next allocation or at free.
    assert manager.allocate_slots(a, 1)

    b = make_request("b", system + [9])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert [blk.block_id for blk in hits] == a.block_ids[:2]
    assert run_chunk(manager, b, 1, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] not in a.block_ids
    assert [blk.ref_cnt for blk in manager.owned_blocks("b")[:2]] == [2, 2]
    assert manager.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert manager.prefix_cache_hits == 8

    # A prompt that is exactly the cached blocks still computes its last token.
    c = make_request("c", system)
    hits, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 4 and len(hits) == 1

    # Different first block, same second block: the chain makes it a miss.
    d = make_request("d", [0, 0, 0, 0] + system[4:] + [1])
    assert manager.get_computed_blocks(d) == ([], 0)

    for request in (a, b):
        request.status = RequestStatus.FINISHED_STOPPED
        manager.free(request)
    assert manager.num_free_blocks == 10
    # Freed but still cached: a newcomer hits them from the free list.
    e = make_request("e", system + [4, 4])
    hits, num_hit = manager.get_computed_blocks(e)
    assert num_hit == 8
    free_before = manager.num_free_blocks
    assert run_chunk(manager, e, 2, hits)
    assert manager.num_free_blocks == free_before - 3


def test_a_freed_request_loses_its_tail_blocks_first():
    manager = KVCacheManager(block_size=2, num_blocks=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert run_chunk(manager, a, 7)
    a.status = RequestStatus.FINISHED_STOPPED
    manager.free(a)  # blocks 0-2 cached, block 3 (one token) not
    filler = make_request("f", [9, 9, 9])
    assert run_chunk(manager, filler, 3)  # reuses the uncached block, then evicts a's last block
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4, "the shared prefix must outlive the suffix"


def test_caching_off_finds_nothing():
    manager = KVCacheManager(block_size=2, num_blocks=8, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert run_chunk(manager, a, 5)
    a.status = RequestStatus.FINISHED_STOPPED
    manager.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    assert manager.get_computed_blocks(b) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0


def test_preempted_request_finds_its_own_blocks_again():
    manager = KVCacheManager(block_size=4, num_blocks=6)
    a = make_request("a", range(10))
    assert run_chunk(manager, a, 10)
    old = list(a.block_ids)
    a.status = RequestStatus.PREEMPTED
    manager.free(a)
    a.num_computed_tokens = 0
    hits, num_hit = manager.get_computed_blocks(a)
    assert num_hit == 8
    assert [b.block_id for b in hits] == old[:2]


def test_evictable_hits_count_against_free_blocks():
    # Two free blocks, both cached hits for b: b needs one more block for its last token and
    # there is none left once the hits are taken out of the free list.
    manager = KVCacheManager(block_size=2, num_blocks=3)
    a = make_request("a", [1, 2, 3, 4])
    assert run_chunk(manager, a, 4)
    a.status = RequestStatus.FINISHED_STOPPED
    manager.free(a)
    filler = make_request("f", [9])
    assert run_chunk(manager, filler, 1)
    b = make_request("b", [1, 2, 3, 4, 5])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4
    assert not manager.allocate_slots(b, 1, hits)
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert manager.num_free_blocks == 2


class KVCacheMachine(RuleBasedStateMachine):
    """Random admit / chunk / decode / preempt / finish sequences over shared prefixes."""

    BLOCK_SIZE = 3
    NUM_BLOCKS = 7
    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5])

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(self.BLOCK_SIZE, self.NUM_BLOCKS)
        self.waiting: dict[str, EngineRequest] = {}
        self.running: dict[str, EngineRequest] = {}
        self.kv = ShadowKV(self.BLOCK_SIZE)
        self.count = 0

    # -- helpers ------------------------------------------------------------------------------
    def compute(self, request: EngineRequest, num_new: int, token: int) -> None:
        self.kv.compute(self.manager, request, num_new, token)

    # -- rules --------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 9), suffix=st.lists(st.integers(0, 9), max_size=5))
    def new_request(self, prefix, cut, suffix):
        tokens = prefix[:cut] + suffix or [0]
        rid = f"r{self.count}"
        self.count += 1
        self.waiting[rid] = make_request(rid, tokens)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        request = self.waiting[rid]
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit % self.BLOCK_SIZE == 0 and num_hit < request.num_tokens
        assert num_hit == len(hits) * self.BLOCK_SIZE
        num_new = data.draw(st.integers(1, request.num_tokens - num_hit))
        free_before = self.manager.num_free_blocks
        refs_before = [b.ref_cnt for b in self.manager.block_pool.blocks]
        if not self.manager.allocate_slots(request, num_new, hits):
            assert self.manager.num_free_blocks == free_before
            assert [b.ref_cnt for b in self.manager.block_pool.blocks] == refs_before
            assert request.block_ids == []
            return
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        del self.waiting[rid]
        self.running[rid] = request
        self.compute(request, num_new, data.draw(st.integers(0, 9)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        before = list(request.block_ids)
        if self.manager.allocate_slots(request, num_new):
            self.compute(request, num_new, data.draw(st.integers(0, 9)))
        else:
            assert request.block_ids == before

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        request.status = RequestStatus.PREEMPTED
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[rid] = request

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        request = self.running.pop(rid, None) or self.waiting.pop(rid)
        request.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(request)
        assert request.block_ids == []

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def refcounts_equal_holders_and_free_list_is_disjoint(self):
        holders: dict[int, int] = {}
        for rid, request in self.running.items():
            owned = self.manager.owned_blocks(rid)
            ids = [b.block_id for b in owned]
            assert ids == request.block_ids
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            assert len(ids) * self.BLOCK_SIZE >= request.num_computed_tokens
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for request in self.waiting.values():
            assert request.block_ids == [] and self.manager.owned_blocks(request.request_id) == []
        free = {b.block_id for b in self.manager.block_pool.free_blocks()}
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.block_id in free) == (block.ref_cnt == 0)
        assert self.manager.num_free_blocks == self.NUM_BLOCKS - len(holders)
        assert self.manager.usage == pytest.approx(len(holders) / self.NUM_BLOCKS)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        bs = self.BLOCK_SIZE
        for block_hash, block in self.manager.block_pool.cached_blocks():
            assert block.block_hash == block_hash
            base = block.block_id * bs
            prefix = self.kv.device[base + bs - 1]
            assert prefix[-bs:] == block.token_ids
            for j in range(bs):
                assert self.kv.device[base + j] == prefix[: len(prefix) - bs + j + 1]
            parent = ROOT
            for i in range(0, len(prefix), bs):
                parent = hash_block_tokens(parent, prefix[i : i + bs])
            assert parent == block_hash

    def teardown(self):
        for request in [*self.running.values(), *self.waiting.values()]:
            request.status = RequestStatus.FINISHED_CANCELLED
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks)
        assert self.manager._req_hashes == {}


KVCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
