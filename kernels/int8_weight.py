"""The native w8a8 kernel's packed weight: ``Int8Weight`` (an int8 weight with its per-feature
scales and bias in the kernel's panel layout, packed once), ``pack_for`` (packing where the kernel
applies) and whether the kernel is here (``native_available``, ``native_takes_bf16``).

``linear_int8`` runs the kernels on these weights and re-exports every name here; the AMX int8
kernel (``linear_amx_int8``) and the w8a16 kernel (``linear_w8a16``) pack their own kinds of it.
"""

from __future__ import annotations

import ctypes

import torch

from mqinfer.kernels.linear import dense_library

# Output features per packed panel.
PANEL = 16


def int8_library() -> ctypes.CDLL | None:
    """The native library where it has the w8a8 kernel (the dense layers' switch allowing)."""
    return dense_library("mqinfer_qlinear_available")


def native_available() -> bool:
    """Whether w8a8 layers use the native kernel here (switch, compiler and CPU allowing)."""
    return int8_library() is not None


def native_takes_bf16() -> bool:
    """Whether the native kernel here also takes bfloat16 rows and writes bfloat16 (the AVX-512
    VNNI kernel): ``reference_linear``'s bits, and for ``swiglu`` those of the bfloat16
    projection followed by ``cpu_ops.silu_mul``."""
    return native_available() and dense_library("mqinfer_qlinear_takes_bf16") is not None


def _panel_order(values: torch.Tensor, out_features: int, swiglu: bool) -> torch.Tensor:
    """One value per output feature (``[out]``, or ``[2 * inter]`` gate then up for SwiGLU) in
    the packed panels' column order, zero-padded to whole panels."""
    values = values.float()
    if not swiglu:
        panels = -(-out_features // PANEL)
        padded = torch.zeros(panels * PANEL, dtype=torch.float32)
        padded[:out_features] = values
        return padded
    half = PANEL // 2
    groups = -(-out_features // half)
    padded = torch.zeros(2, groups * half, dtype=torch.float32)
    padded[0, :out_features], padded[1, :out_features] = values[:out_features], values[out_features:]
    # [gate 8p..8p+7, up 8p..8p+7] for each p, as the packing lays out the rows.
    return padded.view(2, groups, half).transpose(0, 1).contiguous().view(-1)


class Int8Weight:
    """An int8 weight with its per-feature scales (and bias) in a native kernel's layout: the
    w8a8 kernel's here; ``linear_w8a16.W8A16Weight`` names the w8a16 kernel's functions.

    For SwiGLU (``swiglu`` True) the weight is the fused gate/up projection ``[2 * I, in]``
    and ``out_features`` is I; each panel holds 8 gate and the same 8 up features."""

    # The library's functions for the packed size and the packing, and (w8a8) for the scratch's
    # size and the call.
    PACKED_SIZE, PACK = "mqinfer_qlinear_packed_size", "mqinfer_qlinear_pack"
    SCRATCH_SIZE, RUN = "mqinfer_qlinear_scratch_size", "mqinfer_qlinear"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 lib: ctypes.CDLL, swiglu: bool = False) -> None:
        rows, self.in_features = qweight.shape
        self.swiglu = swiglu
        self.out_features = rows // 2 if swiglu else rows
        qweight = qweight.contiguous()
        size = getattr(lib, self.PACKED_SIZE)(self.out_features, self.in_features, int(swiglu))
        self.data = torch.empty(int(size), dtype=torch.int8)
        getattr(lib, self.PACK)(qweight.data_ptr(), self.out_features, self.in_features, int(swiglu),
                                self.data.data_ptr())
        self.source = qweight  # the tensor it was packed from (profilers name layers by it)
        self.scales = _panel_order(scale, self.out_features, swiglu)
        self.bias = None if bias is None else _panel_order(bias, self.out_features, swiglu)

    def for_call(self) -> "Int8Weight":
        """The packed weight a call runs on now: this one (``linear_amx_int8.AmxInt8Weight``
        answers by its switch)."""
        return self


def pack_for(kind: type[Int8Weight], lib: ctypes.CDLL | None, qweight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, swiglu: bool) -> Int8Weight | None:
    """``kind(qweight, ...)``, or None where the kernel does not apply: no library (``lib``
    None), or not a 2-D int8 CPU weight (with an even number of rows for SwiGLU)."""
    if (lib is None or qweight.dim() != 2 or qweight.dtype != torch.int8 or qweight.device.type != "cpu"
            or (swiglu and qweight.shape[0] % 2)):
        return None
    return kind(qweight, scale, bias, lib, swiglu)


__all__ = ["Int8Weight", "PANEL", "int8_library", "native_available", "native_takes_bf16", "pack_for"]
