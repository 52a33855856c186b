"""Dense layers with int8 weights and float32 activations (w8a16) on CPU, by the native kernel
(``csrc/linear_w8a16.c``).

Owns ``W8A16Weight`` (an int8 weight, one float32 scale per output feature, and the bias, in the
kernel's layout), ``pack`` (one, or None where the kernel does not apply), ``linear`` and
``swiglu`` (SwiGLU fused into its gate/up projection, as ``kernels.linear.swiglu``). The
quantization itself is ``linear_int8.quantize_weight``'s.

How. The weight stays int8 in memory, packed in the float32 kernel's panels (a byte a weight);
each panel is widened and scaled into a small cached float32 panel and goes through the float32
kernel's register tiles. So a call gives, bit for bit, ``kernels.linear`` on the dequantized
weight ``qweight.float() * scale[:, None]``; PyTorch's path (dequantize, then ``F.linear``) sums
in MKL's order and agrees to float32 rounding only.

Why. A decode step of a few rows is bound by reading the weights, and int8 weights are a
quarter of float32's bytes: on one AVX2 core with the weights read from memory this ran at
2.6-3.1x the float32 kernel's rate at 1 row and 1.1-1.3x at 16; at 256 rows, where the
float32 kernel is bound by arithmetic, the widening costs up to a tenth (0.90-1.0x).
``loadgen/bench_dense.py`` measures it; BENCHMARKS.md has the table. ``MQINFER_CPU_LINEAR=torch`` turns it off with
the other dense kernels.
"""

from __future__ import annotations

import ctypes

import torch

from mqinfer.kernels import native
from mqinfer.kernels.linear import checked_io, dense_library
from mqinfer.kernels.int8_weight import Int8Weight, pack_for


def _library() -> ctypes.CDLL | None:
    return dense_library("mqinfer_w8a16_available")


def native_available() -> bool:
    """Whether w8a16 layers use the native kernel here (switch, compiler and CPU allowing)."""
    return _library() is not None


class W8A16Weight(Int8Weight):
    """An int8 weight with its per-feature scales (and bias) in the w8a16 kernel's layout:
    panels of 16 output features, ``[in_features, 16]`` bytes each; scales and bias in the
    panels' column order, zero-padded to whole panels.

    For SwiGLU (``swiglu`` True) the weight is the fused gate/up projection ``[2 * I, in]``
    and ``out_features`` is I; each panel holds 8 gate and the same 8 up features."""

    PACKED_SIZE, PACK = "mqinfer_w8a16_packed_size", "mqinfer_w8a16_pack"


def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         swiglu: bool = False) -> W8A16Weight | None:
    """An int8 ``[out, in]`` weight (``[2 * I, in]`` gate rows first with ``swiglu``), its
    float32 scales ``[out]`` and bias packed for the native kernel, or None where the kernel
    does not apply (then dequantize and use ``F.linear``)."""
    return pack_for(W8A16Weight, _library(), qweight, scale, bias, swiglu)


def _threads(rows: int, weight: W8A16Weight) -> int:
    # As the float32 kernel: below about 2M multiply-adds, waking the pool costs more.
    return torch.get_num_threads() if rows * weight.in_features * weight.out_features >= (1 << 21) else 1


def linear(x: torch.Tensor, weight: W8A16Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] -> [T, out]`` (float32, CPU, unit column stride) with the weight's own bias,
    into ``out`` (contiguous float32) when given."""
    if weight.swiglu:
        raise ValueError("a weight packed for SwiGLU goes to swiglu(), not linear()")
    return _run(x, weight, out, 0)


def swiglu(x: torch.Tensor, weight: W8A16Weight, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]`` from the gate/up projection: bit for bit the projection
    followed by ``cpu_ops.silu_mul`` (``vector_chunk`` as there)."""
    if not weight.swiglu:
        raise ValueError("swiglu() needs a weight packed with swiglu=True")
    if vector_chunk < 0 or vector_chunk % 8:
        raise ValueError(f"vector_chunk must be a multiple of 8, got {vector_chunk}")
    return _run(x, weight, out, vector_chunk)


def _run(x: torch.Tensor, weight: W8A16Weight, out: torch.Tensor | None, vector_chunk: int) -> torch.Tensor:
    lib = native.load()
    rows, features = x.shape
    x, out = checked_io(x, weight.in_features, weight.out_features, out)
    args = native.W8A16Args(
        x=x.data_ptr(), packed=weight.data.data_ptr(), scales=weight.scales.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(), out=out.data_ptr(),
        rows=rows, in_features=features, out_features=weight.out_features,
        x_stride=x.stride(0) if rows > 1 else features, out_stride=weight.out_features,
        swiglu=int(weight.swiglu), vector_chunk=vector_chunk,
    )
    status = lib.mqinfer_w8a16(ctypes.byref(args), _threads(rows, weight))
    if status != 0:
        raise RuntimeError(f"the native w8a16 dense-layer kernel failed (status {status})")
    return out


__all__ = ["W8A16Weight", "linear", "native_available", "pack", "swiglu"]
