"""Paged attention on the GPU: Triton kernels for decode and prefill over block tables.

Same contract as ``mqinfer.kernels.attention.paged_attention`` (the PyTorch path, and the
reference these kernels are tested against): packed queries ``q`` ``[T, Hq, D]``, the new tokens
of every scheduled sequence back to back; one K and one V cache ``[num_blocks, block_size,
Hkv, D]``; each query token sees its sequence's cached tokens at positions ``0..pos`` (this
step's K/V already stored, see ``mqinfer.kernels.triton_store.store_kv``). Grouped-query
attention (``g = Hq / Hkv``) is native: K/V are never repeated.

How it works. One program computes a *tile*: up to ``BLOCK_Q`` consecutive query tokens of one
sequence, for the ``g`` query heads that share one KV head, i.e. ``BLOCK_Q * g`` rows of
queries against that KV head's keys. It walks the sequence's block table ``BLOCK_N`` keys at a
time (gathering each key through its page, so any block size works), with an online softmax in
float32 and the causal mask applied per row; it reads no key beyond its last query's position.
The grid is ``(tiles, Hkv, splits)``:

- *Prefill and mixed steps*: tiles are packed with no host sync. Sequence ``b`` owns the tiles
  from ``query_start_loc[b] // BLOCK_Q + b`` on, which are always at least
  ``ceil(query_len / BLOCK_Q)`` of them; a program finds its sequence by binary search over
  ``query_start_loc`` and spare tiles return at once. ``T // BLOCK_Q + B`` tiles in all.
- *Pure decode steps* (``T == B``: one query per sequence, known from shapes alone): tile ``b``
  is sequence ``b``. When there are too few (sequence, KV head) programs to fill the GPU and
  contexts are long, the keys are split across ``splits`` programs (flash-decoding) whose
  partial softmax states a second small kernel merges.

8-bit caches (``k_scale`` / ``v_scale`` given, ``kernels/kv_quant.py``): each tile of keys and
values is loaded as stored (int8, or float8 e4m3 as its bytes, decoded by integer arithmetic
so that every GPU and the interpreter run the same code), multiplied by its rows' float32
scales and cast to the queries' dtype before the dots; the output is in the queries' dtype.

Float32 runs its dot products in IEEE precision (no TF32), so a float32 model gets the same
answers as on the PyTorch path; half types use the tensor cores with float32 accumulation.
Tile shapes per kind of step and dtype are in ``DECODE_TILES`` / ``PREFILL_TILES``. Each call is
planned on the host as plain data (``plan_paged_attention`` -> ``KernelLaunch``) so the exact
launches can also be compiled ahead of time for a GPU that is not present.

Importing this module imports triton; callers that may run without it import it lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from mqinfer.kernels.attention import AttentionMetadata, check_attention_indices
from mqinfer.kernels.kv_quant import as_raw, check_scales, is_quantized_dtype, kernel_quant_code
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


@triton.jit
def _scale_bits(bits):
    """bfloat16 scales, handed over as their int16 bits, as float32 (exactly)."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize(x, scale, KV_QUANT: tl.constexpr):
    """Stored 8-bit rows ``x`` [N, D] (int8, or float8 e4m3 bytes) times ``scale`` [N], float32."""
    if KV_QUANT == 1:
        f = x.to(tl.float32)
    else:
        u = x.to(tl.int32)
        e = (u >> 3) & 0xF
        m = (u & 7).to(tl.float32)
        # 2^(e - 7) built from its bits (a normal float for every e), so no subnormal arithmetic.
        pow2 = ((e + 120) << 23).to(tl.float32, bitcast=True)
        f = tl.where(e == 0, m * 0.001953125, (8.0 + m) * 0.125 * pow2)
        f = tl.where((u & 0x80) != 0, -f, f)
    return f * scale[:, None]


@triton.jit
def _tile_owner(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """(sequence, its first query in this tile) of a packed prefill tile: the owner is the last
    sequence whose first tile (``query_start_loc[b] // BLOCK_Q + b``) is <= tile."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = (tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid).to(tl.int32)
        owns = mid_first_tile <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    seq = lo
    seq_first_tile = (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq).to(tl.int32)
    return seq, (tile - seq_first_tile) * BLOCK_Q


@triton.jit
def _load_kv_tile(
    head_ptr, scale_head_ptr, pages, in_page, key_valid, kv_mask, dims, stride_block, stride_slot,
    stride_s_block, stride_s_slot, like, KV_QUANT: tl.constexpr,
):
    """One tile of keys or values [BLOCK_N, HEAD_DIM_PADDED], gathered through their pages; an
    8-bit tile is dequantized by its rows' scales into the dtype of ``like`` (the queries)."""
    x = tl.load(
        head_ptr + pages[:, None] * stride_block + in_page[:, None] * stride_slot + dims[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if KV_QUANT != 0:
        scale_bits = tl.load(scale_head_ptr + pages * stride_s_block + in_page * stride_s_slot, mask=key_valid, other=0)
        x = _dequantize(x, _scale_bits(scale_bits), KV_QUANT).to(like.dtype)
    return x


@triton.jit
def _online_softmax_update(scores, m_i, l_i):
    """One step of the online softmax over a tile of (masked, log2-scaled) ``scores``: returns
    the tile's weights ``p``, the factor ``alpha`` that rescales what was accumulated so far,
    and the new running maximum and sum."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with nothing allowed yet keeps max -inf; subtracting 0 instead keeps its
    # weights at exp2(-inf) = 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _store_tile_result(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc, m_i, l_i, tokens, heads, dims, row_valid,
    dim_valid, split, stride_o_tok, stride_o_head, QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """The tile's output rows, or with splits its unnormalised partial state per (token, head,
    split), which the merge kernel combines."""
    if NUM_SPLITS > 1:
        num_heads = tl.num_programs(1) * QUERIES_PER_KV
        part = (tokens * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit
def _load_query_tile(
    q_ptr, q_start, first_q, query_len, first_pos, kv_head, dims, dim_valid, stride_q_tok, stride_q_head,
    QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The tile's queries [BLOCK_M, HEAD_DIM_PADDED] with, per row, its query head, whether it is
    a real query, its position in the sequence and its packed token row (int64)."""
    # Row r of the tile is query token first_q + r // g, query head kv_head * g + r % g.
    rows = tl.arange(0, BLOCK_M)
    q_in_seq = first_q + rows // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_in_seq < query_len)
    q_pos = first_pos + q_in_seq
    tokens = q_start + q_in_seq
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    return q, heads, row_valid, q_pos, tokens


@triton.jit
def _key_range(seq_len, first_pos, first_q, split, keys_per_split, BLOCK_Q: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Keys up to the tile's last query position; with splits, this program's share of them."""
    kv_end = tl.minimum(seq_len, first_pos + first_q + BLOCK_Q)
    if NUM_SPLITS > 1:
        kv_lo = split * keys_per_split
        kv_hi = tl.minimum(kv_end, kv_lo + keys_per_split)
    else:
        kv_lo = 0
        kv_hi = kv_end
    return kv_lo, kv_hi


# num_seqs and keys_per_split change every step: specialising on them (1, divisible by 16)
# would recompile for nothing.
@triton.jit(do_not_specialize=["num_seqs", "keys_per_split"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs, keys_per_split,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_s_block, stride_s_slot,
    stride_o_tok, stride_o_head,
    stride_table,
    BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_ONLY: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        seq = tile
        first_q = 0
    else:
        seq, first_q = _tile_owner(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if first_q >= query_len:
        return  # a spare tile of a sequence whose queries fit in fewer
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - query_len  # position of the sequence's first query token
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q, heads, row_valid, q_pos, tokens = _load_query_tile(
        q_ptr, q_start, first_q, query_len, first_pos, kv_head, dims, dim_valid, stride_q_tok, stride_q_head,
        QUERIES_PER_KV, BLOCK_Q, BLOCK_M,
    )
    kv_lo, kv_hi = _key_range(seq_len, first_pos, first_q, split, keys_per_split, BLOCK_Q, NUM_SPLITS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    # Scales are [num_blocks, block_size, Hkv] with unit stride over heads.
    k_scale_head = k_scale_ptr + kv_head
    v_scale_head = v_scale_ptr + kv_head
    for start in range(kv_lo, kv_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_hi
        pages = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_page = keys % BLOCK_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = _load_kv_tile(k_head, k_scale_head, pages, in_page, key_valid, kv_mask, dims,
                          stride_k_block, stride_k_slot, stride_s_block, stride_s_slot, q, KV_QUANT)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        allowed = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        p, alpha, m_i, l_i = _online_softmax_update(tl.where(allowed, scores, float("-inf")), m_i, l_i)
        v = _load_kv_tile(v_head, v_scale_head, pages, in_page, key_valid, kv_mask, dims,
                          stride_v_block, stride_v_slot, stride_s_block, stride_s_slot, q, KV_QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    _store_tile_result(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, acc, m_i, l_i, tokens, heads, dims,
                       row_valid, dim_valid, split, stride_o_tok, stride_o_head, QUERIES_PER_KV, HEAD_DIM_PADDED,
                       NUM_SPLITS)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < NUM_SPLITS
    m = tl.load(part_max_ptr + base + splits, mask=split_valid, other=float("-inf"))
    s = tl.load(part_sum_ptr + base + splits, mask=split_valid, other=0.0)
    # Split 0 always holds key 0, so the maximum is finite; empty splits (max -inf) weigh 0.
    weights = tl.exp2(m - tl.max(m, 0))
    dims = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.load(
        part_acc_ptr + (base + splits)[:, None] * HEAD_DIM_PADDED + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    out = tl.sum(acc * weights[:, None], 0) / tl.sum(s * weights, 0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


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
    return KernelLaunch(_paged_attention_kernel, (grid.num_tiles, k_cache.shape[2], grid.num_kv_splits), args,
                        constexprs, options)


def _merge_launch(
    out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_kv_splits: int,
    head_dim_padded: int,
) -> KernelLaunch:
    """The launch that merges the split programs' partial states into ``out``."""
    num_tokens, num_heads, head_dim = out.shape
    return KernelLaunch(
        _merge_splits_kernel,
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
