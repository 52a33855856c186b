"""8-bit weights for the Llama-family model: the layer swap behind ``--quantization``.

``quantize_model(model, mode)`` replaces each decoder layer's four projections (q/k/v, the
attention output, gate/up, down) with an ``Int8Linear`` holding the int8 weight and its
per-output-feature scales; the float weight is dropped. The embeddings and the LM head stay in
the model dtype: the head is one matmul per sampled row, and its logits decide every token.

Modes:
- ``w8a8``: activations quantized per token on the fly, exact int32 sums, float32 out
  (``kernels/linear_int8.py``: the native AVX2 kernel on CPU, ``torch._int_mm`` elsewhere).
- ``w8a16``: activations stay in the model dtype; the weight is dequantized for the matmul.
  It holds a quarter of float32's weight memory; on CPU it is not faster than float32 here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mqinfer.kernels import linear_int8 as q8
from mqinfer.workers.models.llama import MLP, Attention, Linear

MODES = ("none", "w8a8", "w8a16")


class Int8Linear(nn.Module):
    """A ``Linear`` with an int8 weight (symmetric, one scale per output feature); the same
    ``forward`` and ``swiglu`` as ``Linear``."""

    def __init__(self, linear: Linear, mode: str) -> None:
        super().__init__()
        if mode not in ("w8a8", "w8a16"):
            raise ValueError(f"Int8Linear mode must be w8a8 or w8a16, got {mode!r}")
        self.mode = mode
        self.out_features = linear.out_features
        self.in_features = linear.weight.shape[1]
        qweight, scale = q8.quantize_weight(linear.weight.data)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.packed: q8.Int8Weight | None = None
        self.packed_swiglu: q8.Int8Weight | None = None

    def _native(self, x: torch.Tensor) -> bool:
        return (self.mode == "w8a8" and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.dim() == 2 and q8.native_available())

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "w8a8":
            return q8.reference_linear(x, self.qweight, self.scale, self.bias)
        weight = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, weight, self.bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._native(x):
            if self.packed is None:
                self.packed = q8.pack(self.qweight, self.scale, self.bias)
            return q8.linear(x, self.packed, out)
        result = self._torch(x)
        return result if out is None else out.copy_(result)

    def swiglu(self, x: torch.Tensor, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """As ``Linear.swiglu``: the native w8a8 kernel's fused SwiGLU, else None."""
        if not self._native(x):
            return None
        if self.packed_swiglu is None:
            self.packed_swiglu = q8.pack(self.qweight, self.scale, self.bias, swiglu=True)
        return q8.swiglu(x, self.packed_swiglu, vector_chunk, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def quantize_model(model: nn.Module, mode: str) -> int:
    """Swap the decoder layers' projections for ``Int8Linear`` (``mode`` w8a8 or w8a16; ``none``
    changes nothing). Returns how many layers were swapped. Run it after the weights are loaded."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    swapped = 0
    for module in list(model.modules()):
        if isinstance(module, Attention):
            names = ("qkv_proj", "o_proj")
        elif isinstance(module, MLP):
            names = ("gate_up_proj", "down_proj")
        else:
            continue
        for name in names:
            layer = getattr(module, name)
            if isinstance(layer, Linear):
                setattr(module, name, Int8Linear(layer, mode))
                swapped += 1
    return swapped


__all__ = ["MODES", "Int8Linear", "quantize_model"]
