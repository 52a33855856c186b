"""Attention over a paged KV cache on CPU (and the reference for the Triton path).

Owns the cache write (``store_kv``), the per-step attention metadata (``AttentionMetadata``,
built once per step by ``build_attention_metadata`` and shared by every layer), the batched
attention itself (``paged_attention``) with its two CPU backends, and a naive,
obviously-correct ``reference_paged_attention`` that the tests hold both backends to.

Layout. One K and one V cache per layer, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``pos`` of a sequence lives in slot ``block_table[pos // block_size] *
block_size + pos % block_size``. Queries come packed: ``[T, num_heads, head_dim]``, the new
tokens of every scheduled sequence back to back, no padding.

The native backend (the default on CPU where a C compiler is found): a small C kernel, built
once per machine and cached, that reads the paged cache in place, one (token, KV head) at a
time, with no gather, no padding and float32 accumulation; AVX-512 versions for the common
head shapes. Profiling the standard benchmark showed the PyTorch backend spending more time
gathering and padding KV for decode steps than in the model's matmuls.

The PyTorch backend. Sequences are split into a few *groups* once per step (decode tokens
together, prefill chunks together, each sorted by length and cut so that no gathered tensor
grows past a budget). Per group and layer there are exactly three large ops: gather the
group's KV blocks into a reused workspace, one masked ``scaled_dot_product_attention``, and a
scatter of the valid rows back into the packed output. Grouped-query attention never repeats
K/V: the ``g = num_heads / num_kv_heads`` query heads that share a KV head are folded into the
query-length axis, so SDPA sees ``[B, Hkv, g * Q, D]`` against ``[B, Hkv, L, D]``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

# Upper bound on (sequences x padded context tokens) gathered in one SDPA call, so the K/V
# workspace stays a few hundred MiB even for 128 long sequences.
DEFAULT_MAX_GATHER_TOKENS = 1 << 17
# Upper bound on the score matrix of one call (sequences x g x query rows x context), elements.
DEFAULT_MAX_SCORE_ELEMENTS = 1 << 26


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``, ``v`` (``[T, Hkv, D]``) into the caches at ``slot_mapping`` (``[T]``)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class AttentionWorkspace:
    """Reusable gather buffers for K and V.

    Large fresh allocations on CPU are page-faulted in on every use (glibc hands them out by
    mmap), which costs more than the gather itself; keeping one buffer per step shape class
    and slicing it makes the gather a plain memory copy. Owned by the model runner (one per
    runner), never shared across threads.
    """

    def __init__(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def buffers(
        self, num_elements: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv
        if kv is None or kv[0].numel() < num_elements or kv[0].dtype != dtype or kv[0].device != device:
            kv = self._kv = (
                torch.empty(num_elements, dtype=dtype, device=device),
                torch.empty(num_elements, dtype=dtype, device=device),
            )
        return kv[0][:num_elements], kv[1][:num_elements]


@dataclass
class AttentionGroup:
    """Sequences that go through one SDPA call (tensors built once per step, used per layer).

    ``block_ids`` ``[Bg * nb]``: the KV blocks of each sequence, padded with block 0.
    ``query_rows`` ``[Bg * Qg]``: packed-token row of each (padded) query; padding reads row 0.
    ``mask`` ``[Bg, 1, g * Qg, nb * block_size]``: True where a query may attend to a key.
    ``out_rows`` / ``out_tokens``: which rows of the padded output are real, and where they go
    in the packed output. ``identity`` marks a group whose queries are exactly the packed rows
    in order with one query per sequence (a pure decode step): no gather or scatter needed.
    """

    num_seqs: int
    max_query_len: int
    num_blocks: int
    block_ids: torch.Tensor
    query_rows: torch.Tensor
    mask: torch.Tensor
    out_rows: torch.Tensor
    out_tokens: torch.Tensor
    identity: bool


class AttentionMetadata:
    """Everything attention needs about one step's packed batch (shared by all layers).

    ``query_start_loc`` ``[B + 1]``: offsets of each sequence's tokens in the packed batch.
    ``seq_lens`` ``[B]``: context length including this step's tokens.
    ``block_tables`` ``[B, max_blocks]``: KV block ids in position order, padded with 0.
    ``slot_mapping``, ``positions``, ``seq_of_token`` ``[T]``: cache slot, position and sequence
    index of every packed token.
    ``groups``: the SDPA groups of the PyTorch path, planned on first use (the native CPU
    kernel and the Triton kernels never need them, so they cost nothing there).
    """

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        num_queries_per_kv: int,
        seq_of_token: torch.Tensor | None = None,
        workspace: AttentionWorkspace | None = None,
        plan: Callable[[], list[AttentionGroup]] | None = None,
    ) -> None:
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.slot_mapping = slot_mapping
        self.positions = positions
        self.block_size = block_size
        self.num_queries_per_kv = num_queries_per_kv
        self.seq_of_token = seq_of_token
        self.workspace = workspace
        self._plan = plan
        self._groups: list[AttentionGroup] | None = None
        # Set by build_attention_metadata for the native kernel: host copies, one per step.
        self.max_seq_len = 0
        # Number of cache blocks the native kernel last checked the tables against.
        self._native_checked: int | None = None

    @property
    def groups(self) -> list[AttentionGroup]:
        if self._groups is None:
            self._groups = self._plan() if self._plan is not None else []
        return self._groups

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def _plan_groups(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_queries_per_kv: int,
    block_size: int,
    max_gather_tokens: int,
    max_score_elements: int,
) -> list[list[int]]:
    """Split sequence indices into groups: decodes apart from prefills; a kind that fits the
    budgets is one group in batch order, otherwise it is sorted by length and cut where
    padding the next sequence in would exceed the gather or score budget."""

    def over_budget(n: int, max_q: int, max_len: int) -> bool:
        padded_len = -(-max_len // block_size) * block_size
        return n * padded_len > max_gather_tokens or (
            n * num_queries_per_kv * max_q * padded_len > max_score_elements
        )

    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q > 1]
    groups: list[list[int]] = []
    for members in (decodes, prefills):
        if not members:
            continue
        if not over_budget(
            len(members), max(query_lens[i] for i in members), max(seq_lens[i] for i in members)
        ):
            # Batch order kept: a pure decode step then needs no gather or scatter of queries.
            groups.append(members)
            continue
        current: list[int] = []
        max_q = max_len = 0
        for i in sorted(members, key=lambda i: (query_lens[i], seq_lens[i])):
            q, s = max(max_q, query_lens[i]), max(max_len, seq_lens[i])
            if current and over_budget(len(current) + 1, q, s):
                groups.append(current)
                current, q, s = [], query_lens[i], seq_lens[i]
            current.append(i)
            max_q, max_len = q, s
        groups.append(current)
    return groups


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_queries_per_kv: int,
    device: torch.device | str = "cpu",
    workspace: AttentionWorkspace | None = None,
    max_gather_tokens: int = DEFAULT_MAX_GATHER_TOKENS,
    max_score_elements: int = DEFAULT_MAX_SCORE_ELEMENTS,
) -> AttentionMetadata:
    """Build a step's metadata from per-sequence Python lists (O(B) Python, the rest tensors).

    Sequence ``b`` contributes ``query_lens[b]`` packed tokens, the last ones of its
    ``seq_lens[b]``-token context; ``block_tables[b]`` must cover that context.
    """
    num_seqs = len(query_lens)
    if not (len(seq_lens) == len(block_tables) == num_seqs) or num_seqs == 0:
        raise ValueError(
            "query_lens, seq_lens and block_tables must be non-empty and of equal length, got "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    for b in range(num_seqs):
        q, s = query_lens[b], seq_lens[b]
        if not 1 <= q <= s:
            raise ValueError(f"sequence {b}: need 1 <= query_len ({q}) <= seq_len ({s})")
        if len(block_tables[b]) * block_size < s:
            raise ValueError(
                f"sequence {b}: {len(block_tables[b])} blocks of {block_size} cannot hold "
                f"{s} tokens"
            )
    device = torch.device(device)
    max_blocks = max(len(t) for t in block_tables)
    # One tensor from padded Python rows: far cheaper than a tensor per row.
    table = torch.tensor(
        [t if len(t) == max_blocks else [*t, *([0] * (max_blocks - len(t)))] for t in block_tables],
        dtype=torch.int64,
    )
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    s_lens = torch.tensor(seq_lens, dtype=torch.int64)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # Position of every packed token: its sequence's first new position plus its offset.
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    first_pos = s_lens - q_lens
    positions = (
        torch.arange(num_tokens) - query_start_loc[:-1][seq_of_token] + first_pos[seq_of_token]
    )
    slot_mapping = (
        table[seq_of_token, positions // block_size] * block_size + positions % block_size
    )

    def plan() -> list[AttentionGroup]:
        return [
            _build_group(
                members, q_lens, s_lens, query_start_loc, table, block_size,
                num_queries_per_kv, num_tokens, device,
            )
            for members in _plan_groups(
                query_lens, seq_lens, num_queries_per_kv, block_size, max_gather_tokens,
                max_score_elements,
            )
        ]

    metadata = AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=s_lens.to(device),
        block_tables=table.to(device),
        slot_mapping=slot_mapping.to(device),
        positions=positions.to(device),
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        seq_of_token=seq_of_token.to(device),
        workspace=workspace if workspace is not None else AttentionWorkspace(),
        plan=plan,
    )
    metadata.max_seq_len = max(seq_lens)
    return metadata


def _build_group(
    members: list[int],
    q_lens: torch.Tensor,
    s_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    g: int,
    num_tokens: int,
    device: torch.device,
) -> AttentionGroup:
    idx = torch.tensor(members, dtype=torch.int64)
    gq, gs = q_lens[idx], s_lens[idx]
    bg = len(members)
    max_q = int(gq.max())
    num_blocks = -(-int(gs.max()) // block_size)
    key_len = num_blocks * block_size

    offs = torch.arange(max_q)
    valid = offs[None, :] < gq[:, None]  # [Bg, Qg]
    rows = query_start_loc[idx][:, None] + offs[None, :]
    query_rows = torch.where(valid, rows, torch.zeros_like(rows))
    # Padding queries get position 0 so that they attend to exactly one key (no NaN rows).
    q_pos = torch.where(valid, (gs - gq)[:, None] + offs[None, :], torch.zeros_like(rows))
    allowed = torch.arange(key_len)[None, None, :] <= q_pos[:, :, None]  # [Bg, Qg, L]
    mask = allowed[:, None, None].expand(bg, 1, g, max_q, key_len).reshape(bg, 1, g * max_q, key_len)

    block_ids = table[idx][:, :num_blocks].reshape(-1)
    flat_valid = valid.reshape(-1)
    out_rows = torch.nonzero(flat_valid).squeeze(1)
    out_tokens = rows.reshape(-1)[out_rows]
    identity = (
        max_q == 1 and bg == num_tokens and bool(torch.equal(out_tokens, torch.arange(num_tokens)))
    )
    return AttentionGroup(
        num_seqs=bg,
        max_query_len=max_q,
        num_blocks=num_blocks,
        block_ids=block_ids.to(device),
        query_rows=query_rows.reshape(-1).to(device),
        mask=mask.to(device),
        out_rows=out_rows.to(device),
        out_tokens=out_tokens.to(device),
        identity=identity,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` ``[T, Hq, D]`` over the paged cache.

    Each sequence's query tokens see its cached tokens at positions ``0..pos`` (the caller has
    already stored this step's K/V). Returns ``[T, Hq, D]`` in the cache's dtype.

    ``backend``: "torch" (grouped SDPA), "native" (the C kernel, CPU only) or "auto" (native
    for float32 / bfloat16 CPU tensors when the kernel is available, else torch).
    """
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be auto, native or torch, got {backend!r}")
    if backend == "native" or (
        backend == "auto"
        and q.device.type == "cpu"
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and native_attention_available()
    ):
        return native_paged_attention(q, k_cache, v_cache, metadata, scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    g = metadata.num_queries_per_kv
    if num_heads != g * num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads do not match {num_kv_heads} KV heads x {g} queries per KV head"
        )
    workspace = metadata.workspace or AttentionWorkspace()
    q = q.to(k_cache.dtype)
    out = None
    for group in metadata.groups:
        bg, max_q = group.num_seqs, group.max_query_len
        key_len = group.num_blocks * block_size
        numel = bg * key_len * num_kv_heads * head_dim
        k_buf, v_buf = workspace.buffers(numel, k_cache.dtype, k_cache.device)
        k_buf = k_buf.view(bg * group.num_blocks, block_size, num_kv_heads, head_dim)
        v_buf = v_buf.view_as(k_buf)
        torch.index_select(k_cache, 0, group.block_ids, out=k_buf)
        torch.index_select(v_cache, 0, group.block_ids, out=v_buf)
        keys = k_buf.view(bg, key_len, num_kv_heads, head_dim).transpose(1, 2)
        values = v_buf.view(bg, key_len, num_kv_heads, head_dim).transpose(1, 2)

        if group.identity:
            # [T, Hq, D] is already [B, Hkv, g * 1, D]: fold without copying.
            query = q.view(bg, num_kv_heads, g, head_dim)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, scale=scale)
            return o.reshape(num_tokens, num_heads, head_dim)

        query = (
            q.index_select(0, group.query_rows)
            .view(bg, max_q, num_kv_heads, g, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(bg, num_kv_heads, g * max_q, head_dim)
        )
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, scale=scale)
        o = (
            o.view(bg, num_kv_heads, g, max_q, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(bg * max_q, num_heads, head_dim)
        )
        if out is None:
            out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        out.index_copy_(0, group.out_tokens, o.index_select(0, group.out_rows))
    if out is None:
        raise ValueError("attention metadata has no groups")
    return out


# ------------------------------------------------------------------------ native CPU kernel
# The PyTorch path has to gather every sequence's KV blocks into a padded, contiguous buffer
# before SDPA can read them: on CPU, decoding reads the KV three times over (gather read, gather
# write, attention) plus the padding up to the longest context. This small C kernel reads the
# paged cache in place, token by token, with no padding and float32 accumulation: one work item
# per (query token, KV head), the KV head's g query heads sharing each K/V row it loads.
# It is compiled once per machine with the system C compiler (a second or two) and cached; when
# there is no compiler, the PyTorch path runs instead. MQINFER_CPU_ATTENTION=torch forces the
# PyTorch path, =native makes a missing kernel an error.
_NATIVE_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <float.h>
#include <math.h>
#include <pthread.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Attention weights are rounded to the cache dtype before they multiply V, as PyTorch's own
   CPU attention does for reduced precision: bfloat16 results then agree with it (and so with
   transformers) down to near-ties. */
static inline float keep_f32(float x) { return x; }
static inline float round_to_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

/* e^x for x <= 0 (softmax after subtracting the max), relative error about 2e-7: plain
   arithmetic that the compiler vectorises, unlike a call to expf. */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float t = x * 1.44269504088896341f;
    const float n = floorf(t + 0.5f);
    const float f = (t - n) * 0.69314718055994531f;  /* |f| <= ln2 / 2 */
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}

typedef struct {
    const void *q, *k_cache, *v_cache; void *out;
    const int64_t *block_tables, *seq_of_token, *positions;
    int64_t q_token_stride, num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len;
    float scale;
    int64_t token_begin, token_end;
    int is_bf16, failed;
} job_t;

/* The portable version, for any head size and grouping. */
#define DEFINE_ATTEND(NAME, T, LOAD, STORE, ROUNDW)                                               \
static void NAME(job_t *j, float *buf) {                                                          \
    const int64_t D = j->head_dim, hkv = j->num_kv_heads, g = j->num_heads / hkv, bs = j->block_size; \
    float *scores = buf, *qf = scores + g * j->max_len, *acc = qf + g * D, *row = acc + g * D;    \
    float *inv_sum = row + D;                                                                     \
    const T *q = (const T *)j->q, *kc = (const T *)j->k_cache, *vc = (const T *)j->v_cache;      \
    T *out = (T *)j->out;                                                                         \
    for (int64_t t = j->token_begin; t < j->token_end; t++) {                                     \
        const int64_t len = j->positions[t] + 1;                                                  \
        const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;              \
        for (int64_t h = 0; h < hkv; h++) {                                                       \
            for (int64_t i = 0; i < g; i++)                                                       \
                for (int64_t d = 0; d < D; d++)                                                   \
                    qf[i * D + d] = LOAD(q[t * j->q_token_stride + (h * g + i) * D + d]) * j->scale; \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const T *kb = kc + (table[blk] * bs * hkv + h) * D;                               \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    const T *k = kb + o * hkv * D;                                                \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(k[d]);                          \
                    for (int64_t i = 0; i < g; i++) {                                             \
                        float s = 0.0f;                                                           \
                        for (int64_t d = 0; d < D; d++) s += qf[i * D + d] * row[d];              \
                        scores[i * len + first + o] = s;                                          \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t i = 0; i < g; i++) {                                                     \
                float *s = scores + i * len, m = -FLT_MAX, sum = 0.0f;                            \
                for (int64_t p = 0; p < len; p++) m = s[p] > m ? s[p] : m;                        \
                for (int64_t p = 0; p < len; p++) { s[p] = exp_nonpositive(s[p] - m); sum += s[p]; } \
                inv_sum[i] = 1.0f / sum;                                                          \
                for (int64_t p = 0; p < len; p++) s[p] = ROUNDW(s[p]);                            \
            }                                                                                     \
            memset(acc, 0, sizeof(float) * g * D);                                                \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const T *vb = vc + (table[blk] * bs * hkv + h) * D;                               \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    const T *v = vb + o * hkv * D;                                                \
                    for (int64_t d = 0; d < D; d++) row[d] = LOAD(v[d]);                          \
                    for (int64_t i = 0; i < g; i++) {                                             \
                        const float w = scores[i * len + first + o];                              \
                        for (int64_t d = 0; d < D; d++) acc[i * D + d] += w * row[d];             \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t i = 0; i < g; i++)                                                       \
                for (int64_t d = 0; d < D; d++)                                                   \
                    out[(t * j->num_heads + h * g + i) * D + d] = STORE(acc[i * D + d] * inv_sum[i]); \
        }                                                                                         \
    }                                                                                             \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32, STORE_F32, keep_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, bf16_to_float, float_to_bf16, round_to_bf16)

#if defined(__AVX512F__)
#include <immintrin.h>
/* Hand-vectorised versions for the common head shapes: one K/V row is D/16 registers, the
   q rows and the output accumulators of the G query heads stay in registers for the whole
   context. */
static inline __m512 vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore_bf16(uint16_t *p, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
static inline void vstore_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 keep_f32x16(__m512 v) { return v; }
/* round_to_bf16 on 16 lanes, the same integer arithmetic. */
static inline __m512 round_to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(u, 16), 16));
}
/* exp_nonpositive on 16 lanes. The compiler contracts the scalar version's multiply-adds
   (this source is built without -ffp-contract=off): x * log2e + 0.5 and x * log2e - n are
   fused, and so is each polynomial step; the same fused operations here give the same bits
   (mqinfer_attention_selftest lets the tests check it). */
static inline __m512 exp_nonpositive16(__m512 x) {
    /* At and below the clamp (and for NaN) the scalar version's branch returns a constant the
       compiler folded: take the very same constant. */
    const __mmask16 inside = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    const __m512 at_clamp = _mm512_set1_ps(exp_nonpositive(-87.0f));
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_fmsub_ps(x, log2e, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_mov_ps(at_clamp, inside, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}
/* A block is one 4 KiB page for common shapes, and hardware prefetchers stop at page ends:
   ask for the next block's rows (of this KV head) while this one is being read. */
#define prefetch_rows(BASE, ROWS, STRIDE, D)                                                      \
    do {                                                                                          \
        for (int64_t r_ = 0; r_ < (ROWS); r_++)                                                   \
            for (int64_t c_ = 0; c_ < (int64_t)((D) * sizeof(*(BASE))); c_ += 64)                 \
                _mm_prefetch((const char *)((BASE) + r_ * (STRIDE)) + c_, _MM_HINT_T0);          \
    } while (0)

/* The horizontal sums of 16 vectors at once: lane r of the result is a[r]'s lanes added in
   exactly the tree _mm512_reduce_add_ps uses (256-bit halves, then 128-bit quarters, then
   pairs {0,1}+{2,3}, then the last two), so scores are bit for bit those of the one-at-a-time
   reduction, at two shuffles per addition instead of a dependent chain per score. */
static inline __m512 reduce16_add_ps(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int p = 0; p < 4; p++)
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int p = 0; p < 2; p++)
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* e's lane 4k + m holds the sum of a[4m + k]. */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

#define DEFINE_ATTEND_AVX512(NAME, T, VLOAD, VSTORE, ROUNDW, ROUNDW16, DV, GV)                              \
static void NAME(job_t *j, float *buf) {                                                          \
    float inv_sum[GV];                                                                            \
    enum { D = DV, G = GV, NV = DV / 16 };                                                        \
    const int64_t hkv = j->num_kv_heads, bs = j->block_size;                                      \
    float *scores = buf;                                                                          \
    const T *q = (const T *)j->q, *kc = (const T *)j->k_cache, *vc = (const T *)j->v_cache;      \
    T *out = (T *)j->out;                                                                         \
    const __m512 scale = _mm512_set1_ps(j->scale);                                                \
    for (int64_t t = j->token_begin; t < j->token_end; t++) {                                     \
        const int64_t len = j->positions[t] + 1;                                                  \
        const int64_t *table = j->block_tables + j->seq_of_token[t] * j->max_blocks;              \
        for (int64_t h = 0; h < hkv; h++) {                                                       \
            __m512 qv[G][NV];                                                                     \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++)                                                      \
                    qv[i][v] = _mm512_mul_ps(VLOAD(q + t * j->q_token_stride + (h * G + i) * D + 16 * v), scale); \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const T *kb = kc + (table[blk] * bs * hkv + h) * D;                               \
                if (first + bs < len) prefetch_rows(kc + (table[blk + 1] * bs * hkv + h) * D, bs, hkv * D, D); \
                int64_t o = 0;                                                                    \
                for (; o + 16 <= n; o += 16) {                                                    \
                    /* 16 keys at a time: their partial dot products are summed across lanes  \
                       together (reduce16_add_ps), the same additions as 16 reduce_add_ps. */ \
                    __m512 part[G][16];                                                           \
                    for (int r = 0; r < 16; r++) {                                                \
                        __m512 kv[NV];                                                            \
                        for (int v = 0; v < NV; v++) kv[v] = VLOAD(kb + (o + r) * hkv * D + 16 * v); \
                        for (int i = 0; i < G; i++) {                                             \
                            __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);                          \
                            for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[i][v], kv[v], acc); \
                            part[i][r] = acc;                                                     \
                        }                                                                         \
                    }                                                                             \
                    for (int i = 0; i < G; i++)                                                   \
                        _mm512_storeu_ps(scores + i * len + first + o, reduce16_add_ps(part[i]));  \
                }                                                                                 \
                for (; o < n; o++) {                                                              \
                    __m512 kv[NV];                                                                \
                    for (int v = 0; v < NV; v++) kv[v] = VLOAD(kb + o * hkv * D + 16 * v);        \
                    for (int i = 0; i < G; i++) {                                                 \
                        __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);                              \
                        for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(qv[i][v], kv[v], acc); \
                        scores[i * len + first + o] = _mm512_reduce_add_ps(acc);                  \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            /* Softmax with the portable version's arithmetic: the max and the exponentials \
               16 at a time (the same operations per element), each head's sum still added  \
               in position order, the G heads' sums interleaved so their chains overlap. */  \
            for (int i = 0; i < G; i++) {                                                         \
                float *s = scores + i * len;                                                      \
                __m512 mv = _mm512_set1_ps(-FLT_MAX);                                             \
                int64_t p = 0;                                                                    \
                for (; p + 16 <= len; p += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + p), mv);    \
                float m = _mm512_reduce_max_ps(mv);                                               \
                for (; p < len; p++) m = s[p] > m ? s[p] : m;                                     \
                const __m512 mb = _mm512_set1_ps(m);                                              \
                for (p = 0; p + 16 <= len; p += 16)                                               \
                    _mm512_storeu_ps(s + p, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mb))); \
                for (; p < len; p++) s[p] = exp_nonpositive(s[p] - m);                           \
            }                                                                                     \
            {                                                                                     \
                float sum[G];                                                                     \
                for (int i = 0; i < G; i++) sum[i] = 0.0f;                                        \
                for (int64_t p = 0; p < len; p++)                                                 \
                    for (int i = 0; i < G; i++) sum[i] += scores[i * len + p];                    \
                for (int i = 0; i < G; i++) inv_sum[i] = 1.0f / sum[i];                           \
            }                                                                                     \
            for (int i = 0; i < G; i++) {                                                         \
                float *s = scores + i * len;                                                      \
                int64_t p = 0;                                                                    \
                for (; p + 16 <= len; p += 16) _mm512_storeu_ps(s + p, ROUNDW16(_mm512_loadu_ps(s + p))); \
                for (; p < len; p++) s[p] = ROUNDW(s[p]);                                         \
            }                                                                                     \
            __m512 acc[G][NV];                                                                    \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();                     \
            for (int64_t first = 0, blk = 0; first < len; first += bs, blk++) {                   \
                const int64_t n = len - first < bs ? len - first : bs;                            \
                const T *vb = vc + (table[blk] * bs * hkv + h) * D;                               \
                if (first + bs < len) prefetch_rows(vc + (table[blk + 1] * bs * hkv + h) * D, bs, hkv * D, D); \
                for (int64_t o = 0; o < n; o++) {                                                 \
                    __m512 vv[NV];                                                                \
                    for (int v = 0; v < NV; v++) vv[v] = VLOAD(vb + o * hkv * D + 16 * v);        \
                    for (int i = 0; i < G; i++) {                                                 \
                        const __m512 w = _mm512_set1_ps(scores[i * len + first + o]);            \
                        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(w, vv[v], acc[i][v]); \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int i = 0; i < G; i++)                                                           \
                for (int v = 0; v < NV; v++)                                                      \
                    VSTORE(out + (t * j->num_heads + h * G + i) * D + 16 * v,                     \
                           _mm512_mul_ps(acc[i][v], _mm512_set1_ps(inv_sum[i])));                 \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_ATTEND_AVX512(attend_f32_64_4, float, vload_f32, vstore_f32, keep_f32, keep_f32x16, 64, 4)
DEFINE_ATTEND_AVX512(attend_bf16_64_4, uint16_t, vload_bf16, vstore_bf16, round_to_bf16, round_to_bf16x16, 64, 4)
DEFINE_ATTEND_AVX512(attend_f32_128_4, float, vload_f32, vstore_f32, keep_f32, keep_f32x16, 128, 4)
DEFINE_ATTEND_AVX512(attend_bf16_128_4, uint16_t, vload_bf16, vstore_bf16, round_to_bf16, round_to_bf16x16, 128, 4)
#define HAVE_SPECIALISED 1
#endif

/* Tests only: the vectorised softmax pieces against their one-at-a-time originals, which the
   portable kernel uses. x holds n floats, n a multiple of 256. Returns 0 (and writes nothing)
   where there is no AVX-512 version to compare. */
int mqinfer_attention_selftest(const float *x, int64_t n, float *exp_one, float *exp_16,
                               float *sum_one, float *sum_16) {
#ifdef HAVE_SPECIALISED
    for (int64_t i = 0; i < n; i++) exp_one[i] = exp_nonpositive(x[i]);
    for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(exp_16 + i, exp_nonpositive16(_mm512_loadu_ps(x + i)));
    for (int64_t g = 0; g + 256 <= n; g += 256) {
        __m512 v[16];
        for (int r = 0; r < 16; r++) {
            v[r] = _mm512_loadu_ps(x + g + 16 * r);
            sum_one[g / 16 + r] = _mm512_reduce_add_ps(v[r]);
        }
        _mm512_storeu_ps(sum_16 + g / 16, reduce16_add_ps(v));
    }
    return 1;
#else
    (void)x; (void)n; (void)exp_one; (void)exp_16; (void)sum_one; (void)sum_16;
    return 0;
#endif
}

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t g = j->num_heads / j->num_kv_heads;
    float *buf = (float *)malloc(sizeof(float) * (g * j->max_len + 2 * g * j->head_dim + j->head_dim + g));
    if (!buf) { j->failed = 1; return NULL; }
    const int64_t D = j->head_dim;
#ifdef HAVE_SPECIALISED
    if (D == 64 && g == 4) { if (j->is_bf16) attend_bf16_64_4(j, buf); else attend_f32_64_4(j, buf); }
    else if (D == 128 && g == 4) { if (j->is_bf16) attend_bf16_128_4(j, buf); else attend_f32_128_4(j, buf); }
    else
#endif
    if (j->is_bf16) attend_bf16(j, buf); else attend_f32(j, buf);
    free(buf);
    return NULL;
}

/* Returns 0, or -1 when memory or threads ran out (nothing is half-written that matters:
   the caller raises and the step fails as a whole). */
int mqinfer_paged_attention(
    const void *q, const void *k_cache, const void *v_cache, void *out,
    const int64_t *block_tables, const int64_t *seq_of_token, const int64_t *positions,
    int64_t num_tokens, int64_t q_token_stride, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_len, float scale,
    int is_bf16, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    if (num_threads > num_tokens) num_threads = (int)num_tokens;
    job_t jobs[64];
    pthread_t threads[64];
    /* Cut the tokens into runs of about equal work (a token's work grows with its context). */
    int64_t total = 0;
    for (int64_t t = 0; t < num_tokens; t++) total += positions[t] + 8;
    int64_t t = 0, done = 0;
    for (int n = 0; n < num_threads; n++) {
        job_t *j = &jobs[n];
        j->q = q; j->k_cache = k_cache; j->v_cache = v_cache; j->out = out;
        j->block_tables = block_tables; j->seq_of_token = seq_of_token; j->positions = positions;
        j->q_token_stride = q_token_stride; j->num_heads = num_heads; j->num_kv_heads = num_kv_heads;
        j->head_dim = head_dim; j->block_size = block_size; j->max_blocks = max_blocks;
        j->max_len = max_len; j->scale = scale; j->is_bf16 = is_bf16; j->failed = 0;
        j->token_begin = t;
        const int64_t target = total * (n + 1) / num_threads;
        while (t < num_tokens && (done < target || n == num_threads - 1)) { done += positions[t] + 8; t++; }
        j->token_end = t;
    }
    int started[64] = {0};
    for (int n = 1; n < num_threads; n++)
        started[n] = pthread_create(&threads[n], NULL, run_job, &jobs[n]) == 0;
    run_job(&jobs[0]);
    int failed = jobs[0].failed;
    for (int n = 1; n < num_threads; n++) {
        if (started[n]) pthread_join(threads[n], NULL); else run_job(&jobs[n]);
        failed |= jobs[n].failed;
    }
    return failed ? -1 : 0;
}
"""

# No -ffast-math: loading a library built with it turns on flush-to-zero for the whole process.
_NATIVE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-Werror=implicit-function-declaration")
_native_lock = threading.Lock()
_native_state: dict[str, object] = {}
log = logging.getLogger(__name__)


def _native_cache_dir() -> Path:
    explicit = os.environ.get("MQINFER_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mqinfer" / "kernels"


def _cpu_signature() -> str:
    # -march=native code is only valid on a CPU with the same features: key the cache by them.
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def build_native_library(stem: str, source: str, flags: Sequence[str] = _NATIVE_FLAGS) -> ctypes.CDLL:
    """Compile C ``source`` into a shared library (once per machine, cached by a hash of the
    source, flags, compiler and CPU features) and load it. Shared by every native CPU kernel."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    key = hashlib.sha256(
        "\0".join((source, " ".join(flags), compiler, _cpu_signature())).encode()
    ).hexdigest()[:16]
    folder = _native_cache_dir()
    library = folder / f"{stem}_{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            source_file = Path(tmp) / f"{stem}.c"
            source_file.write_text(source)
            built = Path(tmp) / f"{stem}.so"
            result = subprocess.run(
                [compiler, *flags, "-o", str(built), str(source_file), "-lm", "-lpthread"],
                capture_output=True, text=True, timeout=300,
            )
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, library)  # atomic: a concurrent builder's copy is as good
    return ctypes.CDLL(str(library))


def _build_native() -> ctypes.CDLL:
    lib = build_native_library("paged_attention", _NATIVE_SOURCE)
    fn = lib.mqinfer_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 7 + [i64] * 8 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mqinfer_attention_selftest.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    lib.mqinfer_attention_selftest.restype = ctypes.c_int
    return lib


def native_softmax_selftest(x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Tests only: (exp one at a time, exp 16 at a time, lane sums one vector at a time, lane
    sums 16 vectors at a time) of the float32 ``x`` (numel a multiple of 256) as the native
    kernel computes them; None where the kernel has no AVX-512 version."""
    if not native_attention_available():
        raise RuntimeError("the native CPU attention kernel is not available")
    x = x.to(torch.float32).contiguous().view(-1)
    n = x.numel()
    if n % 256:
        raise ValueError("x must hold a multiple of 256 values")
    exp_one, exp_16 = torch.empty(n), torch.empty(n)
    sum_one, sum_16 = torch.empty(n // 16), torch.empty(n // 16)
    ok = _native_state["lib"].mqinfer_attention_selftest(
        x.data_ptr(), n, exp_one.data_ptr(), exp_16.data_ptr(), sum_one.data_ptr(), sum_16.data_ptr()
    )
    return (exp_one, exp_16, sum_one, sum_16) if ok else None


def native_attention_available() -> bool:
    """Whether the native CPU kernel is in use (built on first call; False when disabled)."""
    mode = os.environ.get("MQINFER_CPU_ATTENTION", "auto")
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"MQINFER_CPU_ATTENTION must be auto, native or torch, got {mode!r}")
    if mode == "torch":
        return False
    with _native_lock:
        if "lib" not in _native_state:
            try:
                _native_state["lib"] = _build_native()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _native_state["lib"] = None
                _native_state["error"] = str(exc)
                log.warning("native CPU attention kernel unavailable, using the PyTorch path: %s", exc)
    if _native_state["lib"] is None and mode == "native":
        raise RuntimeError(f"MQINFER_CPU_ATTENTION=native but the kernel could not be built: {_native_state['error']}")
    return _native_state["lib"] is not None


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` by the native CPU kernel: same arguments, same result, no padding."""
    if not native_attention_available():
        raise RuntimeError("the native CPU attention kernel is not available")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    dtype = k_cache.dtype
    if dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != dtype:
        raise ValueError(f"the native kernel takes float32 or bfloat16 caches, got {dtype} / {v_cache.dtype}")
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise ValueError("the native kernel runs on CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("the K and V caches must be contiguous and of the same shape")
    if k_cache.shape[3] != head_dim or num_heads != metadata.num_queries_per_kv * num_kv_heads:
        raise ValueError(
            f"q [T, {num_heads}, {head_dim}] does not match the cache's {num_kv_heads} KV heads of "
            f"{k_cache.shape[3]} x {metadata.num_queries_per_kv} queries per KV head"
        )
    q = q.to(dtype)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if metadata.seq_of_token is None:
        raise ValueError("attention metadata has no seq_of_token (build it with build_attention_metadata)")
    tables = metadata.block_tables.contiguous()
    seq_of_token = metadata.seq_of_token.contiguous()
    positions = metadata.positions.contiguous()
    if metadata.max_seq_len < 1:
        metadata.max_seq_len = int(positions.max()) + 1
    # The kernel trusts its indices: check them once per step, not per layer.
    if metadata._native_checked != num_blocks:
        if tables.numel() and not (0 <= int(tables.min()) and int(tables.max()) < num_blocks):
            raise ValueError(f"block tables name blocks outside the cache (0..{num_blocks - 1})")
        if int(positions.max()) >= metadata.max_seq_len or int(positions.min()) < 0:
            raise ValueError("token positions fall outside 0..max_seq_len - 1")
        metadata._native_checked = num_blocks
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
    status = _native_state["lib"].mqinfer_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), seq_of_token.data_ptr(), positions.data_ptr(),
        num_tokens, q.stride(0), num_heads, num_kv_heads, head_dim, block_size, tables.shape[1],
        metadata.max_seq_len, scale, int(dtype == torch.bfloat16), torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the native attention kernel could not allocate its buffers or threads")
    return out


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """Token-by-token attention in float64, straight from the definition (tests only)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    g = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        keys = torch.stack(
            [k_cache[table[p // block_size], p % block_size] for p in range(seq_len)]
        ).double()  # [L, Hkv, D]
        values = torch.stack(
            [v_cache[table[p // block_size], p % block_size] for p in range(seq_len)]
        ).double()
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(num_heads):
                kv = h // g
                scores = (keys[: pos + 1, kv] @ q[row, h].double()) * scale
                weights = torch.softmax(scores, dim=0)
                out[row, h] = weights @ values[: pos + 1, kv]
            row += 1
    return out.to(q.dtype)


__all__ = [
    "AttentionGroup",
    "AttentionMetadata",
    "AttentionWorkspace",
    "build_attention_metadata",
    "native_attention_available",
    "native_paged_attention",
    "paged_attention",
    "reference_paged_attention",
    "store_kv",
]
