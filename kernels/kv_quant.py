"""The 8-bit KV cache: what a layer's cache is, how K/V rows are quantized into it and read back.

Owns ``KV_CACHE_DTYPES`` (the ``--kv-cache-dtype`` choices), ``LayerKVCache`` (one layer's
K and V blocks and, for an 8-bit cache, their scales), the storage dtype and bytes per token of
each choice, and the plain PyTorch quantize / dequantize that every kernel is held to.

``auto`` stores K and V in the model's dtype: ``LayerKVCache(k, v)`` with no scales, and every
kernel takes the path it always took. ``int8`` and ``fp8`` (``torch.float8_e4m3fn``) store
each row of ``head_dim`` values in 8 bits with one bfloat16 scale per (slot, KV head) beside
the blocks: ``k`` / ``v`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` 8-bit,
``k_scale`` / ``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` bfloat16.

Quantization is symmetric per row: ``scale = max|x| / QMAX`` (127 for int8, 448, the largest
finite e4m3 value, for fp8) in float32, rounded up to the next bfloat16 (so that no value
divided by it passes QMAX); the stored value is ``x / scale`` rounded (to nearest, ties to
even) and clamped to ``[-QMAX, QMAX]``, and ``x ~ stored * scale``. An all-zero row stores
scale 0 and zeros (no division by zero; it reads back as exact zeros). Per-row scales, rather
than one per tensor, need no calibration and follow each token's own range; they cost 2 bytes
per ``head_dim`` values (3% at head_dim 64), so an 8-bit cache holds 1.94x the tokens of a
bfloat16 one in the same memory at head_dim 64 (1.97x at 128). A bfloat16 scale has float32's
range; rounding it up makes a row's steps at most 1/128 coarser than float32's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The largest magnitude each 8-bit format stores: a row's max |x| maps onto it.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_CACHE_DTYPES = ("auto", *_STORAGE)
SCALE_DTYPE = torch.bfloat16


class LayerKVCache(NamedTuple):
    """One layer's paged KV cache. ``k_scale`` / ``v_scale`` are None for an ``auto`` cache."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the cache, each indexed by block first (what a block copy moves)."""
        return (self.k, self.v) if self.k_scale is None else (self.k, self.v, self.k_scale, self.v_scale)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype K and V are stored in: the model's for ``auto``, else the 8-bit format."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype]


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, model_dtype_bytes: int,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V take in every layer, scales included."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        per_head = head_dim * model_dtype_bytes
    else:
        per_head = head_dim + SCALE_DTYPE.itemsize  # 8-bit values and one bfloat16 scale
    return 2 * num_layers * num_kv_heads * per_head


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> None:
    """An 8-bit cache comes with bfloat16 scales of shape ``[num_blocks, block_size, Hkv]``."""
    if k_scale is None or v_scale is None:
        raise ValueError("an 8-bit KV cache needs both k_scale and v_scale")
    if not (is_quantized_dtype(k_cache.dtype) and v_cache.dtype == k_cache.dtype):
        raise ValueError(f"scales come with int8 or float8_e4m3fn caches, got {k_cache.dtype} / {v_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != SCALE_DTYPE or tuple(s.shape) != tuple(k_cache.shape[:3]) or not s.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous bfloat16 [{', '.join(map(str, k_cache.shape[:3]))}] tensor, "
                f"got {s.dtype} {list(s.shape)}"
            )


def kernel_quant_code(dtype: torch.dtype) -> int:
    """The kernels' code for a cache dtype: 0 the model's dtype, 1 int8, 2 float8 e4m3."""
    return 1 if dtype == torch.int8 else 2 if dtype == torch.float8_e4m3fn else 0


def as_raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for float8 its bytes as uint8: PyTorch's CPU index copies and gathers
    do not take float8 tensors, and a copy of bytes is the same copy."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def scale_up_to_bfloat16(scale: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 scales rounded up (toward +infinity) to bfloat16: the top 16 bits,
    plus one where any lower bit is set; every kernel's store does the same integer arithmetic."""
    bits = scale.contiguous().view(torch.int32)
    up = ((bits & 0xFFFF) != 0).to(torch.int32)
    return ((bits >> 16) + up).to(torch.int16).view(torch.bfloat16)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (``dtype`` values ``[..., head_dim]``, bfloat16 scales ``[...]``)."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = scale_up_to_bfloat16(xf.abs().amax(dim=-1) / qmax)
    # Zero rows divide by 1 (their values are 0 anyway) and keep scale 0.
    divisor = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    y = (xf / divisor.unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * scale`` in float32 (one rounding), then ``dtype``."""
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


__all__ = [
    "KV_CACHE_DTYPES",
    "LayerKVCache",
    "SCALE_DTYPE",
    "as_raw",
    "check_kv_cache_dtype",
    "check_scales",
    "dequantize_kv",
    "is_quantized_dtype",
    "kernel_quant_code",
    "kv_bytes_per_token",
    "kv_storage_dtype",
    "quantize_kv",
    "scale_up_to_bfloat16",
]
