"""Dense layers on CPU in float32 by the native kernel (``csrc/linear.c``), with weights packed
once into the kernel's panel layout; PyTorch's matmul everywhere else.

Owns ``PackedWeight`` (a weight in the kernel's layout, packed from an ``[out, in]`` float32
weight), ``pack`` (a ``PackedWeight``, or None where the kernel does not apply),
``linear`` (``x @ W.T + bias`` with a packed weight), and SwiGLU fused into its projection:
``pack_swiglu`` and ``swiglu`` (``silu(gate) * up`` straight from the gate/up projection's
registers: the projection's output, 2 x the MLP width, is never written out).

Why. On a CPU with AVX2 and no AVX-512 MKL's sgemm runs a decode step's layers (64 rows) at
50-60 GFLOP/s and a 49152-word LM head at 46, against about 75 for a prefill's 4096 rows: it
re-packs the weight, read cold from memory, on every call. The packed kernel streams each
weight panel once and reaches 70-80 GFLOP/s at 64 rows (and MKL's rate at 4096).

Numerics. Each output is one chain of fused multiply-adds over the input features in order,
plus the bias: a row's result does not depend on the rest of the batch or on the thread count,
and differs from PyTorch's (MKL's blocked sums) in the last bits only; the tests hold it to
float32 rounding of the dot products (relative ``1e-5`` of the sum of absolute products).

On an AVX-512 CPU (MKL's kernels are twice as wide there), without a compiler, for other
dtypes or devices, or with ``MQINFER_CPU_LINEAR=torch``, ``pack`` returns None and callers use
``F.linear``. ``=native`` makes a library that cannot be built an error.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from mqinfer.kernels import native

_SWITCH = "MQINFER_CPU_LINEAR"


def dense_library(available: str = "mqinfer_linear_available") -> ctypes.CDLL | None:
    """The native library under the dense layers' switch, when its function ``available`` says it
    has that kernel for this CPU; None otherwise (float32, w8a8 and w8a16 kernels alike)."""
    lib = native.switched_library(_SWITCH)
    return lib if lib is not None and _has_kernel(lib, available) else None


@functools.cache
def _has_kernel(lib: ctypes.CDLL, available: str) -> bool:
    return bool(getattr(lib, available)())


def _library() -> ctypes.CDLL | None:
    return dense_library()


def checked_io(x: torch.Tensor, in_features: int, out_features: int, out: torch.Tensor | None,
               dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (one of ``dtypes``, float32 unless told, CPU, ``[T, in_features]``; made contiguous
    where its rows are not laid out as the kernels read them) and the output ``[T, out_features]``
    in ``x``'s dtype (``out``, checked, or a new tensor) for a native dense-layer call."""
    rows, features = x.shape
    if features != in_features or x.dtype not in dtypes or x.device.type != "cpu":
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"x must be a {names} CPU tensor [T, {in_features}], got "
                         f"{list(x.shape)} {x.dtype} on {x.device}")
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < features):
        x = x.contiguous()
    if out is None:
        out = torch.empty(rows, out_features, dtype=x.dtype)
    elif out.shape != (rows, out_features) or out.dtype != x.dtype or not out.is_contiguous():
        name = str(x.dtype).removeprefix("torch.")
        raise ValueError(f"out must be a contiguous {name} tensor [{rows}, {out_features}], got "
                         f"{list(out.shape)} {out.dtype}")
    return x, out


def native_linear_available() -> bool:
    """Whether dense layers use the native kernel here (switch, compiler and CPU allowing)."""
    return _library() is not None


class PackedWeight:
    """A float32 ``[out_features, in_features]`` weight in the kernel's layout: panels of 16
    output features, each ``[in_features, 16]``. Remembers the tensor it was packed from, so
    that a caller can tell when the weight it holds has been replaced.

    For SwiGLU (``swiglu`` True) the weight is the fused gate/up projection ``[2 * I, in]``,
    ``out_features`` is I, each panel holds 8 gate then the same 8 up features, and ``bias``
    is the projection's bias in that order (None without one)."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL, swiglu: bool = False,
                 bias: torch.Tensor | None = None) -> None:
        rows, self.in_features = weight.shape
        self.swiglu = swiglu
        self.out_features = rows // 2 if swiglu else rows
        weight = weight.contiguous()
        size = (lib.mqinfer_linear_swiglu_packed_size if swiglu else lib.mqinfer_linear_packed_size)(
            self.out_features, self.in_features)
        self.data = torch.empty(int(size), dtype=torch.float32)
        (lib.mqinfer_linear_pack_swiglu if swiglu else lib.mqinfer_linear_pack)(
            weight.data_ptr(), self.out_features, self.in_features, self.data.data_ptr())
        self.source = weight
        self.bias = None
        if swiglu and bias is not None:
            inter = self.out_features
            groups = -(-inter // 8)
            padded = torch.zeros(2, groups * 8, dtype=torch.float32)
            padded[0, :inter], padded[1, :inter] = bias[:inter], bias[inter:]
            # [gate 8p..8p+7, up 8p..8p+7] for each p, as the packing lays out the rows.
            self.bias = padded.view(2, groups, 8).transpose(0, 1).contiguous().view(-1)

    def packed_from(self, weight: torch.Tensor) -> bool:
        return (weight.data_ptr() == self.source.data_ptr() and weight.shape == self.source.shape
                and weight.dtype == self.source.dtype)


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` packed for the native kernel, or None where the kernel does not apply (then
    use ``F.linear``): not a 2-D float32 CPU tensor, no kernel for this CPU, or the switch."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    lib = _library()
    return None if lib is None else PackedWeight(weight, lib)


def pack_swiglu(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """SwiGLU's fused gate/up projection ``[2 * I, in]`` (gate rows first) and its bias packed
    for ``swiglu``, or None where the kernel does not apply (as ``pack``)."""
    if (weight.dim() != 2 or weight.shape[0] % 2 or weight.dtype != torch.float32
            or weight.device.type != "cpu" or (bias is not None and bias.dtype != torch.float32)):
        return None
    lib = _library()
    return None if lib is None else PackedWeight(weight, lib, swiglu=True, bias=bias)


def _threads(rows: int, weight: PackedWeight) -> int:
    # Below about 2M multiply-adds (some 50 us on one core) waking the pool's threads costs
    # more than they gain.
    return torch.get_num_threads() if rows * weight.in_features * weight.out_features >= (1 << 21) else 1


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[T, in_features]`` (float32, CPU, unit column stride),
    into ``out`` (a contiguous ``[T, out_features]`` float32 tensor) when given."""
    if weight.swiglu:
        raise ValueError("a weight packed for SwiGLU goes to swiglu(), not linear()")
    return _run(x, weight, bias, out, swiglu=False, vector_chunk=0)


def swiglu(x: torch.Tensor, weight: PackedWeight, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` ``[T, I]`` for a gate/up weight packed by
    ``pack_swiglu``: bit for bit the native projection followed by ``cpu_ops.silu_mul``.
    ``vector_chunk`` as ``silu_mul`` takes it (how many leading columns of a row PyTorch's
    SiLU sends through its vectorised exponential, in whole chunks; a multiple of 8)."""
    if not weight.swiglu:
        raise ValueError("swiglu() needs a weight packed by pack_swiglu")
    if vector_chunk < 0 or vector_chunk % 8:
        raise ValueError(f"vector_chunk must be a multiple of 8, got {vector_chunk}")
    return _run(x, weight, weight.bias, out, swiglu=True, vector_chunk=vector_chunk)


def _run(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor | None,
         swiglu: bool, vector_chunk: int) -> torch.Tensor:
    lib = native.load()
    rows, features = x.shape
    x, out = checked_io(x, weight.in_features, weight.out_features, out)
    if not swiglu and bias is not None and (bias.shape != (weight.out_features,) or bias.dtype != torch.float32
                                            or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor [{weight.out_features}]")
    args = native.LinearArgs(
        x=x.data_ptr(), packed=weight.data.data_ptr(), bias=None if bias is None else bias.data_ptr(),
        out=out.data_ptr(), rows=rows, in_features=features, out_features=weight.out_features,
        x_stride=x.stride(0) if rows > 1 else features, out_stride=weight.out_features,
        swiglu=int(swiglu), vector_chunk=vector_chunk,
    )
    status = lib.mqinfer_linear(ctypes.byref(args), _threads(rows, weight))
    if status != 0:
        raise RuntimeError(f"the native dense-layer kernel failed (status {status})")
    return out


__all__ = ["PackedWeight", "linear", "native_linear_available", "pack", "pack_swiglu", "swiglu"]
