"""Prefix blocks that waiting requests will use are the last to be evicted.

The block pool evicts cached free blocks least recently used first. While the scheduler has
waiting requests, the cached blocks that the requests at the head of its queue would take as
prefix-cache hits are protected: an allocation evicts them only after every other free block.
These tests drive the real pool, cache manager and scheduler (over a shadow KV cache that checks
every read), and run each scheduler scenario a second time with the protection switched off
(``PROTECTED_WAITING_REQUESTS = 0``) to show that plain LRU would have evicted the prefix.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler import scheduler as scheduler_module
from mqinfer.scheduler.block_pool import BlockPool, hash_block_tokens, partition_root_hash
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition
from mqinfer.scheduler.kv_cache_manager import KVCacheManager
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from tests.helpers import FakeClock, ShadowKV

EOS = 0
FILL = 7  # the model's only sampled token: never EOS

# The root of the hash chain of a tenant "default" request under the manager's default scope.
ROOT = partition_root_hash(cache_partition(DEFAULT_PREFIX_CACHE_SCOPE, "default", None))

_fresh = itertools.count(50_000)


def req(rid: str, prompt, arrival: float = 0.0, max_tokens: int = 2, priority: int = 0) -> EngineRequest:
    if isinstance(prompt, int):  # fresh tokens: shares no prefix with any other request
        prompt = [next(_fresh) for _ in range(prompt)]
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival, priority=priority)


class Engine:
    """schedule → model → update, with the model reading and writing a shadow KV cache."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.scheduler = Scheduler(config, clock=FakeClock(1_700_000_000.0))
        self.kv = ShadowKV(config.block_size)
        self.steps: list[dict[str, int]] = []  # request id -> tokens scheduled, per step
        self.preempted: list[str] = []

    def add(self, request: EngineRequest) -> EngineRequest:
        self.scheduler.add_request(request)
        return request

    def step(self) -> None:
        out = self.scheduler.schedule()
        sampled: list[int | None] = []
        for sr in out.scheduled:
            request = sr.request
            self.kv.check_reads(request, request.num_computed_tokens)
            self.kv.write(request, request.num_computed_tokens, sr.num_new_tokens)
            sampled.append(FILL if sr.needs_sample else None)
        self.steps.append({sr.request.request_id: sr.num_new_tokens for sr in out.scheduled})
        self.preempted.extend(r.request_id for r in out.preempted)
        self.scheduler.update_from_output(out, sampled)

    def run(self, max_steps: int = 1_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError(f"not done after {max_steps} steps")
        kv = self.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks


SYSTEM = list(range(10, 22))  # a shared prompt prefix: three full blocks of 4 tokens
OTHER = list(range(30, 42))  # an unrelated one, also three full blocks


def chain_hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    """The prefix-cache hashes of the full blocks of ``tokens``."""
    hashes, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def cached_tokens(pool: BlockPool, tokens: list[int], block_size: int = 4) -> int:
    """How many leading tokens of ``tokens`` the pool holds cached, in whole blocks."""
    n = 0
    for i, h in enumerate(chain_hashes(tokens, block_size)):
        if pool.lookup(h, tokens[i * block_size : (i + 1) * block_size]) is None:
            break
        n += block_size
    return n


def _waiting_request_behind_a_growing_one(monkeypatch, protect: bool) -> tuple[Engine, EngineRequest, EngineRequest]:
    """A cache of 10 blocks holding two cached, free prefixes: SYSTEM (used longer ago) and
    OTHER. A long decode then runs alone (max_num_seqs=1) while a request with the SYSTEM prefix
    waits behind it; the decode needs 6 blocks, 2 more than the never-used ones, so it evicts two
    cached blocks while the other request waits."""
    if not protect:
        monkeypatch.setattr(scheduler_module, "PROTECTED_WAITING_REQUESTS", 0)
    config = SchedulerConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=1)
    engine = Engine(config)
    engine.add(req("a", SYSTEM + [1]))
    engine.run()
    engine.add(req("b", OTHER + [2], arrival=1.0))
    engine.run()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_cached_blocks == 6  # both prefixes, and SYSTEM is the least recently used
    # 4 prompt tokens and 20 computed outputs: 6 blocks.
    decode = engine.add(req("decode", 4, arrival=2.0, max_tokens=21))
    waiting = engine.add(req("waiting", SYSTEM + [3], arrival=3.0))
    return engine, decode, waiting


def test_prefix_of_a_waiting_request_survives_evictions_and_is_hit_at_admission(monkeypatch):
    engine, decode, waiting = _waiting_request_behind_a_growing_one(monkeypatch, protect=True)
    pool = engine.scheduler.kv_cache_manager.block_pool
    while not decode.is_finished:
        assert cached_tokens(pool, SYSTEM) == 12
        engine.step()
    assert decode.num_output_tokens == 21 and waiting.status is RequestStatus.WAITING
    # The decode evicted two cached blocks while the request waited: OTHER's, not SYSTEM's.
    assert cached_tokens(pool, SYSTEM) == 12
    assert cached_tokens(pool, OTHER) == 4
    engine.step()
    # Admitted with the whole shared prefix found in the cache: only its last token is computed.
    assert waiting.status is RequestStatus.RUNNING
    assert waiting.num_cached_tokens == 12 and waiting.num_computed_tokens == 13
    assert engine.steps[-1] == {"waiting": 1}
    engine.run()
    assert engine.preempted == []


def test_without_the_protection_plain_lru_evicts_the_waiting_requests_prefix(monkeypatch):
    """The same scenario with the protection off: this is what the test above guards against."""
    engine, decode, waiting = _waiting_request_behind_a_growing_one(monkeypatch, protect=False)
    pool = engine.scheduler.kv_cache_manager.block_pool
    while not decode.is_finished:
        engine.step()
    # SYSTEM's last two blocks were the least recently used: only its first block is left.
    assert cached_tokens(pool, SYSTEM) == 4
    assert cached_tokens(pool, OTHER) == 12
    engine.step()
    assert waiting.num_cached_tokens == 4
    assert engine.steps[-1] == {"waiting": 9}
    engine.run()


def _cache_filled_by_a_lone_decode(monkeypatch, protect: bool) -> Engine:
    """An 8-block cache whose only cached blocks are the waiting request's prefix; a lone decode
    then grows to fill the whole cache, so it must evict every protected block."""
    if not protect:
        monkeypatch.setattr(scheduler_module, "PROTECTED_WAITING_REQUESTS", 0)
    config = SchedulerConfig(block_size=4, num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=1)
    engine = Engine(config)
    engine.add(req("a", SYSTEM + [1]))
    engine.run()
    # 4 prompt tokens and 28 computed outputs: all 8 blocks.
    engine.add(req("decode", 4, arrival=1.0, max_tokens=29))
    engine.add(req("waiting", SYSTEM + [3], arrival=2.0))
    engine.run()
    return engine


def test_protected_blocks_are_still_evicted_when_nothing_else_is_free(monkeypatch):
    engine = _cache_filled_by_a_lone_decode(monkeypatch, protect=True)
    assert engine.scheduler.num_preemptions_total == 0 and engine.preempted == []
    # The decode ran every step until it had all its 29 tokens, never short of a block.
    decode_steps = [s["decode"] for s in engine.steps if "decode" in s]
    assert decode_steps == [4] + [1] * 28
    # The waiting request's prefix went to make room: it computes its whole prompt.
    assert engine.steps[-2] == {"waiting": 13}
    with monkeypatch.context() as m:
        plain = _cache_filled_by_a_lone_decode(m, protect=False)
    # Step for step what plain LRU does: the protection never costs an allocation.
    assert engine.steps == plain.steps


def test_only_the_leading_cached_run_of_a_request_is_protected():
    kv = KVCacheManager(block_size=4, num_blocks=16)
    prompt = SYSTEM + OTHER + [5]  # six full blocks before the last token's
    first = req("first", prompt, max_tokens=1)
    assert kv.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)
    hashes = chain_hashes(prompt)
    same = req("same", prompt)
    assert kv.prefix_hit_hashes([same]) == set(hashes)
    # Drop the third block from the cache: the blocks after it can no longer be hits.
    pool = kv.block_pool
    blocks = [pool.lookup(h, prompt[i * 4 : (i + 1) * 4]) for i, h in enumerate(hashes)]
    kept = blocks[:2] + blocks[3:]
    pool.touch(kept)
    assert pool.reset_prefix_cache() == 1
    pool.free(kept)
    assert kv.prefix_hit_hashes([same]) == set(hashes[:2])
    # A prompt that has only its last token's block has nothing to protect.
    assert kv.prefix_hit_hashes([req("short", SYSTEM[:4])]) == set()
    assert KVCacheManager(4, 16, enable_prefix_caching=False).prefix_hit_hashes([same]) == set()


def test_waiting_head_is_the_first_requests_in_scheduling_order(monkeypatch):
    monkeypatch.setattr(scheduler_module, "PROTECTED_WAITING_REQUESTS", 5)
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    scheduler = Scheduler(config, clock=FakeClock(1_700_000_000.0))
    requests = [req(f"r{i}", 3, arrival=float(i), priority=(i * 7) % 3) for i in range(20)]
    for request in reversed(requests):
        scheduler.add_request(request)
    scheduler.finish_requests([requests[0].request_id], RequestStatus.FINISHED_CANCELLED)
    live = [r for r in requests if not r.is_finished]
    expected = sorted(live, key=lambda r: scheduler._order[r.request_id])[:5]
    assert scheduler._waiting_head() == expected


# -- the block pool ---------------------------------------------------------------------------

def _cached_free_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list]:
    """A pool whose first ``num_cached`` blocks are cached under hashes of [i] and free, in id order."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    hashes = [hash_block_tokens(None, [i]) for i in range(num_cached)]
    for block, h, i in zip(blocks, hashes, range(num_cached)):
        assert pool.cache_block(block, h, [i])
    pool.free(reversed(blocks[num_cached:]))  # uncached: to the front
    pool.free(blocks[:num_cached])  # cached: in this order, least recently used first
    return pool, hashes


def test_pool_evicts_protected_blocks_after_every_other_one():
    pool, hashes = _cached_free_pool(6, 4)
    assert [b.block_id for b in pool.free_blocks()] == [4, 5, 0, 1, 2, 3]
    pool.set_protected(lambda: {hashes[0], hashes[2]})
    taken = pool.allocate(4)
    assert [b.block_id for b in taken] == [4, 5, 1, 3]
    assert pool.lookup(hashes[0], [0]) is not None and pool.lookup(hashes[2], [2]) is not None
    assert pool.num_free_blocks == 2
    # Nothing unprotected is left: protected blocks go, least recently used first.
    assert [b.block_id for b in pool.allocate(1)] == [0]
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 1
    # A cached block freed now is the most recently used, but unprotected: it goes first.
    assert pool.cache_block(taken[2], hashes[1], [1])
    pool.free([taken[2]])
    assert [b.block_id for b in pool.free_blocks()] == [2, 1]
    assert [b.block_id for b in pool.allocate(1)] == [1]
    pool.set_protected(None)
    pool.free(taken)
    assert pool.num_free_blocks == 5


def test_pool_asks_for_the_protected_hashes_only_when_evicting_a_cached_block():
    pool, hashes = _cached_free_pool(6, 4)
    calls = []

    def protected():
        calls.append(1)
        return {hashes[0]}

    pool.set_protected(protected)
    pool.allocate(2)  # the two uncached blocks: nothing is evicted
    assert calls == []
    pool.allocate(1)
    pool.allocate(1)
    assert len(calls) == 1  # once per installation
    pool.set_protected(protected)
    pool.allocate(1)
    assert len(calls) == 2


NUM_KEYS = 8
_keys = st.integers(0, NUM_KEYS - 1)


@settings(max_examples=200, deadline=None)
@given(
    cached=st.lists(st.booleans(), min_size=8, max_size=8),
    free_order=st.permutations(range(8)),
    protected_keys=st.frozensets(_keys),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("allocate"), st.integers(1, 8)),
            st.tuples(st.just("free"), st.integers(0, 31)),
            st.tuples(st.just("cache"), st.integers(0, 31), _keys),
            st.tuples(st.just("hit"), _keys),
            st.tuples(st.just("protect"), st.frozensets(_keys)),
            st.tuples(st.just("unprotect"),),
            st.tuples(st.just("reset"),),
        ),
        min_size=1, max_size=40,
    ),
)
def test_pool_allocation_is_lru_over_unprotected_blocks_then_protected_ones(cached, free_order, protected_keys,
                                                                           ops):
    """Against a reference: an allocation succeeds exactly when plain LRU's would, and takes
    the unprotected free blocks in eviction order, then the protected ones in eviction order.

    The pool starts with every block free in a random order, block i cached under key i when
    ``cached[i]``, and the hashes of ``protected_keys`` protected."""
    pool = BlockPool(8)
    keys = [hash_block_tokens(None, [k]) for k in range(NUM_KEYS)]
    blocks = pool.allocate(8)
    for i, block in enumerate(blocks):
        if cached[i]:
            assert pool.cache_block(block, keys[i], [i])
    pool.free(blocks[i] for i in free_order)
    held: list = []  # one entry per owner: a block shared through hits appears once per owner
    protected = frozenset(keys[k] for k in protected_keys)
    pool.set_protected(lambda: protected)
    for op in ops:
        kind = op[0]
        if kind == "allocate":
            n = op[1]
            order = list(pool.free_blocks())
            if n > len(order):
                with pytest.raises(ValueError, match="only"):
                    pool.allocate(n)
                continue
            unprotected = [b for b in order if b.block_hash not in protected]
            spared = [b for b in order if b.block_hash in protected]
            taken = pool.allocate(n)
            assert [b.block_id for b in taken] == [b.block_id for b in (unprotected + spared)[:n]]
            assert all(b.ref_cnt == 1 and b.block_hash is None for b in taken)
            held.extend(taken)
        elif kind == "free" and held:
            pool.free([held.pop(op[1] % len(held))])
        elif kind == "cache" and held:
            pool.cache_block(held[op[1] % len(held)], keys[op[2]], [op[2]])
        elif kind == "hit":
            block = pool.lookup(keys[op[1]], [op[1]])
            if block is not None:
                pool.touch([block])
                held.append(block)
        elif kind == "protect":
            protected = frozenset(keys[k] for k in op[1])
            pool.set_protected(lambda p=protected: p)
        elif kind == "unprotect":
            protected = frozenset()
            pool.set_protected(None)
        elif kind == "reset":
            pool.reset_prefix_cache()
        # Accounting is untouched: free means unowned, and every owner is a held entry.
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
        assert sum(b.ref_cnt for b in pool.blocks) == len(held)
