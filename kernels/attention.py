"""Attention over a paged KV cache on CPU (and the reference for the Triton path).

Owns the cache write (``store_kv``), the per-step attention metadata (``AttentionMetadata``,
built once per step by ``build_attention_metadata`` and shared by every layer), the batched
attention itself (``paged_attention``) with its two CPU backends, and a naive,
obviously-correct ``reference_paged_attention`` that the tests hold both backends to.

Layout. One K and one V cache per layer, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``pos`` of a sequence lives in slot ``block_table[pos // block_size] *
block_size + pos % block_size``. Queries come packed: ``[T, num_heads, head_dim]``, the new
tokens of every scheduled sequence back to back, no padding.

8-bit caches (``--kv-cache-dtype int8|fp8``, ``kernels/kv_quant.py``): K and V are int8 or
float8_e4m3fn with a bfloat16 scale per (slot, KV head), ``k_scale`` / ``v_scale``
``[num_blocks, block_size, num_kv_heads]``, passed beside the caches. ``store_kv`` quantizes as
it writes; every attention backend dequantizes as it reads and returns the queries' dtype.
Without scales every function does exactly what it does for a cache in the model's dtype.

The native backend (the default on CPU where a C compiler is found): a small C kernel
(``csrc/paged_attention.c``, built and cached by ``kernels/native.py``, called from
``kernels/attention_native.py``, which checks every index it reads) that reads the paged
cache in place, one (token, KV head) at a time, with no gather, no padding and float32
accumulation, on the kernels' persistent thread pool; AVX-512 and AVX2 versions for the
common head shapes (``csrc/attention_avx2.c``: heads of 64 or 128 with 1 to 8 query heads per
KV head). Profiling the standard benchmark showed the PyTorch backend spending more time
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

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from mqinfer.kernels.attention_native import (
    check_attention_indices,
    native_attention_available,
    native_paged_attention,
    native_softmax_selftest,
)
from mqinfer.kernels.kv_quant import as_raw, check_scales, dequantize_kv, quantize_kv

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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``, ``v`` (``[T, Hkv, D]``) into the caches at ``slot_mapping`` (``[T]``).

    With ``k_scale`` / ``v_scale`` (an 8-bit cache) each row is quantized and its scale
    written beside it."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_scale is None:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    check_scales(k_cache, v_cache, k_scale, v_scale)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, scales = quantize_kv(x, cache.dtype)
        as_raw(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_raw(values))
        scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


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
        # Number of cache blocks the native kernel last checked this step's indices against
        # (kernels/attention_native.py): the checks run once per step, not per layer.
        self.native_checked_blocks: int | None = None
        # The same for the Triton kernels (kernels/triton_attention.py).
        self.triton_checked_blocks: int | None = None

    def new_step(self, max_seq_len: int, plan: Callable[[], list[AttentionGroup]] | None) -> None:
        """Describe another step with the same tensors, whose contents the caller has rewritten
        (static buffers): the index checks run again and the groups are planned anew by ``plan``."""
        self.max_seq_len = max_seq_len
        self.native_checked_blocks = self.triton_checked_blocks = None
        self._groups, self._plan = None, plan

    def planner(self) -> Callable[[], list[AttentionGroup]] | None:
        """What plans this metadata's groups (for another metadata of the same step)."""
        return self._plan

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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` ``[T, Hq, D]`` over the paged cache.

    Each sequence's query tokens see its cached tokens at positions ``0..pos`` (the caller has
    already stored this step's K/V). Returns ``[T, Hq, D]`` in the cache's dtype, or for an
    8-bit cache (``k_scale`` / ``v_scale`` given) in the queries' dtype.

    ``backend``: "torch" (grouped SDPA), "native" (the C kernel, CPU only) or "auto" (native
    for float32 / bfloat16 / 8-bit CPU caches when the kernel is available, else torch).
    """
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"backend must be auto, native or torch, got {backend!r}")
    if backend == "native" or (
        backend == "auto"
        and q.device.type == "cpu"
        and (k_cache.dtype in (torch.float32, torch.bfloat16) or k_scale is not None)
        and native_attention_available()
    ):
        return native_paged_attention(q, k_cache, v_cache, metadata, scale, k_scale, v_scale)
    quantized = k_scale is not None
    if quantized:
        check_scales(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    g = metadata.num_queries_per_kv
    if num_heads != g * num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads do not match {num_kv_heads} KV heads x {g} queries per KV head"
        )
    workspace = metadata.workspace or AttentionWorkspace()
    # An 8-bit cache is gathered, then dequantized into the workspace in the queries' dtype.
    compute_dtype = q.dtype if quantized else k_cache.dtype
    q = q.to(compute_dtype)
    out = None
    for group in metadata.groups:
        bg, max_q = group.num_seqs, group.max_query_len
        keys, values = _gather_kv(group, k_cache, v_cache, k_scale, v_scale, workspace, compute_dtype)
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


def _gather_kv(
    group: AttentionGroup,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    workspace: AttentionWorkspace,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's KV blocks gathered into the workspace as ``dtype`` (an 8-bit cache dequantized
    on the way): keys and values ``[Bg, Hkv, nb * block_size, D]``, views of the workspace."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    bg, key_len = group.num_seqs, group.num_blocks * block_size
    k_buf, v_buf = workspace.buffers(bg * key_len * num_kv_heads * head_dim, dtype, k_cache.device)
    k_buf = k_buf.view(bg * group.num_blocks, block_size, num_kv_heads, head_dim)
    v_buf = v_buf.view_as(k_buf)
    if k_scale is not None:
        ids = group.block_ids
        for buf, cache, scales in ((k_buf, k_cache, k_scale), (v_buf, v_cache, v_scale)):
            stored = as_raw(cache).index_select(0, ids).view(cache.dtype)
            buf.copy_(dequantize_kv(stored, scales.index_select(0, ids)))
    else:
        torch.index_select(k_cache, 0, group.block_ids, out=k_buf)
        torch.index_select(v_cache, 0, group.block_ids, out=v_buf)
    keys = k_buf.view(bg, key_len, num_kv_heads, head_dim).transpose(1, 2)
    values = v_buf.view(bg, key_len, num_kv_heads, head_dim).transpose(1, 2)
    return keys, values


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token attention in float64, straight from the definition (tests only).

    With ``k_scale`` / ``v_scale``, the 8-bit caches are read as ``value * scale`` in float64."""
    if k_scale is not None:
        k_cache = k_cache.double() * k_scale.double().unsqueeze(-1)
        v_cache = v_cache.double() * v_scale.double().unsqueeze(-1)
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
    "check_attention_indices",
    "native_attention_available",
    "native_paged_attention",
    "native_softmax_selftest",
    "paged_attention",
    "reference_paged_attention",
    "store_kv",
]
