"""The block pool: reference counts, LRU free list, chained hashes, confirmed cache hits."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.block_pool import BlockPool, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_blocks()]


def test_allocate_takes_least_recently_used_first_and_counts_owners():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)
    pool.free([b, a])
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    # Uncached freed blocks go to the front, in the order freed (a last -> first out).
    assert free_ids(pool) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.allocate(5)


def test_a_large_pool_makes_its_blocks_as_they_are_handed_out():
    import tracemalloc

    tracemalloc.start()
    try:
        pool = BlockPool(1_000_000)
        made_at_start = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A block object each would be about 100 MB; the pool starts with none of them.
    assert made_at_start < 100_000
    assert pool.num_free_blocks == 1_000_000 and pool.usage == 0.0
    assert [x.block_id for x in pool.allocate(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 999_997

    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(b, h, [1, 2])
    pool.free([c, b, a])
    # Uncached blocks go ahead of the never used ones, the cached one after them all.
    assert free_ids(pool) == [0, 2, 3, 4, 5, 1]
    assert pool.lookup(h, [1, 2]) is b
    pool.touch([b])
    assert free_ids(pool) == [0, 2, 3, 4, 5] and pool.num_free_blocks == 5
    assert [x.block_id for x in pool.allocate(4)] == [0, 2, 3, 4]
    assert [x.block_id for x in pool.blocks] == list(range(6))


def test_chained_hash_depends_on_parent_tokens_and_extra_key():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3))
    assert len(h1) == 16
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(h1, [4, 5, 6]) != hash_block_tokens(hash_block_tokens(None, [1, 2, 4]), [4, 5, 6])
    assert hash_block_tokens(None, [1, 2, 3], b"tenant-a") != hash_block_tokens(None, [1, 2, 3], b"tenant-b")
    assert hash_block_tokens(None, [1, 2, 3], b"tenant-a") != h1
    # Lengths are part of the input: a shorter block is not a prefix of a longer one's hash.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])


def test_cached_block_survives_free_and_is_taken_back_on_a_hit():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 8])
    assert pool.cache_block(block, h, [7, 8])
    pool.free([block])
    # Free and evictable, still findable; at the most-recently-used end.
    assert pool.num_free_blocks == 3
    assert free_ids(pool)[-1] == block.block_id
    hit = pool.lookup(h, [7, 8])
    assert hit is block
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert block.block_id not in free_ids(pool)
    assert pool.num_free_blocks == 2
    # A second holder shares it.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free([hit, hit])
    assert hit.ref_cnt == 0
    assert pool.lookup(h, [7, 8]) is block


def test_a_hit_is_confirmed_by_the_tokens_not_just_the_hash():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    # Pretend two different blocks collide on one hash.
    pool.cache_block(block, h, [1, 2])
    assert pool.lookup(h, [1, 3]) is None
    assert pool.lookup(h, [1, 2]) is block
    assert pool.lookup(hash_block_tokens(None, [1, 3]), [1, 3]) is None


def test_eviction_is_least_recently_used_and_uncached_blocks_go_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for block, h, tok in zip(blocks[:3], hashes, range(3)):
        pool.cache_block(block, h, [tok])
    # Free in order 2, 0, 3(uncached), 1: the uncached one must be reused first, then 2, then 0.
    for i in (2, 0, 3, 1):
        pool.free([blocks[i]])
    assert free_ids(pool) == [3, 2, 0, 1]
    (first,) = pool.allocate(1)
    assert first.block_id == 3
    assert pool.num_cached_blocks == 3
    (second,) = pool.allocate(1)
    assert second.block_id == 2
    # Evicting drops the cache entry and the block's tokens.
    assert second.block_hash is None and second.token_ids is None
    assert pool.lookup(hashes[2], [2]) is None
    assert pool.num_cached_blocks == 2
    assert pool.lookup(hashes[0], [0]) is blocks[0]


def test_touch_refreshes_nothing_but_free_reinserts_at_the_recent_end():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, tok in ((a, 0), (b, 1), (c, 2)):
        pool.cache_block(block, hash_block_tokens(None, [tok]), [tok])
    pool.free([a, b, c])
    assert free_ids(pool) == [0, 1, 2]
    pool.touch([a])
    pool.free([a])
    # a was used again, so it is now the most recently used.
    assert free_ids(pool) == [1, 2, 0]


def test_duplicate_hash_keeps_one_cached_copy():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [5])
    assert pool.cache_block(a, h, [5])
    assert not pool.cache_block(b, h, [5])
    assert not pool.cache_block(a, h, [5])
    assert b.block_hash is None
    pool.free([a, b])
    # b holds nothing reusable: it is reused first, and evicting it leaves a's entry alone.
    (again,) = pool.allocate(1)
    assert again is b
    assert pool.lookup(h, [5]) is a


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache_block(block, hash_block_tokens(None, [1]), [1])
    assert pool.num_cached_blocks == 0


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])


def test_reset_prefix_cache_drops_only_unheld_entries():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_block(a, ha, [1])
    pool.cache_block(b, hb, [2])
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(ha, [1]) is None
    assert pool.lookup(hb, [2]) is b
    assert free_ids(pool)[0] == a.block_id


@pytest.mark.parametrize("num_blocks", [0, -1, 2.5, True])
def test_pool_size_is_validated(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
