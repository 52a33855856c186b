"""The KV cache manager: which blocks each request holds, prefix-cache lookups, slot allocation.

The scheduler talks to the cache only through this narrow API: ``get_computed_blocks`` (the
prefix-cache hits for a request about to be admitted), ``allocate_slots`` (room for the tokens
of this step, or "no" so that the scheduler preempts), ``swap_out`` / ``swap_in`` (swap
preemption), ``free`` and ``usage``. This class is the only code that changes
``EngineRequest.block_ids``. With ``protect_prefix_hits`` the scheduler names the waiting requests it
will admit next; allocations then evict the cached blocks those would hit only when nothing
else is free.

Swap preemption keeps a second, host-memory pool of blocks (no prefix caching there). Swapping
out allocates one host block per device block that holds computed KV and releases the device
blocks the way ``free`` does, so their full blocks stay in the prefix cache; swapping in takes
back whichever of those are still cached as hits and copies only the rest. The manager only
decides which blocks go where; it returns the block pairs, and the model runner copies.

Requests share cached blocks only within a cache partition (schemas/cache_scope.py): under the
scope ``tenant`` (the default) a request's tenant and cache salt, under ``global`` its salt alone.
The partition is the root of the request's chained block hashes, so it separates the device cache
and every tier below it alike.

A block is registered in the prefix cache once it is full of *computed* tokens, that is,
tokens whose KV an earlier step has written. Caching a block while the step that writes it
is still to run would let another request in that same step read it before it is written.

Tiers below the device pool (``attach_tiers``: host memory, disk, a shared directory; the
workers layer implements ``LowerTiers``) extend the prefix cache. A lookup walks each block
through the device pool first and then the tiers; a block only a tier holds is a ``TierBlock``
hit, which ``allocate_slots`` turns into a new device block and has the tiers copy up before it
returns (so before the step's forward pass). If a tier cannot deliver it after all (a corrupt
or vanished blob), the admission is refused for this step, changing nothing; the next lookup no
longer finds it. Prompt blocks are written through to the tiers as they become cached (their KV
computed), so a block the device pool evicts is already below it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition, check_scope
from mqinfer.scheduler.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens, partition_root_hash
from mqinfer.scheduler.request import EngineRequest

# (device block id, block hash, token ids) of one block to copy between the device and the tiers.
BlockCopy = tuple[int, BlockHash, tuple[int, ...]]


class LowerTiers(Protocol):
    """KV tiers below the device pool, keyed by the chained block hash (see the module docstring)."""

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether some tier holds the block (cheap: no read, no check of its contents)."""
        ...

    def load(self, blocks: Sequence[BlockCopy]) -> list[str]:
        """Copy the blocks into those device blocks, in order, stopping at the first one no tier
        can deliver whole and of these tokens; the names of the tiers that served each block
        copied (fewer than asked: the rest were not)."""
        ...

    def store(self, blocks: Sequence[BlockCopy]) -> None:
        """Keep a copy of these device blocks, whose KV is computed, in the tiers."""
        ...


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A prefix-cache hit that only a tier below the device pool holds; ``allocate_slots`` gives
    it a device block and copies it up."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    ref_cnt = 1  # never counted as an evictable device block


class KVCacheManager:
    def __init__(
        self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True, num_swap_blocks: int = 0,
        prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Who shares cached blocks: a request's first block hash is chained from the root of its
        # partition (its tenant under "tenant", and its cache salt), so every block hash, here and
        # in the tiers below, belongs to one partition.
        self.prefix_cache_scope = check_scope(prefix_cache_scope)
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
        if not isinstance(num_swap_blocks, int) or isinstance(num_swap_blocks, bool) or num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {num_swap_blocks!r}")
        self.swap_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        # Host blocks of each swapped-out request, in position order.
        self._req_swap_blocks: dict[str, list[KVBlock]] = {}
        self.tiers: LowerTiers | None = None
        # Prompt tokens served by each tier below the device pool (first admissions only).
        self.tier_hit_tokens: dict[str, int] = {}

    def attach_tiers(self, tiers: LowerTiers | None) -> None:
        """Extend the prefix cache with tiers below the device pool (None: none)."""
        if tiers is not None and not self.enable_prefix_caching:
            raise ValueError("KV tiers extend the prefix cache: they need prefix caching on")
        self.tiers = tiers

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: EngineRequest) -> tuple[list[KVBlock | TierBlock], int]:
        """Prefix-cache hits for a request that holds no blocks: (blocks, number of tokens).

        Only whole blocks count, and never all of the request's tokens: the last one is always
        left to compute so that the step has logits to sample from. Nothing is reserved yet; pass
        the blocks to ``allocate_slots`` in the same step. With tiers attached, blocks that only a
        tier holds are ``TierBlock`` hits.
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
        tiers = self.tiers
        hits: list[KVBlock | TierBlock] = []
        for i in range(num_blocks):
            block = lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block is None:
                if tiers is None or not tiers.contains(hashes[i]):
                    break
                block = TierBlock(hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: EngineRequest,
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
        # A tier hit needs a new block like a token to compute does.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
        num_tier_hits = sum(1 for b in hits if type(b) is TierBlock) if hits else 0
        if num_new_blocks + num_tier_hits + num_evictable_hits + num_reserved_blocks > pool.num_free_blocks:
            return False
        served: list[str] = []
        if num_tier_hits:
            t0 = time.perf_counter()
            hits, served = self._copy_up(hits, num_tier_hits)
            request.tier_load_s += time.perf_counter() - t0
            if not hits:
                return False

        if blocks is None:
            blocks = self._req_blocks[rid] = []
            request.block_ids = []
            if request.num_cached_tokens < 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * bs
                if served:
                    self._count_tier_hits(request, served)
        if hits:
            if not served:
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

    def _copy_up(self, hits: list, num_tier_hits: int) -> tuple[list[KVBlock], list[str]]:
        """Give the tier hits device blocks and have the tiers copy them there: (the hits, all
        device blocks now, each owned once more; the tier that served each copied block). When a
        tier cannot deliver one, everything is given back and the hits are empty."""
        pool = self.block_pool
        device_hits = [b for b in hits if type(b) is not TierBlock]
        pool.touch(device_hits)  # first, so that the allocation cannot evict them
        fresh = pool.allocate(num_tier_hits)
        resolved: list[KVBlock] = []
        copies = []
        new_blocks = iter(fresh)
        for b in hits:
            if type(b) is TierBlock:
                block = next(new_blocks)
                copies.append((block.block_id, b.block_hash, b.token_ids))
                b = block
            resolved.append(b)
        served = self.tiers.load(copies)
        if len(served) < len(copies):
            pool.free(fresh)
            pool.free(device_hits)
            return [], []
        for block, (_, block_hash, token_ids) in zip(fresh, copies):
            pool.cache_block(block, block_hash, token_ids)
        return resolved, served

    def _count_tier_hits(self, request: EngineRequest, served: list[str]) -> None:
        bs = self.block_size
        per_tier: dict[str, int] = {}
        for tier in served:
            per_tier[tier] = per_tier.get(tier, 0) + bs
        request.tier_cached_tokens = per_tier
        for tier, n in per_tier.items():
            self.tier_hit_tokens[tier] = self.tier_hit_tokens.get(tier, 0) + n

    def free(self, request: EngineRequest) -> None:
        """Release every block of ``request`` (after it finished, or to preempt it).

        Its full computed blocks are cached first, so a preempted request usually finds its own
        prefix again when it is re-admitted. Call it after setting the request's new status: a
        finished request's hashes are dropped, a preempted one's are kept. Host blocks of a
        swapped-out request are released too: its KV is gone, so it must recompute.
        """
        rid = request.request_id
        self._release_device_blocks(request)
        host_blocks = self._req_swap_blocks.pop(rid, None)
        if host_blocks:
            self.swap_pool.free(host_blocks)
        if request.status.is_finished:
            self._req_hashes.pop(rid, None)

    def trim(self, request: EngineRequest, num_tokens: int) -> int:
        """Give back the request's blocks past those ``num_tokens`` tokens need (slots written for
        proposed tokens that were rejected). Returns the number of blocks freed.

        Only blocks past the computed tokens can go, and those were never offered to the prefix
        cache (a block is cached once full of computed tokens), so no cached hash ever covers a
        rejected token.
        """
        blocks = self._req_blocks.get(request.request_id)
        keep = self.num_blocks_for(max(num_tokens, request.num_computed_tokens))
        if not blocks or len(blocks) <= keep:
            return 0
        extra = blocks[keep:]
        del blocks[keep:]
        del request.block_ids[keep:]
        self.block_pool.free(reversed(extra))
        return len(extra)

    def _release_device_blocks(self, request: EngineRequest) -> None:
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, None)
        if blocks:
            if self.enable_prefix_caching:
                self._cache_full_blocks(request, blocks, request.num_computed_tokens // self.block_size)
            # Tail first: the prefix, the part other requests may share, is evicted last.
            self.block_pool.free(reversed(blocks))
        request.block_ids = []
        self._req_num_cached.pop(rid, None)

    # -- swap preemption ----------------------------------------------------------------------
    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.num_blocks if self.swap_pool is not None else 0

    @property
    def num_free_swap_blocks(self) -> int:
        return self.swap_pool.num_free_blocks if self.swap_pool is not None else 0

    def is_swapped_out(self, request: EngineRequest) -> bool:
        return request.request_id in self._req_swap_blocks

    def swap_out(self, request: EngineRequest) -> list[tuple[int, int]] | None:
        """Move the computed KV of a request being preempted to host blocks.

        Returns the (device block, host block) pairs to copy, in position order, and releases
        the request's device blocks (as ``free`` does; set its status to PREEMPTED first). The
        copies must run before any later write to those device blocks. Returns None, changing
        nothing, when the host pool is missing or too full, or there is no computed KV to keep:
        the caller then preempts by recompute.
        """
        rid = request.request_id
        if rid in self._req_swap_blocks:
            raise ValueError(f"request {rid!r} is already swapped out")
        blocks = self._req_blocks.get(rid)
        num_needed = self.num_blocks_for(request.num_computed_tokens)
        if self.swap_pool is None or not blocks or num_needed == 0 or num_needed > self.swap_pool.num_free_blocks:
            return None
        if num_needed > len(blocks):
            raise ValueError(
                f"request {rid!r} has {request.num_computed_tokens} computed tokens but holds only "
                f"{len(blocks)} blocks of {self.block_size}"
            )
        host_blocks = self.swap_pool.allocate(num_needed)
        self._req_swap_blocks[rid] = host_blocks
        pairs = [(d.block_id, h.block_id) for d, h in zip(blocks, host_blocks)]
        self._release_device_blocks(request)
        return pairs

    def swap_in(
        self, request: EngineRequest, num_new_tokens: int, num_reserved_blocks: int = 0
    ) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request's KV back and make room for ``num_new_tokens`` more tokens.

        Leading full blocks still in the prefix cache are taken as hits (no copy); the other
        computed blocks get new device blocks. Returns the (host block, device block) pairs to
        copy, which must run before the step's forward pass, and frees the host blocks. Returns
        None, changing nothing, unless at least ``num_reserved_blocks`` device blocks would
        still be free afterwards.
        """
        rid = request.request_id
        host_blocks = self._req_swap_blocks.get(rid)
        if host_blocks is None:
            raise ValueError(f"request {rid!r} is not swapped out")
        if rid in self._req_blocks:
            raise ValueError(f"request {rid!r} already holds device blocks")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        num_computed = request.num_computed_tokens
        hits, _ = self.get_computed_blocks(request)
        # Only device blocks whose KV the request had computed can stand in for its host copies.
        del hits[num_computed // bs :]
        for i, b in enumerate(hits):
            if type(b) is TierBlock:
                del hits[i:]
                break
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(hits)
        pool = self.block_pool
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits + num_reserved_blocks > pool.num_free_blocks:
            return None

        pool.touch(hits)
        blocks = hits + pool.allocate(num_new_blocks)
        self._req_blocks[rid] = blocks
        request.block_ids = [b.block_id for b in blocks]
        pairs = [(host_blocks[i].block_id, blocks[i].block_id) for i in range(len(hits), len(host_blocks))]
        del self._req_swap_blocks[rid]
        # Freed now, reused at the earliest by a later swap-out, whose copy the runner executes
        # after this one.
        self.swap_pool.free(host_blocks)
        self._req_num_cached[rid] = len(hits)
        if self.enable_prefix_caching:
            # Registered before the copy has run: the runner copies before the forward pass, so
            # no request can read these blocks before they hold the KV (nor can the tiers, which
            # got these blocks when they were first cached).
            self._cache_full_blocks(request, blocks, num_computed // bs, store=False)
        return pairs

    def next_block_hash(self, request: EngineRequest, first_uncomputed_block: int) -> BlockHash | None:
        """The prefix hash of the request's block ``first_uncomputed_block`` when that block is
        full and not its last token's (the next block it would compute that another request with
        the same prefix could reuse), else None; None also without prefix caching."""
        if not self.enable_prefix_caching or (first_uncomputed_block + 1) * self.block_size > request.num_tokens - 1:
            return None
        return self._block_hashes(request, first_uncomputed_block + 1)[first_uncomputed_block]

    def protect_prefix_hits(self, requests: Callable[[], Iterable[EngineRequest]] | None) -> None:
        """Evict the cached blocks that ``requests()`` would take as prefix hits only after every
        other free block, until called again; None lifts the protection.

        ``requests`` is called at most once, and only when an allocation is about to evict a
        cached block, so installing it costs nothing in a step that evicts nothing. The
        protection decides which free blocks are evicted first, never how many blocks are free.
        Without prefix caching there is nothing to protect and this does nothing.
        """
        if not self.enable_prefix_caching:
            return
        if requests is None:
            self.block_pool.set_protected(None)
        else:
            self.block_pool.set_protected(lambda: self.prefix_hit_hashes(requests()))

    def prefix_hit_hashes(self, requests: Iterable[EngineRequest]) -> set[BlockHash]:
        """Hashes of the cached blocks these requests would take as prefix hits right now.

        For each request, the leading run of its full blocks (as ``get_computed_blocks`` counts
        them: never the block of its last token) whose hashes are in the prefix cache; a hit
        needs every block before it, so nothing past the first uncached block counts. Block
        hashes are computed once per request and kept, as for its lookups. Tokens are not
        compared: a hash collision could only protect a block that did not need it.
        """
        if not self.enable_prefix_caching:
            return set()
        bs = self.block_size
        cached = self.block_pool.cached_hashes
        out: set[BlockHash] = set()
        for request in requests:
            num_blocks = (request.num_tokens - 1) // bs
            if num_blocks <= 0:
                continue
            hashes = self._block_hashes(request, num_blocks)
            for i in range(num_blocks):
                block_hash = hashes[i]
                if block_hash not in cached:
                    break
                out.add(block_hash)
        return out

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def owned_blocks(self, request_id: str) -> list[KVBlock]:
        """The blocks a request holds, in position order (a copy, for inspection)."""
        return list(self._req_blocks.get(request_id, ()))

    def root_hash(self, request: EngineRequest) -> BlockHash | None:
        """The parent hash of the request's first block: the root of its cache partition."""
        return partition_root_hash(cache_partition(self.prefix_cache_scope, request.tenant, request.cache_salt))

    def _block_hashes(self, request: EngineRequest, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_blocks`` blocks (which must be full)."""
        rid = request.request_id
        hashes = self._req_hashes.get(rid)
        if hashes is None:
            hashes = self._req_hashes[rid] = []
        if len(hashes) < num_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else self.root_hash(request)
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request: EngineRequest, blocks: list[KVBlock], num_full: int,
                           store: bool = True) -> None:
        """Register the request's full computed blocks from the first not yet offered; with tiers
        (and ``store``), write the prompt's newly registered ones through to them."""
        rid = request.request_id
        start = self._req_num_cached.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        bs = self.block_size
        tokens = request.all_token_ids
        cache_block = self.block_pool.cache_block
        # Prompt blocks are what later requests share; generated ones come back, if ever, as part
        # of a later prompt (a chat's next turn), and are written through then.
        num_prompt_blocks = request.num_prompt_tokens // bs if store and self.tiers is not None else 0
        stores = []
        for i in range(start, num_full):
            block = blocks[i]
            if block.block_hash is None:
                block_tokens = tokens[i * bs : (i + 1) * bs]
                if cache_block(block, hashes[i], block_tokens) and i < num_prompt_blocks:
                    stores.append((block.block_id, hashes[i], tuple(block_tokens)))
        self._req_num_cached[rid] = num_full
        if stores:
            self.tiers.store(stores)
