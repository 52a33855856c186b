"""Paged attention on the GPU: Triton kernels for decode and prefill over block tables.

Same contract as ``mqinfer.kernels.attention.paged_attention`` (the PyTorch path, and the
reference these kernels are tested against): packed queries ``q`` ``[T, Hq, D]``, the new tokens
of every scheduled sequence back to back; one K and one V cache ``[num_blocks, block_size,
Hkv, D]``; each query token sees its sequence's cached tokens at positions ``0..pos`` (this
step's K/V already stored, see ``mqinfer.kernels.triton_store.store_kv``). Grouped-query
attention (``g = Hq / Hkv``) is native: K/V are never repeated.

The kernels themselves (how a program walks the block table, the online softmax, flash-decoding's
split and merge, 8-bit caches) are in ``triton_attention_kernels.py``; this module is their host
side: it checks the inputs, picks the tile shape (per kind of step and dtype, ``DECODE_TILES`` /
``PREFILL_TILES``) and the grid, and checks the step's indices once per step. Each call is planned
on the host as plain data (``plan_paged_attention`` -> ``KernelLaunch``) so the exact launches can
also be compiled ahead of time for a GPU that is not present.

Importing this module imports triton; callers that may run without it import it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from mqinfer.kernels.attention import AttentionMetadata, check_attention_indices
from mqinfer.kernels.kv_quant import as_raw, check_scales, is_quantized_dtype, kernel_quant_code
from mqinfer.kernels.triton_attention_kernels import merge_splits_kernel, paged_attention_kernel
from mqinfer.kernels.triton_store import KernelLaunch, run_launches, store_kv

# tl.dot needs at least 16 rows; decode tiles pad their g rows up to this.
MIN_BLOCK_M = 16


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options of the attention kernel for one kind of step and dtype.

    ``block_m``: query rows (tokens x query heads of a KV group) per prefill tile (a decode tile
    has g rows, padded to ``MIN_BLOCK_M``); ``block_n``: keys per inner step.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Chosen from ptxas's resource report for sm_90 at head_dim 128 (no register spills; see
# ``python -m mqinfer.loadgen.gpu.kernels --compile-only``), not from timings: no GPU was at
# hand when they were set. Float32 runs its dots on FMA units (IEEE), which needs smaller tiles.
DECODE_TILES = {
    "half": TileConfig(block_m=MIN_BLOCK_M, block_n=64, num_warps=4, num_stages=3),
    "float32": TileConfig(block_m=MIN_BLOCK_M, block_n=32, num_warps=4, num_stages=2),
}
PREFILL_TILES = {
    "half": TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    "float32": TileConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
}
# Flash-decoding: never give a split fewer keys than this (the merge would cost more than it
# saves), nor make more splits than this.
MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
# Aim for this many programs per streaming multiprocessor before splitting stops paying.
PROGRAMS_PER_SM = 2

_LOG2E = 1.4426950408889634



@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """How many programs share one decode sequence's keys (1 = no split).

    Splitting pays only when (sequence, KV head) programs alone leave SMs idle and each split
    still gets a long run of keys. Off the GPU (the interpreter) there is nothing to fill.
    """
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = PROGRAMS_PER_SM * _num_sms(index)
    programs = num_seqs * num_kv_heads
    if programs >= target:
        return 1
    by_occupancy = -(-target // programs)
    by_length = max_context // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


def _check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16) and not is_quantized_dtype(k_cache.dtype):
        raise ValueError(
            f"unsupported cache dtype {k_cache.dtype} (float32, float16, bfloat16, or int8 / float8_e4m3fn "
            "with scales)"
        )
    if is_quantized_dtype(k_cache.dtype) and q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"queries over an 8-bit cache must be float32, float16 or bfloat16, got {q.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the KV caches must be contiguous along head_dim")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"need seq_lens [B] and query_start_loc [B + 1] with B >= 1, got "
            f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if q.shape[0] < num_seqs:
        raise ValueError(f"{q.shape[0]} query tokens cannot cover {num_seqs} sequences")
    named = (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables))
    for name, t in named:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dim() == 1 and t.stride(0) != 1 or t.dim() == 2 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"the KV caches are on {k_cache.device} but q is on {q.device}")


@dataclass(frozen=True)
class _TileGrid:
    """How one call is cut into programs: ``num_tiles`` tiles of ``block_q`` query tokens
    (``block_m`` rows, padded), each over ``num_kv_splits`` programs of ``keys_per_split`` keys
    (0 without a split)."""

    decode_only: bool
    block_q: int
    block_m: int
    num_tiles: int
    num_kv_splits: int
    keys_per_split: int


def _plan_grid(
    num_tokens: int,
    num_seqs: int,
    g: int,
    num_kv_heads: int,
    max_context: int,
    tile: TileConfig,
    num_kv_splits: int | None,
    device: torch.device,
) -> _TileGrid:
    """The tiles of a pure decode step (one per sequence, keys maybe split; ``max_context`` bounds
    its contexts) or of a prefill / mixed step (packed, never split)."""
    decode_only = num_tokens == num_seqs
    if decode_only:
        block_q = 1
        block_m = max(MIN_BLOCK_M, triton.next_power_of_2(g))
        num_tiles = num_seqs
        if num_kv_splits is None:
            num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_context, device)
        if num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    else:
        block_q = max(1, tile.block_m // g)
        block_m = max(MIN_BLOCK_M, triton.next_power_of_2(block_q * g))
        num_tiles = num_tokens // block_q + num_seqs
        num_kv_splits = 1
        max_context = 0

    keys_per_split = 0
    if num_kv_splits > 1:
        # Whole inner steps per split; rounding up may leave fewer splits than asked.
        keys_per_split = triton.cdiv(triton.cdiv(max_context, num_kv_splits), tile.block_n) * tile.block_n
        num_kv_splits = triton.cdiv(max_context, keys_per_split)
    return _TileGrid(decode_only, block_q, block_m, num_tiles, num_kv_splits, keys_per_split)


def _split_partials(
    out: torch.Tensor, num_kv_splits: int, head_dim_padded: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accumulators, maxima, sums) of the split programs' partial softmax states; without a
    split the output stands in for all three (the kernel writes the output directly)."""
    if num_kv_splits <= 1:
        return out, out, out
    num_tokens, num_heads, _ = out.shape
    num_partials = num_tokens * num_heads * num_kv_splits
    part_acc = torch.empty(num_partials, head_dim_padded, dtype=torch.float32, device=out.device)
    part_max = torch.empty(num_partials, dtype=torch.float32, device=out.device)
    part_sum = torch.empty_like(part_max)
    return part_acc, part_max, part_sum


def _attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    indices: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    grid: _TileGrid,
    tile: TileConfig,
    kv_quant: int,
    head_dim_padded: int,
) -> KernelLaunch:
    """The attention kernel's launch; ``indices`` are (block_tables, seq_lens, query_start_loc)."""
    block_tables, seq_lens, _ = indices
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if kv_quant else (0, 0)
    args = (
        q,
        as_raw(k_cache),
        as_raw(v_cache),
        k_scale.view(torch.int16) if kv_quant else q,  # not read without quantization
        v_scale.view(torch.int16) if kv_quant else q,
        out,
        *partials,
        *indices,
        scale * _LOG2E,
        seq_lens.shape[0],
        grid.keys_per_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        out.stride(0), out.stride(1),
        block_tables.stride(0),
    )
    constexprs = dict(
        BLOCK_SIZE=k_cache.shape[1],
        QUERIES_PER_KV=q.shape[1] // k_cache.shape[2],
        HEAD_DIM=q.shape[2],
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_Q=grid.block_q,
        BLOCK_M=grid.block_m,
        BLOCK_N=tile.block_n,
        DECODE_ONLY=grid.decode_only,
        NUM_SPLITS=grid.num_kv_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_QUANT=kv_quant,
    )
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return KernelLaunch(paged_attention_kernel, (grid.num_tiles, k_cache.shape[2], grid.num_kv_splits), args,
                        constexprs, options)


def _merge_launch(
    out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_kv_splits: int,
    head_dim_padded: int,
) -> KernelLaunch:
    """The launch that merges the split programs' partial states into ``out``."""
    num_tokens, num_heads, head_dim = out.shape
    return KernelLaunch(
        merge_splits_kernel,
        (num_tokens, num_heads),
        (*partials, out, out.stride(0), out.stride(1)),
        dict(
            NUM_SPLITS=num_kv_splits,
            SPLITS_PADDED=max(2, triton.next_power_of_2(num_kv_splits)),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
        ),
        {"num_warps": 1 if head_dim_padded <= 64 else 2},
    )


def plan_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    tile: TileConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """Check the inputs of ``paged_attention_tensors`` and plan its launches.

    Returns the (not yet written) output tensor and the launches that fill it, in order.
    ``tile`` overrides the tile configuration (for tuning runs).
    """
    _check_attention_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    kv_quant = kernel_quant_code(k_cache.dtype)
    if kv_quant or k_scale is not None:
        check_scales(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    # Over an 8-bit cache the tiles are dequantized into the queries' dtype.
    compute_dtype = q.dtype if kv_quant else k_cache.dtype
    q = q.to(compute_dtype)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=compute_dtype, device=q.device)

    if tile is None:
        tiles = DECODE_TILES if num_tokens == num_seqs else PREFILL_TILES
        tile = tiles["float32" if compute_dtype == torch.float32 else "half"]
    max_context = block_tables.shape[1] * block_size  # a bound known without a sync
    grid = _plan_grid(num_tokens, num_seqs, num_heads // num_kv_heads, num_kv_heads, max_context, tile,
                      num_kv_splits, q.device)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    partials = _split_partials(out, grid.num_kv_splits, head_dim_padded)
    launches = [
        _attention_launch(q, k_cache, v_cache, k_scale, v_scale, out, partials,
                          (block_tables, seq_lens, query_start_loc), scale, grid, tile, kv_quant, head_dim_padded)
    ]
    if grid.num_kv_splits > 1:
        launches.append(_merge_launch(out, partials, grid.num_kv_splits, head_dim_padded))
    return out, launches


def _check_query_layout(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    num_tokens: int,
) -> None:
    """The per-sequence indices the attention kernel reads besides the block ids: each sequence's
    query rows (``query_start_loc`` rises from 0 to ``num_tokens``, at least one query each) and
    its keys (``seq_lens`` no shorter than its queries, no longer than the block tables cover).
    One transfer to the host for all of them."""
    starts = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    first, last, min_query, min_context, max_len = torch.stack(
        (starts[0], starts[-1], query_lens.min(), (lens - query_lens).min(), lens.max())
    ).tolist()
    if first != 0 or last != num_tokens or min_query < 1:
        raise ValueError(
            f"query_start_loc must rise from 0 to the {num_tokens} query tokens by at least 1 per sequence, "
            f"got {query_start_loc.tolist()}"
        )
    if min_context < 0:
        raise ValueError("seq_lens must be at least each sequence's number of query tokens")
    capacity = block_tables.shape[1] * block_size
    if max_len > capacity:
        raise ValueError(
            f"seq_lens must lie within the block tables ({block_tables.shape[1]} blocks of {block_size}: "
            f"{capacity} tokens), got up to {max_len}"
        )


def _check_step_indices(metadata: AttentionMetadata, num_tokens: int, num_blocks: int) -> None:
    """Every index the kernels read, checked once per step (per metadata and cache size), not
    per layer: the checks of the native CPU kernel (``check_attention_indices``: sequence ids,
    positions within the table's width, block ids within the cache) and the query layout and
    context lengths this kernel reads instead of positions. On a GPU these are a few host syncs
    per step."""
    if metadata.triton_checked_blocks == num_blocks:
        return
    if metadata.seq_of_token is None:
        raise ValueError("attention metadata has no seq_of_token (build it with build_attention_metadata)")
    tables = metadata.block_tables
    if metadata.seq_of_token.shape != (num_tokens,) or metadata.positions.shape != (num_tokens,):
        raise ValueError(
            f"seq_of_token {tuple(metadata.seq_of_token.shape)} and positions {tuple(metadata.positions.shape)} "
            f"must have one entry per query token ({num_tokens})"
        )
    if num_tokens:
        check_attention_indices(
            metadata, tables, metadata.seq_of_token, metadata.positions, num_blocks, metadata.block_size
        )
    _check_query_layout(metadata.query_start_loc, metadata.seq_lens, tables, metadata.block_size, num_tokens)
    metadata.triton_checked_blocks = num_blocks


def paged_attention_tensors(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of packed queries, from the raw tensors of ``AttentionMetadata``.

    ``query_start_loc`` ``[B + 1]``, ``seq_lens`` ``[B]`` and ``block_tables`` ``[B, max_blocks]``
    mean what they mean there, and as there every sequence has at least one query token (a
    step is taken for pure decode when ``T == B``). Returns ``[T, Hq, D]`` in the cache's dtype
    (the queries' dtype over an 8-bit cache, whose scales are ``k_scale`` / ``v_scale``).
    ``num_kv_splits`` forces the decode key split (it applies only to pure decode steps); by
    default it is chosen from the GPU's size. Never syncs with the host, and trusts the values
    of its indices: ``paged_attention`` checks them once per step.
    """
    out, launches = plan_paged_attention(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_kv_splits,
        k_scale=k_scale, v_scale=v_scale,
    )
    run_launches(launches, out.device)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``mqinfer.kernels.attention.paged_attention`` on the GPU (same arguments).

    The kernels read the metadata's ``query_start_loc``, ``seq_lens`` and ``block_tables`` (not
    its SDPA groups); every index in the metadata is checked once per step and cache size
    (``_check_step_indices``), so a bad one is a ValueError, never a read outside the cache.
    """
    g = metadata.num_queries_per_kv
    if q.dim() == 3 and k_cache.dim() == 4 and q.shape[1] != g * k_cache.shape[2]:
        raise ValueError(
            f"{q.shape[1]} query heads do not match {k_cache.shape[2]} KV heads x "
            f"{metadata.num_queries_per_kv} queries per KV head"
        )
    if k_cache.dim() == 4 and k_cache.shape[1] != metadata.block_size:
        raise ValueError(
            f"the cache has blocks of {k_cache.shape[1]} tokens but the metadata was built for "
            f"{metadata.block_size}"
        )
    out, launches = plan_paged_attention(
        q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
        num_kv_splits, k_scale=k_scale, v_scale=v_scale,
    )
    # Planning checked the tensors' shapes; their values are checked before a kernel reads them.
    _check_step_indices(metadata, q.shape[0], k_cache.shape[0])
    run_launches(launches, out.device)
    return out


__all__ = [
    "DECODE_TILES",
    "PREFILL_TILES",
    "TileConfig",
    "choose_num_kv_splits",
    "paged_attention",
    "paged_attention_tensors",
    "plan_paged_attention",
    "store_kv",
]
