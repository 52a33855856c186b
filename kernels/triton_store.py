"""The KV-cache write on the GPU: one Triton kernel that scatters this step's K and V into their slots.

Same contract as ``mqinfer.kernels.attention.store_kv`` (the PyTorch path): ``k``, ``v`` are
``[T, num_kv_heads, head_dim]`` (any strides over tokens and heads, as the model's fused QKV
projection hands them out), the caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``
and packed token ``t`` goes to flat slot ``slot_mapping[t]``. One program per token writes both
its K and its V row, so the write is one launch instead of the two ``index_copy_`` of the
PyTorch path, and needs no contiguous copy of ``k``/``v`` first.

8-bit caches (``k_scale`` / ``v_scale`` given, see ``kernels/kv_quant.py``): each row is
quantized as ``kv_quant.quantize_kv`` does (scale = max|x| / QMAX, round half to even, clamp)
and its bfloat16 scale stored beside it. float8 e4m3 caches are handed to the kernels as their
bytes (uint8) and encoded by integer arithmetic (``_encode_fp8``): the same code on every GPU
and under the interpreter, which has no float8 type.

Importing this module imports triton; callers that may run without it import it lazily.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from mqinfer.kernels.kv_quant import as_raw, check_scales, is_quantized_dtype, kernel_quant_code


@dataclass(frozen=True)
class KernelLaunch:
    """One planned kernel launch: what ``run()`` passes to the kernel, kept as data so that the
    same plan can also be compiled ahead of time for a GPU this machine does not have
    (``python -m mqinfer.loadgen.gpu.kernels --compile-only``)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def run_launches(launches: list[KernelLaunch], device: torch.device) -> None:
    """Run launches in order on ``device`` (Triton launches on the current CUDA device, which
    need not be the tensors' one in a process that drives several GPUs)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            for launch in launches:
                launch.run()
    else:
        for launch in launches:
            launch.run()


# Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an integer,
# half to even (the hardware's rounding), as torch.round does.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_half_even(x):
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _encode_fp8(y):
    """float32 in [-448, 448] -> float8 e4m3 bits (round to nearest even), as int32."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the float's mantissa to 3 bits, half to even (a carry
    # moves into the exponent), then rebias the exponent from 127 to 7.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: a multiple of 2^-9, the code is that multiple (8 is the smallest normal).
    sub = _round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return tl.where(y < 0, code | 0x80, code)


@triton.jit
def _store_rows_quantized(x, dst, scale_dst, mask, heads, QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """Quantize rows ``x`` [heads, dims] (masked lanes 0) into ``dst`` and their scales into
    ``scale_dst`` (one per head)."""
    x = x.to(tl.float32)
    qmax = 127.0 if QUANT == 1 else 448.0
    # Both divisions are IEEE (div_rn), as PyTorch's: Triton's `/` on float32 compiles to an
    # approximate division on NVIDIA GPUs (up to 2 ulp off), which moves values across rounding
    # boundaries; the interpreter divides exactly, so only a GPU shows the difference.
    # The scale rounded up to bfloat16 (kv_quant.scale_up_to_bfloat16), stored as its 16 bits
    # (the scale tensors are handed over as int16).
    bits = tl.math.div_rn(tl.max(tl.abs(x), 1), tl.full((), qmax, tl.float32)).to(tl.int32, bitcast=True)
    scale_bits = (bits >> 16) + ((bits & 0xFFFF) != 0).to(tl.int32)
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    divisor = tl.where(scale > 0, scale, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, divisor[:, None]), -qmax), qmax)
    if QUANT == 1:
        tl.store(dst, _round_half_even(y).to(tl.int8), mask=mask)
    else:
        tl.store(dst, _encode_fp8(y).to(tl.uint8), mask=mask)
    tl.store(scale_dst, scale_bits.to(tl.int16), mask=heads < NUM_KV_HEADS)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_slots,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    QUANT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # A slot outside the cache would be a write into someone else's memory on the GPU.
    # ``store_kv`` refuses such slots on the host; this keeps a launch planned without that
    # check (``plan_store_kv``) from corrupting memory.
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k_src = k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    k_dst += heads[:, None] * stride_kc_head + dims[None, :]
    v_src = v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    v_dst += heads[:, None] * stride_vc_head + dims[None, :]
    if QUANT == 0:
        tl.store(k_dst, tl.load(k_src, mask=mask).to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, tl.load(v_src, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        # Scales are contiguous [num_slots, NUM_KV_HEADS].
        _store_rows_quantized(tl.load(k_src, mask=mask, other=0.0), k_dst,
                              k_scale_ptr + slot * NUM_KV_HEADS + heads, mask, heads, QUANT, NUM_KV_HEADS)
        _store_rows_quantized(tl.load(v_src, mask=mask, other=0.0), v_dst,
                              v_scale_ptr + slot * NUM_KV_HEADS + heads, mask, heads, QUANT, NUM_KV_HEADS)


def _check_store_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1] != num_kv_heads or t.shape[2] != head_dim:
            raise ValueError(
                f"{name} must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(t.shape)}"
            )
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride {t.stride(2)})")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV caches must be contiguous along head_dim")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping {tuple(slot_mapping.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
            "must have one entry per packed token"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {k_cache.device}")
    if k_scale is not None or is_quantized_dtype(k_cache.dtype):
        check_scales(k_cache, v_cache, k_scale, v_scale)


def plan_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> KernelLaunch | None:
    """Check the inputs of ``store_kv`` and plan its launch (None: nothing to write)."""
    _check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return None
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    quant = kernel_quant_code(k_cache.dtype)
    args = (
        k,
        v,
        as_raw(k_cache),
        as_raw(v_cache),
        slot_mapping,
        k_scale.view(torch.int16) if quant else slot_mapping,  # not read without quantization
        v_scale.view(torch.int16) if quant else slot_mapping,
        num_blocks * block_size,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
    )
    constexprs = dict(
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        QUANT=quant,
    )
    num_warps = 1 if num_kv_heads * head_dim <= 512 else 4
    return KernelLaunch(_store_kv_kernel, (num_tokens,), args, constexprs, {"num_warps": num_warps})


# (the slot mapping, its version, the cache's slot count) last checked by ``_check_slots``.
# The model hands every layer's store the same slot mapping tensor, so its values are checked
# once per step, not per layer (on a GPU each check is a host sync).
_checked_slots: tuple[weakref.ref, int, int] | None = None


def _version(t: torch.Tensor) -> int:
    """The tensor's write counter; -1 for a tensor made under ``torch.inference_mode()`` (the
    model runner's), which keeps none: a write into it after its check goes unseen here, and
    only the kernel's own guard keeps a slot it made bad from being written."""
    return -1 if t.is_inference() else t._version


def _check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot of ``slot_mapping`` inside the cache, checked unless this very tensor (not
    written since) was already checked against a cache of ``num_slots`` slots."""
    global _checked_slots
    last = _checked_slots
    if last is not None and last[0]() is slot_mapping and last[1:] == (_version(slot_mapping), num_slots):
        return
    lo, hi = (int(x) for x in torch.aminmax(slot_mapping))
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"slot_mapping names slots outside the cache (0..{num_slots - 1}), got {lo}..{hi}")
    _checked_slots = (weakref.ref(slot_mapping), _version(slot_mapping), num_slots)


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

    Values are converted to the cache's dtype, or quantized with their scales written to
    ``k_scale`` / ``v_scale`` for an 8-bit cache. A slot outside the cache is a ValueError
    (as on the PyTorch path) and nothing is written; the slots are checked once per slot
    mapping tensor and cache size, not per layer.
    """
    launch = plan_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if launch is not None:
        _check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
        run_launches([launch], k_cache.device)


__all__ = ["KernelLaunch", "plan_store_kv", "run_launches", "store_kv"]
