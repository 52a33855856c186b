"""w8a8 dense layers by AMX int8 tiles (``csrc/linear_amx_int8.c``), on CPUs with AMX; the AVX-512
VNNI kernel (``linear_int8``) everywhere else.

Owns ``AmxInt8Weight`` (an int8 weight in the tile unit's layout, packed once) and ``enabled()``
(whether ``linear_int8.pack`` packs for this kernel). Callers go through ``linear_int8``:
``pack`` returns an ``AmxInt8Weight`` where this kernel applies, and ``linear`` / ``swiglu``
run the kernel the weight's ``for_call()`` names (this one unless switched off, below).

Why. The VNNI kernel does 64 multiply-adds per instruction; a tile product does 16 x 16 x 64.
On one core of this session's Xeon (bfloat16 rows, SmolLM2's 1536 -> 576 and 576 -> 1536
projections, weights in cache) this kernel ran 2.3-2.5x the VNNI kernel at 16 rows and
2.7-2.9x at 64 and 256 (1.4-1.5 TOP/s), and 1.3-1.5x the bfloat16 AMX kernel (``linear_amx``)
at 64 and 256; at one row both int8 kernels read the weight at the same rate (0.9x in cache,
1.04x from memory). The engine's w8a8 (standard workload, 2 workers x 1 thread) went from 0.79x
of bfloat16's throughput to 1.17x (``mqinfer bench --quantization w8a8 --compare unquantized
--rounds 3``, medians, with ``MQINFER_W8A8_AMX=off`` and without).

Numerics: the VNNI kernel's result bit for bit, hence ``reference_linear``'s: the tiles' int32
sums are exact (signed by signed bytes, no saturation), and the quantization of the rows and
the scaling after the sums are the same operations (see the C source).

Switches. ``MQINFER_W8A8_AMX=off`` (or ``0``) keeps w8a8 layers on the VNNI kernel;
``MQINFER_CPU_LINEAR=torch`` turns off every native dense kernel, this one included. The switch
is read at every call, as ``MQINFER_ATTENTION_AMX`` is (``profile_engine --ab`` alternates it in
one engine): a weight packed for this kernel runs on the VNNI kernel while it is off, through a
second copy of the weight in the VNNI layout, packed on the first such call and kept. A weight
packed while the switch is off is the VNNI kernel's for good.
"""

from __future__ import annotations

import ctypes
import os

import torch

from mqinfer.kernels.linear import dense_library
from mqinfer.kernels.int8_weight import Int8Weight, native_takes_bf16, pack_for

SWITCH = "MQINFER_W8A8_AMX"

def library() -> ctypes.CDLL | None:
    """The native library where it has this kernel and the OS grants the tiles (the dense
    layers' switch allowing); None otherwise."""
    return dense_library("mqinfer_amx_qlinear_available")


def switched_on() -> bool:
    """``MQINFER_W8A8_AMX``: on unless ``off`` or ``0``; another value is a ValueError."""
    value = os.environ.get(SWITCH, "on").strip().lower()
    if value not in ("on", "1", "off", "0"):
        raise ValueError(f"{SWITCH} must be on or off, got {value!r}")
    return value in ("on", "1")


def enabled() -> bool:
    """Whether ``linear_int8.pack`` packs w8a8 weights for this kernel now: the switch on, the
    kernel here (AMX int8 tiles, granted), and the VNNI kernel too (whose bfloat16 rows the
    callers count on, ``linear_int8.native_takes_bf16``)."""
    return switched_on() and library() is not None and native_takes_bf16()


class AmxInt8Weight(Int8Weight):
    """An ``Int8Weight`` packed for this kernel: the same panels of features (so the scales and
    bias in the same order), K zero-padded to a multiple of 64, no column sums."""

    PACKED_SIZE, PACK = "mqinfer_amx_qlinear_packed_size", "mqinfer_amx_qlinear_pack"
    SCRATCH_SIZE, RUN = "mqinfer_amx_qlinear_scratch_size", "mqinfer_amx_qlinear"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 lib: ctypes.CDLL, swiglu: bool = False) -> None:
        super().__init__(qweight, scale, bias, lib, swiglu)
        self._scale, self._bias = scale, bias
        self.vnni: Int8Weight | None = None  # the VNNI kernel's copy, made when the switch is off

    def for_call(self) -> Int8Weight:
        """This weight while the switch is on; while it is off, the same weight packed for the
        VNNI kernel (on the first such call, then kept)."""
        if switched_on():
            return self
        if self.vnni is None:
            lib = dense_library("mqinfer_qlinear_available")
            if lib is None:
                raise RuntimeError("the VNNI int8 kernel is not available for this weight's call")
            self.vnni = Int8Weight(self.source, self._scale, self._bias, lib, self.swiglu)
        return self.vnni


def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         swiglu: bool = False) -> AmxInt8Weight | None:
    """``qweight`` packed for this kernel (an ``AmxInt8Weight``), or None where it does not apply:
    not ``enabled()``, not a 2-D int8 CPU weight (with an even number of rows for SwiGLU), or no
    input features."""
    if not enabled() or qweight.dim() != 2 or qweight.shape[1] == 0:
        return None
    return pack_for(AmxInt8Weight, library(), qweight, scale, bias, swiglu)


__all__ = ["AmxInt8Weight", "SWITCH", "enabled", "library", "pack", "switched_on"]
