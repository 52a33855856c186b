"""The building blocks of the decoder: linear projections, the LM head, embedding, RMSNorm, and
the reused activation buffers.

``Linear`` runs a projection on the fastest kernel the device and dtype allow (the native dense
kernel for float32 on CPU, AMX or oneDNN for bfloat16 where the CPU has them, else
``torch.nn.functional.linear``), each fast path with a packed copy of its weight made on first use
(:func:`packed_weight`, :func:`amx_weight`, :func:`onednn_weight`). ``LMHead`` computes logits in
vocabulary slices that stay in cache. ``Activations`` holds one buffer per kind of intermediate
activation, reused by every layer and step. Parameters are allocated uninitialised
(:func:`empty_param`): the checkpoint overwrites every value.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mqinfer.kernels import linear as dense
from mqinfer.kernels import linear_amx, linear_onednn
from mqinfer.kernels.kv_quant import LayerKVCache

# One cache per layer: a LayerKVCache, or a plain (k_cache, v_cache) pair.
KVCaches = Sequence[LayerKVCache | tuple[torch.Tensor, torch.Tensor]]


class StepInterrupted(Exception):
    """The forward pass stopped before a layer because its ``interrupt`` asked it to. The layers
    before it wrote this step's tokens' KV into their blocks; nothing reads those slots until a
    later step has computed the same tokens again, which writes the same values."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"step interrupted before layer {layer}")
        self.layer = layer



def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by the checkpoint, and random
    # init of a billion parameters would cost seconds.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def packed_weight(module: nn.Module, x: torch.Tensor, *, attr: str = "packed", weight: torch.Tensor | None = None,
                   pack=dense.pack) -> dense.PackedWeight | None:
    """``weight`` (default ``module.weight``) in the native dense kernel's layout when ``x`` and
    the weight suit it (2-D float32 on CPU, a CPU the kernel serves, the switch allowing): made
    by ``pack`` on first use and kept in ``module.<attr>``, made again when the weight was
    replaced; None otherwise. ``load_weights`` drops the packed copies."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or not dense.native_linear_available():
        return None
    weight = module.weight if weight is None else weight
    packed = getattr(module, attr)
    if packed is None or not packed.packed_from(weight):
        packed = pack(weight)
        setattr(module, attr, packed)
    return packed


def amx_weight(module: nn.Module, x: torch.Tensor) -> linear_amx.AmxWeight | None:
    """``module.weight`` packed for the AMX kernel when rows ``x`` go there (``linear_amx.takes``:
    bfloat16, at most its row limit, a CPU with AMX): made on first use and kept in
    ``module.packed`` (a bfloat16 model never holds the float32 kernel's packing there), made
    again when the weight was replaced; None otherwise."""
    if not linear_amx.takes(x):
        return None
    packed = module.packed
    if not isinstance(packed, linear_amx.AmxWeight) or not packed.packed_from(module.weight):
        packed = module.packed = linear_amx.pack(module.weight)
    return packed


def onednn_weight(module: nn.Module, x: torch.Tensor) -> linear_onednn.OneDnnWeight | None:
    """``module.weight`` laid out for oneDNN when rows ``x`` go there (``linear_onednn.takes``:
    bfloat16, at most its row limit, a CPU without AMX whose oneDNN runs bfloat16), kept in
    ``module.packed`` as ``amx_weight`` keeps its own; None otherwise."""
    if linear_amx.available() or not linear_onednn.takes(x):
        return None
    packed = module.packed
    if not isinstance(packed, linear_onednn.OneDnnWeight) or not packed.packed_from(module.weight):
        packed = module.packed = linear_onednn.pack(module.weight)
    return packed


def amx_swiglu_weight(module: nn.Module, x: torch.Tensor, vector_chunk: int) -> linear_amx.AmxWeight | None:
    """SwiGLU's gate/up weight packed for the AMX kernel's fused SwiGLU when rows ``x`` go to the
    kernel and the layer has no bias: kept in ``module.packed_swiglu``, made again when the weight
    was replaced; None otherwise. Any number of rows: unlike the plain layers, which leave long
    prompts to PyTorch's matmul (``linear_amx.MAX_ROWS``), the fused form beats PyTorch's matmul
    followed by the SwiGLU kernel there too (BENCHMARKS.md)."""
    if module.bias is not None or vector_chunk % linear_amx.PANEL or not linear_amx.takes(x, None):
        return None
    packed = module.packed_swiglu
    if not isinstance(packed, linear_amx.AmxWeight) or not packed.packed_from(module.weight):
        packed = module.packed_swiglu = linear_amx.pack_swiglu(module.weight)
    return packed


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: dense.PackedWeight | None = None
        self.packed_swiglu: dense.PackedWeight | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] -> [T, out]``, into ``out`` when given. On an AVX2 CPU in float32 the
        native kernel with the packed weight (``kernels/linear.py``); on a CPU with AMX in
        bfloat16, up to ``linear_amx.MAX_ROWS`` rows, the AMX kernel with its packed weight
        (``kernels/linear_amx.py``); on another CPU in bfloat16, up to ``linear_onednn.MAX_ROWS``
        rows, oneDNN with the weight laid out once (``kernels/linear_onednn.py``; the bits of
        ``F.linear``, in a new tensor rather than ``out``); elsewhere the very calls ``F.linear``
        makes for 2-D input (``mm``, or ``addmm`` with a bias), the same bits."""
        packed = packed_weight(self, x)
        if packed is not None:
            return dense.linear(x, packed, self.bias, out)
        amx = amx_weight(self, x)
        if amx is not None:
            return linear_amx.linear(x, amx, self.bias, out)
        laid_out = onednn_weight(self, x)
        if laid_out is not None:
            return linear_onednn.linear(x, laid_out, self.bias)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def swiglu(self, x: torch.Tensor, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """For SwiGLU's fused gate/up projection (gate rows first): ``silu(gate) * up`` straight
        from the native dense kernel's registers (float32) or the AMX kernel's tiles (bfloat16,
        no bias), the same bits as the projection followed by ``cpu_ops.silu_mul``
        (``vector_chunk`` as there), without the 2 x wide intermediate; None where neither
        applies (the caller runs those two steps)."""
        packed = packed_weight(self, x, attr="packed_swiglu", pack=lambda w: dense.pack_swiglu(w, self.bias))
        if packed is not None:
            return dense.swiglu(x, packed, vector_chunk, out)
        amx = amx_swiglu_weight(self, x, vector_chunk)
        return None if amx is None else linear_amx.swiglu(x, amx, vector_chunk, out)


class Activations:
    """Buffers for the intermediate activations of the model's forward pass, one per kind (the
    q/k/v projection, the attention output projection, gate/up, SwiGLU, down, the normalised
    rows, the residual stream), reused by every layer and every step.

    Why. On CPU a fresh tensor of a few MiB comes from a new memory mapping that the kernel
    faults in page by page (and MKL zeroes before it writes): at a 4096-token prefill the
    gate/up projection's 48 MiB output cost about a tenth of the matmul itself. Each layer's
    outputs are consumed before the next layer writes the same kind, so one buffer per kind
    serves all layers. Only the model's forward writes them, and what it returns is never one
    of them. A buffer grows to the largest step seen and stays.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, kind: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` tensor of ``like``'s dtype and device, contents undefined."""
        numel = rows * cols
        buffer = self._buffers.get(kind)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[kind] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(rows, cols)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers as they are now (a captured CUDA graph keeps those it writes alive)."""
        return list(self._buffers.values())


class Embedding(nn.Module):
    """Token embedding; with tied weights the LM head shares ``weight``."""

    def __init__(self, num_embeddings: int, dim: int, dtype, device) -> None:
        super().__init__()
        self.weight = empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


# Vocabulary rows of the LM head per matmul on CPU: about 1 MiB of weights (at least 256
# rows). One matmul over a whole large vocabulary ran at 46 GFLOP/s on 64 rows where slices of
# 512 rows written into their columns of the same output ran at 60 (float32, one AVX2 core):
# MKL packs the weight operand block by block, and a slice's blocks stay in cache.
_LM_HEAD_SLICE_BYTES = 1 << 20


class LMHead(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.packed: dense.PackedWeight | None = None

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, hidden] -> [B, vocab]``, into ``out`` when given. On an AVX2 CPU in float32 the
        native dense kernel, on a CPU with AMX in bfloat16 the AMX kernel, on another in bfloat16
        oneDNN with the weight laid out (all as ``Linear``); elsewhere on CPU in slices of the
        vocabulary, each logit the same dot product as in one matmul (the same bits)."""
        packed = packed_weight(self, hidden)
        if packed is not None:
            return dense.linear(hidden, packed, None, out)
        amx = amx_weight(self, hidden)
        if amx is not None:
            return linear_amx.linear(hidden, amx, None, out)
        laid_out = onednn_weight(self, hidden)
        if laid_out is not None:
            logits = linear_onednn.linear(hidden, laid_out)
            return logits if out is None else out.copy_(logits)
        weight = self.weight
        vocab, dim = weight.shape
        if hidden.device.type != "cpu" or hidden.dim() != 2:
            return F.linear(hidden, weight) if out is None else torch.mm(hidden, weight.t(), out=out)
        if out is None:
            out = torch.empty(hidden.shape[0], vocab, dtype=hidden.dtype)
        rows = max(256, _LM_HEAD_SLICE_BYTES // (dim * weight.element_size()) // 64 * 64)
        for start in range(0, vocab, rows):
            stop = min(start + rows, vocab)
            torch.mm(hidden, weight[start:stop].t(), out=out[:, start:stop])
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)



def activation_buffer(buffers: Activations | None, kind: str, rows: int, cols: int,
                      like: torch.Tensor) -> torch.Tensor | None:
    """``buffers``' buffer of ``kind`` (None without buffers: the op allocates its output)."""
    return None if buffers is None else buffers.get(kind, rows, cols, like)
