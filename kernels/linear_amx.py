"""Dense layers in bfloat16 by AMX tiles with the weight packed once (``csrc/linear_amx.c``), on
CPUs with AMX; PyTorch's matmul everywhere else.

Owns ``AmxWeight`` (a bfloat16 ``[out, in]`` weight in the tile unit's layout, packed from the
tensor it remembers), ``pack`` (an ``AmxWeight``, or None where the kernel does not apply),
``pack_swiglu`` (the same for SwiGLU's fused gate/up weight), ``takes(x)`` (whether a call with
these rows goes to the kernel), ``linear`` and ``swiglu`` (``silu(gate) * up`` straight from the
tiles: the bits of ``linear`` followed by ``cpu_ops.silu_mul``, without the intermediate twice as
wide).

Why. PyTorch's bfloat16 matmul (oneDNN) lays the weight out for the tile unit again on every
call. On one core of a Xeon with AMX, against ``F.linear`` on the same operands (CPU time):
1.35-2.4x from 1 to 64 rows (SmolLM2's and the 0.5B shape's layers and LM heads, weights read at
10-26 GB/s instead of 8-10). From 512 rows on, oneDNN's rate depends on the row count: on both
cores, SmolLM2's qkv, o and down projections together (wall time, 2026-12-06) take 1.6x the
kernel's time at 576 rows, 1.5-1.6x from 640 to 1280 (the rows of a step that mixes decoding
sequences with a few prompt chunks), and 0.85-0.9x at 1536 to 4096, where oneDNN's blocking for
long prompts is better: calls of more than ``MAX_ROWS`` rows stay with PyTorch. The fused SwiGLU
is the exception (``takes(x, None)``): PyTorch would need the SwiGLU kernel's pass over the
intermediate too, which the tiles' epilogue does while the tile unit sums the next block.

Numerics: float32 sums of exact bfloat16 products in the tile unit's order, the bias added in
float32, one rounding to bfloat16; a row's result does not depend on the other rows or the
thread count. Not oneDNN's order, so the last bits differ from ``F.linear`` (the tests hold
both to the float32 product within bfloat16 rounding). ``MQINFER_CPU_LINEAR=torch`` turns it
off with the other dense kernels.
"""

from __future__ import annotations

import ctypes

import torch

from mqinfer.kernels import native
from mqinfer.kernels.linear import dense_library

# Calls with more rows go to PyTorch (see above).
MAX_ROWS = 1280
# The kernel's K blocks: in_features must be a multiple of this.
K_BLOCK = 32

def _library() -> ctypes.CDLL | None:
    return dense_library("mqinfer_amx_linear_available")


def available() -> bool:
    """Whether bfloat16 dense layers can take the AMX kernel here (CPU, OS, compiler, switch)."""
    return _library() is not None


# Features per panel of the packed weight.
PANEL = 16


class AmxWeight:
    """A bfloat16 ``[out_features, in_features]`` weight packed for the kernel; remembers the
    tensor it was packed from (``packed_from``), as ``linear.PackedWeight`` does. ``inter``: for
    SwiGLU's gate/up weight (``pack_swiglu``), the intermediate size (gate rows first, then as
    many up rows), packed with the gate's and the up projection's panels of 16 features
    alternating; 0 for a plain weight."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL, swiglu: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.source = weight
        self.inter = self.out_features // 2 if swiglu else 0
        if swiglu:
            weight = _alternate_panels(weight, self.inter)
        weight = weight.contiguous()
        rows = weight.shape[0]
        size = lib.mqinfer_amx_linear_packed_size(rows, self.in_features)
        self.data = torch.empty(int(size), dtype=torch.bfloat16)
        lib.mqinfer_amx_linear_pack(weight.data_ptr(), rows, self.in_features, self.data.data_ptr())

    def packed_from(self, weight: torch.Tensor) -> bool:
        return (weight.data_ptr() == self.source.data_ptr() and weight.shape == self.source.shape
                and weight.dtype == self.source.dtype)


def pack(weight: torch.Tensor) -> AmxWeight | None:
    """``weight`` packed for the kernel, or None where it does not apply (then use ``F.linear``):
    not a 2-D bfloat16 CPU tensor, in_features not a multiple of 32, no AMX, or the switch."""
    if (weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or weight.shape[1] % K_BLOCK):
        return None
    lib = _library()
    return None if lib is None else AmxWeight(weight, lib)


def _alternate_panels(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """``[2 * inter, K]`` gate/up rows as panels of 16 alternating (gate features 0-15, up features
    0-15, gate 16-31, ...), each half zero-padded to a whole panel."""
    padded = -(-inter // PANEL) * PANEL
    halves = torch.zeros(2, padded, weight.shape[1], dtype=weight.dtype)
    halves[:, :inter] = weight.view(2, inter, -1)
    return halves.view(2, padded // PANEL, PANEL, -1).transpose(0, 1).reshape(2 * padded, -1)


def pack_swiglu(weight: torch.Tensor) -> AmxWeight | None:
    """SwiGLU's fused gate/up weight ``[2 * I, in_features]`` (gate rows first) packed for
    ``swiglu``, or None where the kernel does not apply (as ``pack``, or an odd row count)."""
    if (weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or weight.shape[1] % K_BLOCK or weight.shape[0] % 2):
        return None
    lib = _library()
    return None if lib is None else AmxWeight(weight, lib, swiglu=True)


def takes(x: torch.Tensor, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether rows ``x`` go to the kernel: 2-D bfloat16 on CPU, at most ``max_rows`` of them
    (None: any number), the kernel available."""
    return (x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] > 0
            and (max_rows is None or x.shape[0] <= max_rows) and x.shape[1] % K_BLOCK == 0 and available())


def _operands(x: torch.Tensor, weight: AmxWeight, out: torch.Tensor | None,
              cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The call's rows (``x`` checked, made contiguous where its strides do not suit the kernel),
    its ``[T, cols]`` output (``out`` checked, or a new tensor) and the rows' stride."""
    rows, features = x.shape
    if features != weight.in_features or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"x must be a bfloat16 CPU tensor [T, {weight.in_features}], got {list(x.shape)} {x.dtype}")
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < features):
        x = x.contiguous()
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
    elif out.shape != (rows, cols) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor [{rows}, {cols}]")
    return x, out, x.stride(0) if rows > 1 else features


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"the AMX dense-layer kernel failed (status {status})")


def linear(x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bfloat16 ``x`` ``[T, in_features]`` (unit column stride), into
    ``out`` (a contiguous bfloat16 ``[T, out_features]``) when given."""
    x, out, x_stride = _operands(x, weight, out, weight.out_features)
    if bias is not None and (bias.shape != (weight.out_features,) or bias.dtype != torch.bfloat16
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous bfloat16 tensor [{weight.out_features}]")
    args = native.AmxLinearArgs(
        x=x.data_ptr(), packed=weight.data.data_ptr(), bias=None if bias is None else bias.data_ptr(),
        out=out.data_ptr(), rows=x.shape[0], in_features=weight.in_features, out_features=weight.out_features,
        x_stride=x_stride, out_stride=weight.out_features)
    _check(_library().mqinfer_amx_linear(ctypes.byref(args), torch.get_num_threads()))
    return out


def swiglu(x: torch.Tensor, weight: AmxWeight, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]`` of ``x``'s gate/up projection (``weight`` from
    ``pack_swiglu``), into ``out`` (a contiguous bfloat16 ``[T, I]``) when given: the bits of
    ``linear`` with the same weight followed by ``cpu_ops.silu_mul`` (``vector_chunk`` as there, a
    multiple of 16)."""
    if not weight.inter:
        raise ValueError("swiglu takes a weight packed by pack_swiglu")
    if vector_chunk < 0 or vector_chunk % PANEL:
        raise ValueError(f"vector_chunk must be a non-negative multiple of {PANEL}, got {vector_chunk}")
    x, out, x_stride = _operands(x, weight, out, weight.inter)
    args = native.AmxSwigluArgs(
        x=x.data_ptr(), packed=weight.data.data_ptr(), out=out.data_ptr(), rows=x.shape[0],
        in_features=weight.in_features, inter=weight.inter, x_stride=x_stride, out_stride=weight.inter,
        vector_chunk=vector_chunk)
    _check(_library().mqinfer_amx_swiglu(ctypes.byref(args), torch.get_num_threads()))
    return out


__all__ = ["AmxWeight", "MAX_ROWS", "available", "linear", "pack", "pack_swiglu", "swiglu", "takes"]
