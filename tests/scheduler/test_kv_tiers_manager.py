"""The KV cache manager with tiers below the device pool: prompt blocks written through as they are
computed, blocks the pool evicted found again in the tiers and copied up at admission, and a tier
that fails to deliver refusing the admission without changing anything.

``ShadowTiers`` is a complete in-memory ``LowerTiers``: it keeps, for each device block, the
prefix hash whose KV it holds (what "computing" a block writes), copies those between the device
and its own store, and can be told to lose a block, as a corrupt file would be lost.
"""

from __future__ import annotations

from mqinfer.scheduler.block_pool import hash_block_tokens, partition_root_hash
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition
from mqinfer.scheduler.kv_cache_manager import KVCacheManager, TierBlock
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams

BS = 4

# The root of the hash chain of a tenant "default" request under the manager's default scope.
ROOT = partition_root_hash(cache_partition(DEFAULT_PREFIX_CACHE_SCOPE, "default", None))


class ShadowTiers:
    name = "shadow"

    def __init__(self) -> None:
        self.device: dict[int, bytes] = {}  # device block -> hash of the KV it holds
        self.stored: dict[bytes, tuple[int, ...]] = {}
        self.broken: set[bytes] = set()
        self.loads: list[bytes] = []

    def contains(self, block_hash):
        return block_hash in self.stored

    def load(self, blocks):
        served = []
        for block_id, block_hash, tokens in blocks:
            if block_hash in self.broken or self.stored.get(block_hash) != tokens:
                self.stored.pop(block_hash, None)  # a bad blob is dropped, as the real tiers do
                break
            self.device[block_id] = block_hash
            self.loads.append(block_hash)
            served.append(self.name)
        return served

    def store(self, blocks):
        for block_id, block_hash, tokens in blocks:
            assert self.device.get(block_id) == block_hash, "a block was stored before its KV was computed"
            self.stored[block_hash] = tokens


def hashes(tokens, n):
    out, parent = [], ROOT
    for i in range(n):
        parent = hash_block_tokens(parent, tokens[i * BS: (i + 1) * BS])
        out.append(parent)
    return out


def admit_and_compute(manager, tiers, request):
    """Admit ``request`` with its prefix hits and compute its whole prompt, the way the scheduler and
    the runner would; the shadow device records the KV each computed block now holds."""
    hits, n_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - n_hit
    if not manager.allocate_slots(request, num_new, hits):
        return None
    request.num_cached_tokens = n_hit
    request.num_computed_tokens = request.num_tokens
    for i, h in enumerate(hashes(request.all_token_ids, request.num_tokens // BS)):
        tiers.device.setdefault(request.block_ids[i], h)
        if i >= n_hit // BS:
            tiers.device[request.block_ids[i]] = h
    return hits


def finish(manager, request):
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)


def make(rid, tokens):
    return EngineRequest(rid, list(tokens), SamplingParams(max_tokens=8))


def setup(num_blocks=6):
    manager = KVCacheManager(block_size=BS, num_blocks=num_blocks)
    tiers = ShadowTiers()
    manager.attach_tiers(tiers)
    return manager, tiers


def test_prompt_blocks_are_written_through_once_computed_and_generated_ones_are_not():
    manager, tiers = setup()
    a = make("a", range(10))  # two full prompt blocks and a partial one
    admit_and_compute(manager, tiers, a)
    assert tiers.stored == {}  # computed in this step: written through once a later step runs
    for t in (50, 51):  # two decode steps fill the third block with generated tokens
        a.append_output_token(t)
        assert manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    tiers.device[a.block_ids[2]] = hashes(a.all_token_ids, 3)[2]
    finish(manager, a)
    assert set(tiers.stored) == set(hashes(list(range(10)), 2))


def test_a_block_the_pool_evicted_comes_back_from_the_tiers():
    manager, tiers = setup(num_blocks=6)
    prefix = list(range(100, 116))  # four full blocks
    a = make("a", prefix + [1, 2])
    admit_and_compute(manager, tiers, a)
    finish(manager, a)
    other = make("b", list(range(200, 222)))  # six blocks: evicts every cached one
    admit_and_compute(manager, tiers, other)
    finish(manager, other)
    assert all(manager.block_pool.lookup(h, prefix[i * BS:(i + 1) * BS]) is None
               for i, h in enumerate(hashes(prefix, 4)))

    c = make("c", prefix + [3, 4, 5])
    hits, n_hit = manager.get_computed_blocks(c)
    assert n_hit == 16 and all(type(h) is TierBlock for h in hits)
    assert admit_and_compute(manager, tiers, c) is not None
    assert c.tier_cached_tokens == {"shadow": 16} and manager.tier_hit_tokens == {"shadow": 16}
    assert manager.prefix_cache_hits == 16
    assert tiers.loads == hashes(prefix, 4)
    # Copied up, the blocks are device hits again for the next request: nothing more to load.
    d = make("d", prefix + [9])
    hits, n_hit = manager.get_computed_blocks(d)
    assert n_hit == 16 and not any(type(h) is TierBlock for h in hits)


def test_device_and_tier_hits_interleave_in_position_order():
    manager, tiers = setup(num_blocks=8)
    prefix = list(range(100, 112))
    a = make("a", prefix + [1])
    admit_and_compute(manager, tiers, a)
    finish(manager, a)
    # Evict exactly one cached block of the prefix: take every uncached free block and one more.
    pool = manager.block_pool
    uncached = sum(1 for b in pool.free_blocks() if b.block_hash is None)
    taken = pool.allocate(uncached + 1)
    evicted = [h for h in hashes(prefix, 3) if h not in pool.cached_hashes]
    assert len(evicted) == 1
    b = make("b", prefix + [2])
    hits, n_hit = manager.get_computed_blocks(b)
    kinds = ["tier" if type(h) is TierBlock else "device" for h in hits]
    position = hashes(prefix, 3).index(evicted[0])
    assert n_hit == 12 and kinds[position] == "tier" and kinds.count("tier") == 1
    pool.free(taken)
    assert admit_and_compute(manager, tiers, b) is not None
    assert b.tier_cached_tokens == {"shadow": 4}


def test_a_block_the_tiers_cannot_deliver_refuses_the_admission_and_changes_nothing():
    manager, tiers = setup(num_blocks=6)
    prefix = list(range(100, 116))
    a = make("a", prefix + [1, 2])
    admit_and_compute(manager, tiers, a)
    finish(manager, a)
    other = make("b", list(range(200, 222)))
    admit_and_compute(manager, tiers, other)
    finish(manager, other)

    tiers.broken.add(hashes(prefix, 4)[2])
    c = make("c", prefix + [3])
    hits, n_hit = manager.get_computed_blocks(c)
    free_before = manager.num_free_blocks
    assert n_hit == 16
    assert not manager.allocate_slots(c, c.num_tokens - n_hit, hits)
    assert manager.num_free_blocks == free_before and c.block_ids == [] and manager.owned_blocks("c") == []
    assert c.tier_cached_tokens is None and manager.prefix_cache_hits == 0
    # The next lookup stops before the block that was lost; the request computes from there.
    hits, n_hit = manager.get_computed_blocks(c)
    assert n_hit == 8
    assert admit_and_compute(manager, tiers, c) is not None
    assert c.tier_cached_tokens == {"shadow": 8}


def test_tier_hits_need_free_blocks_like_computed_tokens():
    manager, tiers = setup(num_blocks=6)
    prefix = list(range(100, 116))
    a = make("a", prefix + [1])
    admit_and_compute(manager, tiers, a)
    finish(manager, a)
    filler = make("f", list(range(200, 220)))
    # The filler takes five of the six blocks: all but the prefix's head (freed last, so evicted
    # last), the one free block left.
    admit_and_compute(manager, tiers, filler)
    c = make("c", prefix + [3])
    hits, n_hit = manager.get_computed_blocks(c)
    assert n_hit == 16 and sum(type(h) is TierBlock for h in hits) == 3 and manager.num_free_blocks == 1
    assert not manager.allocate_slots(c, 1, hits)
    assert tiers.loads == []  # nothing was read for an admission that could not fit


def test_tiers_need_prefix_caching():
    manager = KVCacheManager(block_size=BS, num_blocks=4, enable_prefix_caching=False)
    try:
        manager.attach_tiers(ShadowTiers())
    except ValueError as exc:
        assert "prefix caching" in str(exc)
    else:
        raise AssertionError("tiers attached without prefix caching")
