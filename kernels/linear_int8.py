"""Dense layers with int8 weights: w8a8 (int8 activations too, int32 sums) and w8a16 (int8
weights, float activations).

Owns the quantization rules (``quantize_weight``: symmetric per output feature, once at load;
``quantize_rows``: symmetric per row of activations, on every call), the native w8a8 kernel's
packing (``pack``; the packed ``Int8Weight`` is ``int8_weight``'s) and calls (``linear``, ``swiglu``),
and the PyTorch path that runs wherever that kernel does not (``reference_linear``: ``torch._int_mm``, oneDNN on
CPUs, cuBLAS on CUDA).

Both paths compute the same thing and, on CPU, the same bits: exact int32 sums of
``q_x * q_w``, then ``((float)sum * x_scale) * w_scale + bias`` in float32.

Why a native kernel. On a CPU with AVX2 and no VNNI, ``torch._int_mm`` runs at about 1 GOP/s;
``csrc/linear_int8.c`` multiplies with ``vpmaddubsw`` and reaches close to twice the float32
kernel's rate at the model's shapes. On a CPU with AVX-512 VNNI the same file multiplies with
``vpdpbusd`` (the weight packed with its column sums, see there), and takes bfloat16 rows as
well (``native_takes_bf16``): at the standard benchmark model's shapes on two Zen 4 cores it
ran at 1.2-2.8x bfloat16 ``F.linear``'s rate from 1 to 2048 rows, and 1.2-3.9x the PyTorch path
(``reference_linear``) up to 256 rows. ``MQINFER_CPU_LINEAR=torch`` turns it off with the
float32 kernel.

On a CPU with AMX int8 tiles, ``pack`` lays the weight out for the tile kernel instead
(``linear_amx_int8``: same bits, its switch ``MQINFER_W8A8_AMX``), and ``linear`` / ``swiglu``
run the kernel the weight was packed for.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from mqinfer.kernels import linear_amx_int8, native
from mqinfer.kernels.int8_weight import (  # noqa: F401  (re-exported: the packed weight's names)
    PANEL, Int8Weight, int8_library, native_available, native_takes_bf16, pack_for,
)
from mqinfer.kernels.linear import checked_io
QMAX = 127


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float weight -> (int8 ``[out, in]``, float32 scale ``[out]``), symmetric per
    output feature: ``scale = max|w| / 127``, ``q = round(w * 127 / max|w|)`` (a zero row has
    scale 0), so ``q * scale`` is the weight to half a step."""
    return quantize_rows(weight.float())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``[T, K]`` -> (int8 ``[T, K]``, float32 scale ``[T]``), symmetric per row, with the
    native kernel's arithmetic: ``q = round-half-even(x * (127 / max|x|))``."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    # A true division, as the kernel's: ``QMAX / amax`` in PyTorch is amax.reciprocal() * QMAX,
    # which rounds differently in the last bit.
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    # A row so small that the quotient overflows (max|x| below about 4e-37) counts as zero.
    inv = torch.where(torch.isinf(inv), torch.zeros_like(inv), inv)
    q = torch.round(x * inv[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, torch.where(inv > 0, amax / QMAX, torch.zeros_like(amax))


def padded_int_mm(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm(qx, qw.t())`` for any shape, as CUDA's rules need it: zero rows and
    columns are added up to more than 16 rows and K, N multiples of 8 (zeros change no sum), and
    cut off the result. CUDA has no int64 matmul to fall back on (cuBLAS has no integer GEMM).
    Only what needs it is copied: a decode step's few rows, the weight only where K or N is not
    a multiple of 8."""
    rows, k = qx.shape
    n = qw.shape[0]
    pad_k = -k % 8
    if pad_k or rows <= 16:
        qx = torch.nn.functional.pad(qx, (0, pad_k, 0, max(0, 17 - rows)))
    if pad_k or n % 8:
        qw = torch.nn.functional.pad(qw, (0, pad_k, 0, -n % 8))
    return torch._int_mm(qx, qw.t())[:rows, :n]


def int_matmul(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``qx [T, K] @ qw [N, K]^T``: ``torch._int_mm`` (on CUDA padded to its shape
    rules, ``padded_int_mm``), or on a CPU int64 products for a single input feature."""
    if qx.device.type == "cuda":
        return padded_int_mm(qx, qw)
    # On CPU, torch._int_mm returns uninitialised memory for a single input feature (and
    # more than one output feature).
    if qx.shape[1] > 1:
        return torch._int_mm(qx, qw.t())
    return (qx.long() @ qw.long().t()).int()


def reference_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """w8a8 ``[T, in] -> [T, out]`` in PyTorch: per-row int8 activations, exact int32 sums, then
    the native kernel's float32 scaling; the result in ``x``'s dtype."""
    qx, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = int_matmul(qx, qweight).float() * xs[:, None] * scale[None, :].float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         swiglu: bool = False) -> Int8Weight | None:
    """An int8 ``[out, in]`` weight (``[2 * I, in]`` gate rows first with ``swiglu``) packed for
    the native kernel, or None where it does not apply (then use ``reference_linear``): for the
    AMX int8 kernel where that applies (``linear_amx_int8.pack``), else for the VNNI or AVX2 one."""
    packed = linear_amx_int8.pack(qweight, scale, bias, swiglu)
    return packed if packed is not None else pack_for(Int8Weight, int8_library(), qweight, scale, bias, swiglu)


_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's buffer for the quantized activations, grown to the largest call seen: a
    fresh one per call would cost a new memory mapping at every large prefill's layer."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _local.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return buffer


def _threads(rows: int, weight: Int8Weight) -> int:
    # As the float32 kernel: below about 2M multiply-adds, waking the pool costs more.
    return torch.get_num_threads() if rows * weight.in_features * weight.out_features >= (1 << 21) else 1


def linear(x: torch.Tensor, weight: Int8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """w8a8 ``x [T, in] -> [T, out]`` (float32, CPU; or bfloat16 where ``native_takes_bf16()``)
    with the weight's own bias, into ``out`` (contiguous, ``x``'s dtype) when given."""
    if weight.swiglu:
        raise ValueError("a weight packed for SwiGLU goes to swiglu(), not linear()")
    return _run(x, weight, out, 0)


def swiglu(x: torch.Tensor, weight: Int8Weight, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]`` from the w8a8 gate/up projection: bit for bit the
    projection followed by ``cpu_ops.silu_mul`` (``vector_chunk`` as there). Rows as in
    ``linear``."""
    if not weight.swiglu:
        raise ValueError("swiglu() needs a weight packed with swiglu=True")
    if vector_chunk < 0 or vector_chunk % 8:
        raise ValueError(f"vector_chunk must be a multiple of 8, got {vector_chunk}")
    return _run(x, weight, out, vector_chunk)


def _run(x: torch.Tensor, weight: Int8Weight, out: torch.Tensor | None, vector_chunk: int) -> torch.Tensor:
    lib = native.load()
    weight = weight.for_call()
    rows, features = x.shape
    dtypes = (torch.float32, torch.bfloat16) if native_takes_bf16() else (torch.float32,)
    x, out = checked_io(x, weight.in_features, weight.out_features, out, dtypes)
    scratch = _scratch(int(getattr(lib, weight.SCRATCH_SIZE)(rows, features)))
    args = native.QLinearArgs(
        x=x.data_ptr(), packed=weight.data.data_ptr(), scales=weight.scales.data_ptr(),
        bias=None if weight.bias is None else weight.bias.data_ptr(), out=out.data_ptr(),
        scratch=scratch.data_ptr(), rows=rows, in_features=features, out_features=weight.out_features,
        x_stride=x.stride(0) if rows > 1 else features, out_stride=weight.out_features,
        swiglu=int(weight.swiglu), vector_chunk=vector_chunk, is_bf16=int(x.dtype == torch.bfloat16),
    )
    status = getattr(lib, weight.RUN)(ctypes.byref(args), _threads(rows, weight))
    if status != 0:
        raise RuntimeError(f"the native int8 dense-layer kernel failed (status {status})")
    return out


__all__ = ["Int8Weight", "int_matmul", "padded_int_mm", "linear", "native_available", "native_takes_bf16", "pack", "pack_for", "quantize_rows",
           "quantize_weight", "reference_linear", "swiglu"]
