"""The KV block pool: fixed-size blocks with reference counts, the free list, the prefix-cache map.

Every block id in ``range(num_blocks)`` is usable; none is reserved (the model runner packs
tokens without padding, so it never needs a dummy slot).

The free list is also the eviction order. It holds every block with no owner, least recently
used first. A full block whose tokens are known gets a chained hash (the parent block's hash,
this block's token ids and an optional extra key; the first block's parent is the root of its
cache partition, ``partition_root_hash``) and is registered in the hash → block map;
when its last owner lets go it stays registered in the free list, so a later request with the
same prefix can take it back out (a hit), until ``allocate`` reuses it for something else (an
eviction). Hashes are 128-bit BLAKE2b digests, and a hit is still confirmed by comparing the
stored token ids, so a crafted collision can never hand one request another's KV.

Eviction can be told to spare some hashes (``set_protected``): the cached blocks that requests
waiting to be admitted will take as prefix hits. ``allocate`` then takes unprotected free blocks
first, in the usual order, and evicts a protected one only when nothing else is free, so the
protection changes which blocks are evicted, never how many blocks can be allocated.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

BlockHash = bytes

_ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> BlockHash:
    """Chained hash of one full block: its whole prefix is folded in through ``parent_hash``.

    ``extra_key`` separates caches that must not share KV for equal tokens (a LoRA adapter, a
    tenant salt). Lengths are hashed too, so no two different inputs give the same byte stream.
    """
    h = hashlib.blake2b(parent_hash if parent_hash is not None else _ROOT_HASH, digest_size=16)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(len(extra_key).to_bytes(4, "little"))
        h.update(extra_key)
    return h.digest()


def partition_root_hash(partition: bytes) -> BlockHash | None:
    """The parent hash of a request's first block in the cache partition ``partition``
    (schemas/cache_scope.py): None, the shared root, for the empty partition. Every later hash
    is chained from it, so two partitions never produce the same block hash."""
    if not partition:
        return None
    h = hashlib.blake2b(b"partition", digest_size=16)
    h.update(len(partition).to_bytes(4, "little"))
    h.update(partition)
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of ``block_size`` KV slots. Opaque outside the pool and the cache manager."""

    block_id: int
    # Requests holding this block (a prefix shared by several requests counts each of them).
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache, together with the tokens it holds.
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """Hands out blocks, counts their owners, and keeps freed full blocks as a prefix cache.

    All operations are O(1) per block: the free list is an insertion-ordered dict keyed by
    block id, so a block can be taken out of the middle of it on a cache hit. While hashes are
    protected, an allocation also passes over the protected free blocks ahead of the ones it
    takes, O(1) each, and moves them to the recently used end, out of the way of the next one.

    Blocks are made when first handed out, so that a pool of a hundred thousand blocks costs
    nothing to create (a block object is about 0.7 µs and 100 bytes). The free list is kept in
    three parts, in eviction order: ``_front`` (freed blocks that went to the front), the blocks
    never handed out (ids ``_next_fresh`` and up, in id order: where a fresh pool starts), and
    ``_back`` (freed blocks that went to the recently used end).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._made: list[KVBlock] = []  # blocks 0 .. len - 1, made so far
        self._next_fresh = 0  # blocks from this id on were never handed out
        self._front: OrderedDict[int, KVBlock] = OrderedDict()
        self._back: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        # Eviction protection (see set_protected): the function that gives the protected hashes,
        # the hashes it gave (None until first needed), and whether every free block is known to
        # be protected, in which case allocate() has nothing to skip over.
        self._protect: Callable[[], Collection[BlockHash]] | None = None
        self._protected: Collection[BlockHash] | None = None
        self._all_free_protected = False

    def _block(self, block_id: int) -> KVBlock:
        made = self._made
        while len(made) <= block_id:
            made.append(KVBlock(len(made)))
        return made[block_id]

    @property
    def blocks(self) -> list[KVBlock]:
        """Every block, by id (made now where not yet made)."""
        self._block(self.num_blocks - 1)
        return self._made

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached (evictable) ones included."""
        return len(self._front) + (self.num_blocks - self._next_fresh) + len(self._back)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks, least recently used first, evicting their cache entries.

        While hashes are protected (``set_protected``), blocks cached under them are taken only
        after every other free block.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free")
        if num_blocks and self._protect is not None and not self._all_free_protected:
            self._defer_protected(num_blocks)
        front, back = self._front, self._back
        cached = self._cached
        out = []
        for _ in range(num_blocks):
            if front:
                _, block = front.popitem(last=False)
            elif self._next_fresh < self.num_blocks:
                block = self._block(self._next_fresh)
                self._next_fresh += 1
            else:
                _, block = back.popitem(last=False)
            if block.block_hash is not None:
                # The map may point at another block with the same hash only if this one was
                # never registered; only drop the entry that is ours.
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def set_protected(self, protected: Callable[[], Collection[BlockHash]] | None) -> None:
        """Spare the free blocks cached under some hashes from eviction until nothing else is free.

        ``protected`` returns the hashes to spare. It is called at most once per call of this
        method, and only when an allocation is about to evict a cached block, so a caller can
        install it cheaply before every scheduling step and pay for the hashes only in the steps
        that evict. None lifts the protection. Protection orders evictions and nothing else: the
        free block count, and so whether an allocation succeeds, does not depend on it.
        """
        self._protect = protected
        self._protected = None
        self._all_free_protected = False

    def _defer_protected(self, num_blocks: int) -> None:
        """Reorder the free list so that its first ``num_blocks`` blocks are unprotected ones,
        as far as there are enough of them.

        Walks the free list from its least recently used end and moves every protected block met
        before the ``num_blocks``-th unprotected one to the most recently used end, keeping their
        order among themselves. They are kept there as if a waiting request had just used them,
        which it is about to. When the walk runs out of free blocks, everything it moved is
        protected and follows every unprotected block, so the allocation then evicts protected
        blocks, least recently used first, and the walk is skipped until a block is freed again.
        Blocks never handed out hold nothing: each is unprotected.
        """
        skipped: list[int] = []
        need = self._count_unprotected(self._front, num_blocks, skipped)
        if need:
            need -= min(need, self.num_blocks - self._next_fresh)
            if need:
                need = self._count_unprotected(self._back, need, skipped)
        if need is None:
            return  # nothing to protect: plain LRU until reinstalled
        if need:
            self._all_free_protected = True
        for block_id in skipped:
            self._back[block_id] = self._unlink_free(block_id)

    def _count_unprotected(self, part: OrderedDict[int, KVBlock], need: int, skipped: list[int]) -> int | None:
        """Walk ``part`` of the free list, counting ``need`` down over its unprotected blocks and
        listing in ``skipped`` the protected ones met before it reaches 0; what is left of
        ``need``, or None when the protection turns out to hold nothing."""
        for block in part.values():
            block_hash = block.block_hash
            if block_hash is not None:
                if self._protected is None:
                    self._protected = self._protect()
                    if not self._protected:
                        self._protect = None
                        return None
                if block_hash in self._protected:
                    skipped.append(block.block_id)
                    continue
            need -= 1
            if need == 0:
                return 0
        return need

    def _unlink_free(self, block_id: int) -> KVBlock:
        """Take a free block that was handed out before out of the free list."""
        block = self._front.pop(block_id, None)
        return self._back.pop(block_id) if block is None else block

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block holding exactly ``token_ids`` under ``block_hash``, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each block (a prefix-cache hit); a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unlink_free(block.block_id)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, in the given order; unowned blocks become free.

        A cached block goes to the most-recently-used end (evicted last); an uncached one holds
        nothing reusable, so it goes to the front and is reused before any cached block.
        Callers pass a request's blocks tail first, so that its prefix outlives its suffix.
        """
        front, back = self._front, self._back
        self._all_free_protected = False
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    front[block.block_id] = block
                    front.move_to_end(block.block_id, last=False)
                else:
                    back[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under ``block_hash``.

        Returns False (and leaves the block uncached) when caching is off, the block is already
        registered, or another block holds that hash: two requests that computed the same prefix
        at once keep one cached copy, and the other is freed like any uncached block.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that nobody holds (after new weights are loaded, say).

        Blocks still held by requests keep their entries. Returns how many entries were dropped.
        """
        dropped = 0
        self._all_free_protected = False
        for block_hash, block in list(self._cached.items()):
            if block.ref_cnt == 0:
                del self._cached[block_hash]
                block.block_hash = None
                block.token_ids = None
                self._unlink_free(block.block_id)
                self._front[block.block_id] = block
                self._front.move_to_end(block.block_id, last=False)
                dropped += 1
        return dropped

    # Read-only views, for metrics and for tests that check the pool's invariants.
    def free_blocks(self) -> Iterator[KVBlock]:
        """Free blocks in eviction order (least recently used first), protection aside."""
        yield from self._front.values()
        for block_id in range(self._next_fresh, self.num_blocks):
            yield self._block(block_id)
        yield from self._back.values()

    def cached_blocks(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        return iter(self._cached.items())

    @property
    def cached_hashes(self) -> Collection[BlockHash]:
        """The hashes registered in the prefix cache, held blocks' included (a live view)."""
        return self._cached.keys()
