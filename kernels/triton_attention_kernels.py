"""Paged attention's device code: the Triton kernels that ``triton_attention.py`` plans and launches.

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

Float32 runs its dot products in IEEE precision (``DOT_PRECISION``, no TF32), so a float32 model
gets the same answers as on the PyTorch path; half types use the tensor cores with float32
accumulation. Scores are in base 2 (the host folds log2(e) into the scale), so the softmax uses
``exp2``.

The host side (input checks, tile shapes, the grid, the launches) is in ``triton_attention.py``;
these functions only compute. Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def paged_attention_kernel(
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
def merge_splits_kernel(
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
