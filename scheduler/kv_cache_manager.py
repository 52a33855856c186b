"""The KV cache manager: which blocks each request holds, prefix-cache lookups, slot allocation.

The scheduler talks to the cache only through this narrow API: ``get_computed_blocks`` (the
prefix-cache hits for a request about to be admitted), ``allocate_slots`` (room for the tokens
of this step, or "no" so that the scheduler preempts), ``free`` and ``usage``. This class is
the only code that changes ``Request.block_ids``.

A block is registered in the prefix cache once it is full of *computed* tokens, that is,
tokens whose KV an earlier step has written. Caching a block while the step that writes it
is still to run would let another request in that same step read it before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence

from mqinfer.scheduler.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from mqinfer.scheduler.request import Request


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Chained hashes of a request's full blocks, computed once and kept across preemptions
        # (its tokens only ever grow), dropped when it finishes.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each request were already offered to the prefix cache.
        self._req_num_cached: dict[str, int] = {}
        # Prompt tokens looked up / found in the prefix cache, once per request at its first
        # admission, told by ``num_cached_tokens`` still being unset (the scheduler sets it right
        # after); re-admissions after a preemption are not counted.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Prefix-cache hits for a request that holds no blocks: (blocks, number of tokens).

        Only whole blocks count, and never all of the request's tokens: the last one is always
        left to compute so that the step has logits to sample from. Nothing is reserved yet; pass
        the blocks to ``allocate_slots`` in the same step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        num_blocks = (request.num_tokens - 1) // bs
        if num_blocks <= 0:
            return [], 0
        hashes = self._block_hashes(request, num_blocks)
        tokens = request.all_token_ids
        lookup = self.block_pool.lookup
        hits: list[KVBlock] = []
        for i in range(num_blocks):
            block = lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] | None = None,
        num_reserved_blocks: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (only when
        admitting a request); they count as computed tokens ahead of the new ones. Returns False,
        changing nothing, unless at least ``num_reserved_blocks`` blocks would still be free
        afterwards.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        hits = new_computed_blocks or ()
        num_computed = request.num_computed_tokens + len(hits) * bs
        num_required = -(-(num_computed + num_new_tokens) // bs)

        if blocks is not None and not hits and num_required <= len(blocks) and not num_reserved_blocks:
            # The common decode step: the token fits in a block already held.
            if self.enable_prefix_caching and num_computed // bs > self._req_num_cached.get(rid, 0):
                self._cache_full_blocks(request, blocks, num_computed // bs)
            return True

        pool = self.block_pool
        if hits and blocks:
            raise ValueError(f"request {rid!r} already holds blocks; prefix hits are only for admission")
        num_new_blocks = num_required - len(hits) - (len(blocks) if blocks else 0)
        if num_new_blocks < 0:
            num_new_blocks = 0
        # Hits nobody holds sit in the free list: taking them shrinks what is left to allocate.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
        if num_new_blocks + num_evictable_hits + num_reserved_blocks > pool.num_free_blocks:
            return False

        if blocks is None:
            blocks = self._req_blocks[rid] = []
            request.block_ids = []
            if request.num_cached_tokens < 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * bs
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            request.block_ids.extend(b.block_id for b in hits)
            self._req_num_cached[rid] = len(hits)
        if num_new_blocks:
            new_blocks = pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            request.block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_prefix_caching and num_computed // bs > self._req_num_cached.get(rid, 0):
            self._cache_full_blocks(request, blocks, num_computed // bs)
        return True

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (after it finished, or to preempt it).

        Its full computed blocks are cached first, so a preempted request usually finds its own
        prefix again when it is re-admitted. Call it after setting the request's new status: a
        finished request's hashes are dropped, a preempted one's are kept.
        """
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, None)
        if blocks:
            if self.enable_prefix_caching:
                self._cache_full_blocks(request, blocks, request.num_computed_tokens // self.block_size)
            # Tail first: the prefix, the part other requests may share, is evicted last.
            self.block_pool.free(reversed(blocks))
        request.block_ids = []
        self._req_num_cached.pop(rid, None)
        if request.status.is_finished:
            self._req_hashes.pop(rid, None)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def owned_blocks(self, request_id: str) -> list[KVBlock]:
        """The blocks a request holds, in position order (a copy, for inspection)."""
        return list(self._req_blocks.get(request_id, ()))

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_blocks`` blocks (which must be full)."""
        rid = request.request_id
        hashes = self._req_hashes.get(rid)
        if hashes is None:
            hashes = self._req_hashes[rid] = []
        if len(hashes) < num_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        rid = request.request_id
        start = self._req_num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        bs = self.block_size
        tokens = request.all_token_ids
        cache_block = self.block_pool.cache_block
        for i in range(start, num_full):
            block = blocks[i]
            if block.block_hash is None:
                cache_block(block, hashes[i], tokens[i * bs : (i + 1) * bs])
        self._req_num_cached[rid] = num_full
