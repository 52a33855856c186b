"""Fused elementwise CPU kernels of the decoder and the greedy argmax, in C, with PyTorch
fallbacks that are also their reference.

Owns ``add_rms_norm`` (residual add + RMSNorm in one pass), ``silu_mul`` (SwiGLU's
``silu(gate) * up`` from the fused gate/up projection), ``rotary_store_kv`` (rotary embedding
of q and k, written in place for q and straight into the paged cache for k, with v copied to
its cache slot; into an int8 / float8 cache both are quantized on the way, scales beside them)
``greedy_argmax`` (first index of each row's maximum), ``gumbel_argmax`` (the seeded
Gumbel-max draw of temperature sampling) and ``apply_token_bitmask`` (structured output: -inf
on the logits a grammar forbids, from llguidance's packed masks).

Why. On one CPU thread the PyTorch versions of these ops run as 4-8 separate passes over the
activations each (upcast, square, mean, rsqrt, multiply, downcast, weight; neg, cat, two
multiplies and an add for rotary), and ``max(dim=-1)`` over a ``[256, 32000]`` bfloat16 logits
tensor costs ~7 ms a step where a vectorised pass costs well under 1 ms.

Numerics follow the PyTorch path rounding step by rounding step: every intermediate that
PyTorch rounds to the activation dtype is rounded here too (bfloat16: round to nearest even),
and the library is built with ``-ffp-contract=off`` so no multiply-add is fused behind our
back. RMSNorm's sum of squares follows PyTorch's summation order and SiLU uses the
exponential PyTorch's vectorised SiLU uses, on as many values of each row as PyTorch's vector
loop covers for its CPU capability, so on this PyTorch every kernel here gives the
PyTorch results bit for bit (the tests hold them to that); a PyTorch that sums or
exponentiates differently would make a last-place difference, nothing worse.

The C code is ``csrc/cpu_ops.c``, in the one native library that ``kernels/native.py``
builds (system C compiler, cached per machine, no ``-ffast-math``) together with the
attention kernel; large calls run on the library's persistent thread pool.
``MQINFER_CPU_OPS=torch`` forces the PyTorch path; ``=native`` makes a missing kernel an
error; the default ``auto`` uses the kernels for contiguous float32 / bfloat16 CPU tensors
when they build.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from mqinfer.kernels import native
from mqinfer.kernels.draws import DRAW_BITS, draw_bits, gumbel_noise, uniforms_of_draws
from mqinfer.kernels.kv_quant import check_scales, kernel_quant_code

# Below this many elements a call stays on one thread: waking the pool's threads costs more.
_PARALLEL_MIN_ELEMENTS = 1 << 16

_SWITCH = "MQINFER_CPU_OPS"


def _library() -> ctypes.CDLL | None:
    """The native library, or None when disabled or unbuildable (built on first call)."""
    return native.switched_library(_SWITCH)


@functools.cache
def _silu_vector_chunk(is_bf16: bool) -> int:
    """How many leading values of each row PyTorch's SiLU sends through its vectorised
    exponential, in whole chunks: two vectors' worth of its CPU capability (AVX-512: 64-byte
    vectors, AVX2: 32-byte); 0 for other capabilities, taken as computing every value with
    std::exp."""
    capability = torch.backends.cpu.get_cpu_capability()
    vector_bytes = 64 if "AVX512" in capability else 32 if "AVX2" in capability else 0
    return 2 * vector_bytes // (2 if is_bf16 else 4)


def silu_vector_chunk(dtype: torch.dtype) -> int:
    """``_silu_vector_chunk`` for float32 or bfloat16 rows: what the kernels that compute SiLU
    (``silu_mul``, the dense kernel's fused SwiGLU) take to agree with PyTorch."""
    return _silu_vector_chunk(dtype == torch.bfloat16)


def cpu_ops_available() -> bool:
    """Whether the native kernels are in use (False when disabled or no compiler)."""
    return _library() is not None


def native_for(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these tensors: CPU, one dtype, float32 or bfloat16."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype:
            return False
    return _library() is not None


def elementwise_threads(numel: int) -> int:
    """Threads for an elementwise kernel over `numel` values: all of torch's, or one for small work."""
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


def _output(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """``out`` when it can take a ``[rows, cols]`` result of ``dtype``, else a new tensor."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype)
    if out.shape != (rows, cols) or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU tensor [{rows}, {cols}] of {dtype}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    return out


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D with unit stride along the last dimension (rows may be strided)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]


# ------------------------------------------------------------------ greedy argmax
def reference_greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's largest value (the first NaN if a row has one), ``[B]`` int64:
    ``logits.max(dim=-1).indices``."""
    if not (logits.dim() == 2 and logits.shape[1] > 0 and _rows_ok(logits) and native_for(logits)):
        return reference_greedy_argmax(logits)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        args = native.ArgmaxArgs(
            x=logits.data_ptr(), out=out.data_ptr(), rows=rows, cols=cols,
            row_stride=logits.stride(0), is_bf16=int(logits.dtype == torch.bfloat16),
        )
        _library().mqinfer_argmax(ctypes.byref(args), elementwise_threads(logits.numel()))
    return out


# ------------------------------------------------------------------ Gumbel-max draw
# The kernel bounds a draw's noise by its bucket's largest: buckets of the top _BUCKET_BITS bits.
_BUCKET_BITS = 11


@functools.cache
def gumbel_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel noise of every draw, ``[2**DRAW_BITS]`` float32 (32 MiB, made once per process
    by PyTorch's own ``log``, so the kernel's noise is PyTorch's bit for bit whatever ``log``
    this PyTorch has), and each bucket's largest, ``[2**_BUCKET_BITS]``.

    It is ``gumbel_noise(uniforms_of_draws(arange(2**DRAW_BITS)))`` made in place in one buffer (a
    fifth of the time; every worker makes it at its first sampled token): float32 holds every
    draw below 2**24 exactly, so the uniforms and then each operation round as theirs do."""
    noise = torch.arange(1 << DRAW_BITS, dtype=torch.float32)
    noise.add_(0.5).mul_(1.0 / (1 << DRAW_BITS))  # uniforms_of_draws
    noise.log_().neg_().log_().neg_()  # gumbel_noise: -log(-log(u))
    return noise, noise.view(1 << _BUCKET_BITS, -1).amax(dim=1)


def reference_gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    noise = gumbel_noise(uniforms_of_draws(draw_bits(keys, x.shape[-1])))
    return torch.argmax(x + noise, dim=-1)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over float32 rows ``x`` ``[B, V]`` with each row's draws keyed by ``keys`` ``[B]``
    (``draws.row_keys``): ``argmax(x + gumbel_noise(uniforms_of_draws(draw_bits(keys, V))))``,
    ``[B]`` int64.

    The native kernel gives the same index (the first maximum; the first NaN of a row with one)
    without the ``[B, V]`` temporaries: it hashes a column only when its logit could still win
    and reads its noise from ``gumbel_tables`` only when the draw's bucket could (on ``[192,
    49152]`` model logits about 3 ms where PyTorch takes hundreds)."""
    if not (x.dim() == 2 and x.shape[1] > 0 and x.dtype == torch.float32 and _rows_ok(x) and native_for(x)
            and keys.shape == (x.shape[0],) and keys.dtype == torch.int64 and keys.device.type == "cpu"):
        return reference_gumbel_argmax(x, keys)
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        noise, bucket_max = gumbel_tables()
        keys = keys.contiguous()
        args = native.GumbelArgs(
            x=x.data_ptr(), keys=keys.data_ptr(), gumbel=noise.data_ptr(), bucket_max=bucket_max.data_ptr(),
            out=out.data_ptr(), rows=rows, cols=cols, row_stride=x.stride(0),
        )
        _library().mqinfer_gumbel_argmax(ctypes.byref(args), elementwise_threads(x.numel()))
    return out


# ------------------------------------------------------------------ token bitmask
_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """``[n, cols]`` bool from a packed ``[n, words]`` int32 mask: column j is bit j % 32 (least
    significant first) of word j // 32; columns past ``words * 32`` are False."""
    n, words = bitmask.shape
    bits = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).view(n, words * 32).bool()
    if words * 32 >= cols:
        return bits[:, :cols]
    return torch.cat([bits, bits.new_zeros(n, cols - words * 32)], dim=1)


def reference_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    rows = rows.to(logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: row ``rows[i]`` of ``logits`` ``[B, V]`` becomes -inf wherever row i of the packed
    ``bitmask`` ``[n, words]`` (int32) has a 0 bit (see ``unpack_bitmask``). The native kernel
    skips the all-allowed words and writes only the forbidden entries (PyTorch's ``masked_fill``
    costs ~15 ms on ``[64, 49152]`` float32 on one thread, the kernel well under 1 ms)."""
    n = bitmask.shape[0]
    if rows.shape != (n,):
        raise ValueError(f"rows must name one logits row per mask row ({n}), got shape {list(rows.shape)}")
    if not (logits.dim() == 2 and _rows_ok(logits) and native_for(logits) and bitmask.dtype == torch.int32
            and bitmask.device.type == "cpu" and bitmask.is_contiguous() and rows.dtype == torch.int64
            and rows.device.type == "cpu" and rows.is_contiguous()):
        return reference_apply_token_bitmask(logits, bitmask, rows)
    if n == 0:
        return None
    if int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]:
        raise ValueError(f"rows must be in 0..{logits.shape[0] - 1}")
    args = native.BitmaskArgs(
        x=logits.data_ptr(), bitmask=bitmask.data_ptr(), rows=rows.data_ptr(), n=n, cols=logits.shape[1],
        row_stride=logits.stride(0), words=bitmask.shape[1], is_bf16=int(logits.dtype == torch.bfloat16),
    )
    _library().mqinfer_apply_bitmask(ctypes.byref(args), elementwise_threads(n * logits.shape[1]))
    return None


# ------------------------------------------------------------------ residual add + RMSNorm
def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        residual = residual + delta
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return residual, weight * xf.to(residual.dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rms_norm(residual + delta) * weight)`` over the last dimension of
    ``[T, H]`` rows (``delta`` None: no add).

    The native kernel writes the sum into ``residual`` in place and returns it, and writes the
    normalised rows into ``out`` (a contiguous ``[T, H]`` tensor of their dtype, overlapping
    neither input) when one is given; use the returned tensors either way.
    """
    tensors = (residual, weight) if delta is None else (residual, delta, weight)
    if not (
        _rows_ok(residual) and (delta is None or (_rows_ok(delta) and delta.shape == residual.shape))
        and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == residual.shape[1]
        and native_for(*tensors)
    ):
        return reference_add_rms_norm(residual, delta, weight, eps)
    rows, hidden = residual.shape
    out = _output(out, rows, hidden, residual.dtype)
    args = native.RmsNormArgs(
        residual=residual.data_ptr(), delta=None if delta is None else delta.data_ptr(),
        weight=weight.data_ptr(), out=out.data_ptr(), rows=rows, hidden=hidden,
        residual_stride=residual.stride(0), delta_stride=0 if delta is None else delta.stride(0),
        eps=eps, is_bf16=int(residual.dtype == torch.bfloat16),
    )
    status = _library().mqinfer_add_rms_norm(ctypes.byref(args), elementwise_threads(residual.numel()))
    if status != 0:
        raise MemoryError("the native RMSNorm kernel could not allocate its buffer")
    return residual, out


# ------------------------------------------------------------------ SwiGLU
def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[T, 2 * I]``, gate first: ``[T, I]``.

    The native kernel writes into ``out`` (a contiguous ``[T, I]`` tensor of the input's dtype,
    not overlapping it) when one is given; use the returned tensor either way."""
    if not (_rows_ok(gate_up) and gate_up.shape[1] % 2 == 0 and native_for(gate_up)):
        return reference_silu_mul(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _output(out, rows, inter, gate_up.dtype)
    is_bf16 = gate_up.dtype == torch.bfloat16
    args = native.SiluMulArgs(
        gate_up=gate_up.data_ptr(), out=out.data_ptr(), rows=rows, inter=inter,
        stride=gate_up.stride(0), vector_chunk=_silu_vector_chunk(is_bf16), is_bf16=int(is_bf16),
    )
    _library().mqinfer_silu_mul(ctypes.byref(args), elementwise_threads(gate_up.numel()))
    return out


# ------------------------------------------------------------------ rotary + KV store
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary_store_kv(
    qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    from mqinfer.kernels.attention import store_kv

    cos = cos_table.index_select(0, positions).to(qk.dtype)[:, None, :]
    sin = sin_table.index_select(0, positions).to(qk.dtype)[:, None, :]
    qk = qk * cos + _rotate_half(qk) * sin
    if k_scale is None:
        store_kv(qk[:, num_q_heads:], v, k_cache, v_cache, slot_mapping)
    else:
        store_kv(qk[:, num_q_heads:], v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return qk[:, :num_q_heads]


def _heads_ok(t: torch.Tensor) -> bool:
    """[T, heads, D] with heads and elements contiguous (tokens may be strided)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


def rotary_store_kv(
    qk: torch.Tensor, v: torch.Tensor, num_q_heads: int, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, trusted: bool = False,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of ``qk`` (``[T, Hq + Hkv, D]``, q heads first) at ``positions`` from
    the float32 ``cos_table`` / ``sin_table`` (``[max_len, D]``); the rotated k and ``v``
    (``[T, Hkv, D]``) are written to the caches at ``slot_mapping``; returns the rotated q
    ``[T, Hq, D]``. The native kernel rotates q in place (the result is a view of ``qk``).

    ``trusted``: the caller has checked that ``positions`` fall inside the tables and
    ``slot_mapping`` inside the caches (the model does it once per step, not per layer).

    An 8-bit cache (``k_scale`` / ``v_scale`` given, int8 or float8 e4m3 caches): the native
    kernel quantizes each rotated k row and each v row as it writes them, with the bytes and
    scales of the PyTorch quantizing ``store_kv`` (``kv_quant.quantize_kv``)."""
    num_tokens, heads, head_dim = qk.shape
    # The kernel reads one position and one slot per token, whatever ``trusted`` says.
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(index.shape) != (num_tokens,):
            raise ValueError(f"{name} must hold one entry per token ({num_tokens}), got shape {tuple(index.shape)}")
    quantized = k_scale is not None
    if quantized:
        check_scales(k_cache, v_cache, k_scale, v_scale)
        caches_ok = (native_for(qk, v) and k_cache.device.type == "cpu"
                     and k_scale.device.type == v_scale.device.type == "cpu")
    else:
        caches_ok = native_for(qk, v, k_cache, v_cache)
    ok = (
        _heads_ok(qk) and _heads_ok(v) and v.shape == (num_tokens, heads - num_q_heads, head_dim)
        and head_dim % 2 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape[-2:] == v.shape[1:] and v_cache.shape == k_cache.shape
        and cos_table.dtype == sin_table.dtype == torch.float32
        and cos_table.is_contiguous() and sin_table.is_contiguous()
        and cos_table.shape[1] == head_dim and sin_table.shape == cos_table.shape
        and positions.dtype == slot_mapping.dtype == torch.int64
        and positions.is_contiguous() and slot_mapping.is_contiguous()
        and positions.device.type == slot_mapping.device.type == cos_table.device.type == "cpu"
        and caches_ok
    )
    if not ok:
        return reference_rotary_store_kv(qk, v, num_q_heads, cos_table, sin_table, positions,
                                         k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if num_tokens:
        num_slots = k_cache.numel() // (v.shape[1] * head_dim)
        if not trusted:  # the kernel trusts its indices
            if int(positions.min()) < 0 or int(positions.max()) >= cos_table.shape[0]:
                raise ValueError(f"positions fall outside the rotary table (0..{cos_table.shape[0] - 1})")
            if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots:
                raise ValueError(f"slot mapping names slots outside the cache (0..{num_slots - 1})")
        args = native.RotaryArgs(
            qk=qk.data_ptr(), v=v.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
            cos=cos_table.data_ptr(), sin=sin_table.data_ptr(), positions=positions.data_ptr(),
            slots=slot_mapping.data_ptr(), rows=num_tokens, qk_stride=qk.stride(0),
            v_stride=v.stride(0), num_q_heads=num_q_heads, num_kv_heads=heads - num_q_heads,
            head_dim=head_dim, is_bf16=int(qk.dtype == torch.bfloat16),
            k_scale=k_scale.data_ptr() if quantized else None,
            v_scale=v_scale.data_ptr() if quantized else None,
            kv_quant=kernel_quant_code(k_cache.dtype),
        )
        status = _library().mqinfer_rotary_store_kv(ctypes.byref(args), elementwise_threads(qk.numel()))
        if status != 0:
            raise MemoryError("the native rotary kernel could not allocate its buffer")
    return qk[:, :num_q_heads]


__all__ = [
    "add_rms_norm",
    "apply_token_bitmask",
    "cpu_ops_available",
    "greedy_argmax",
    "gumbel_argmax",
    "gumbel_tables",
    "native_for",
    "reference_add_rms_norm",
    "reference_apply_token_bitmask",
    "reference_greedy_argmax",
    "reference_gumbel_argmax",
    "reference_rotary_store_kv",
    "reference_silu_mul",
    "rotary_store_kv",
    "silu_mul",
    "silu_vector_chunk",
    "unpack_bitmask",
]
