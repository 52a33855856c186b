"""The native CPU attention kernel's Python side: whether it is in use, the call, and the checks
of every index it reads.

The PyTorch path has to gather every sequence's KV blocks into a padded, contiguous buffer
before SDPA can read them: on CPU, decoding reads the KV three times over (gather read, gather
write, attention) plus the padding up to the longest context. The C kernel
(csrc/paged_attention.c) reads the paged cache in place, token by token, with no padding and
float32 accumulation: one work item per (query token, KV head), the KV head's g query heads
sharing each K/V row it loads. kernels/native.py builds and loads it; when there is no
compiler, the PyTorch path runs instead. MQINFER_CPU_ATTENTION=torch forces the PyTorch
path, =native makes a missing kernel an error.

The kernel trusts its indices (a bad one would be a read outside the tables or the cache), so
``native_paged_attention`` checks them first: their types and shapes on every call, their
values once per step (per metadata and cache), a few reductions over tensors of the step's
size, not per layer.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from mqinfer.kernels import native
from mqinfer.kernels.kv_quant import check_scales, kernel_quant_code

if TYPE_CHECKING:
    from mqinfer.kernels.attention import AttentionMetadata

_SWITCH = "MQINFER_CPU_ATTENTION"


def native_softmax_selftest(x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Tests only: (exp one at a time, exp W at a time, lane sums one vector at a time, lane
    sums W vectors at a time) of the float32 ``x`` (numel a multiple of 256) as the native
    kernel computes them, W being its widest vector (16 lanes with AVX-512, 8 with AVX2); None
    where the kernel has no vectorised version."""
    lib = native.switched_library(_SWITCH)
    if lib is None:
        raise RuntimeError("the native CPU attention kernel is not available")
    x = x.to(torch.float32).contiguous().view(-1)
    n = x.numel()
    if n % 256:
        raise ValueError("x must hold a multiple of 256 values")
    exp_one, exp_vec = torch.empty(n), torch.empty(n)
    sum_one, sum_vec = torch.empty(n // 8), torch.empty(n // 8)
    width = lib.mqinfer_attention_selftest(
        x.data_ptr(), n, exp_one.data_ptr(), exp_vec.data_ptr(), sum_one.data_ptr(), sum_vec.data_ptr()
    )
    if not width:
        return None
    return exp_one, exp_vec, sum_one[: n // width], sum_vec[: n // width]


def native_attention_available() -> bool:
    """Whether the native CPU kernel is in use (built on first call; False when disabled)."""
    return native.switched_library(_SWITCH) is not None


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` by the native CPU kernel: same arguments, same result, no padding."""
    lib = native.switched_library(_SWITCH)
    if lib is None:
        raise RuntimeError("the native CPU attention kernel is not available")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    dtype = k_cache.dtype
    kv_quant = kernel_quant_code(dtype)
    if k_scale is not None or kv_quant:
        check_scales(k_cache, v_cache, k_scale, v_scale)
        if q.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native kernel takes float32 or bfloat16 queries, got {q.dtype}")
        # Over an 8-bit cache the activations keep the model's dtype; the kernel computes in
        # float32 and rounds a bfloat16 output once.
        dtype = q.dtype
    elif dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != dtype:
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
    check_index_tensors(tables, seq_of_token, positions, num_tokens)
    # The values are checked once per step (per metadata and cache), not per layer.
    if num_tokens and metadata.native_checked_blocks != num_blocks:
        check_attention_indices(metadata, tables, seq_of_token, positions, num_blocks, block_size)
        metadata.native_checked_blocks = num_blocks
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
    args = native.AttentionArgs(
        q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), out=out.data_ptr(),
        block_tables=tables.data_ptr(), seq_of_token=seq_of_token.data_ptr(),
        positions=positions.data_ptr(), num_tokens=num_tokens, q_token_stride=q.stride(0),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_blocks=tables.shape[1], max_len=metadata.max_seq_len, scale=scale,
        is_bf16=int(dtype == torch.bfloat16),
        k_scale=None if k_scale is None else k_scale.data_ptr(),
        v_scale=None if v_scale is None else v_scale.data_ptr(), kv_quant=kv_quant,
    )
    status = lib.mqinfer_paged_attention(ctypes.byref(args), torch.get_num_threads())
    if status != 0:
        raise MemoryError("the native attention kernel could not allocate its buffers")
    return out


def check_index_tensors(
    tables: torch.Tensor, seq_of_token: torch.Tensor, positions: torch.Tensor, num_tokens: int
) -> None:
    """The kernel reads the tables, sequence ids and positions as int64 arrays of these shapes."""
    if tables.dtype != torch.int64 or tables.dim() != 2 or tables.device.type != "cpu":
        raise ValueError(f"block tables must be an int64 CPU tensor [B, max_blocks], got {tables.dtype} "
                         f"{list(tables.shape)} on {tables.device}")
    for name, t in (("seq_of_token", seq_of_token), ("positions", positions)):
        if t.dtype != torch.int64 or tuple(t.shape) != (num_tokens,) or t.device.type != "cpu":
            raise ValueError(f"{name} must be an int64 CPU tensor [{num_tokens}] (one per query), got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")


def check_attention_indices(
    metadata: AttentionMetadata,
    tables: torch.Tensor,
    seq_of_token: torch.Tensor,
    positions: torch.Tensor,
    num_blocks: int,
    block_size: int,
) -> None:
    """Every index the native kernel reads, checked before it runs (it trusts them): token t
    reads row ``seq_of_token[t]`` of the tables, that row's entries ``0..positions[t] //
    block_size``, the cache blocks those entries name, and keeps ``positions[t] + 1`` scores in a
    buffer sized by ``max_seq_len``. A metadata without ``max_seq_len`` gets it from the
    positions, after they are checked against the table's width (a bound that does not come from
    them). The Triton path runs the same checks (``kernels/triton_attention.py``); the tensors
    may be on any device."""
    num_seqs, max_blocks = tables.shape
    lo, hi = (int(x) for x in torch.aminmax(seq_of_token))
    if lo < 0 or hi >= num_seqs:
        raise ValueError(f"seq_of_token names sequences outside the block tables (0..{num_seqs - 1}), "
                         f"got {lo}..{hi}")
    lo, hi = (int(x) for x in torch.aminmax(positions))
    if lo < 0 or hi // block_size >= max_blocks:
        raise ValueError(f"token positions must lie in 0..{max_blocks * block_size - 1} (block tables "
                         f"{max_blocks} blocks of {block_size} wide), got {lo}..{hi}")
    if metadata.max_seq_len < 1:
        metadata.max_seq_len = hi + 1
    elif hi >= metadata.max_seq_len:
        raise ValueError(f"token positions must lie in 0..max_seq_len - 1 ({metadata.max_seq_len - 1}), "
                         f"got up to {hi}")
    if tables.numel():
        lo, hi = (int(x) for x in torch.aminmax(tables))
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block tables name blocks outside the cache (0..{num_blocks - 1}), got {lo}..{hi}")
