"""Dense layers in bfloat16 through oneDNN with the weight laid out once for it, on CPUs where
no native bfloat16 kernel runs (no AMX): the rows of a decoding step or a short prompt.

Owns ``OneDnnWeight`` (a bfloat16 ``[out, in]`` weight in oneDNN's blocked layout, made by
PyTorch's ``mkldnn._reorder_linear_weight``, remembering the tensor it came from), ``pack``,
``takes(x)`` (whether a call with these rows goes here) and ``linear``.

Why. ``F.linear`` on a bfloat16 CPU tensor is a oneDNN matmul that lays the weight operand out
for its kernel again on every call, reading the weight cold from memory: in a model's forward
pass every layer's weight is cold, since the weights of all layers do not fit the caches.
Measured on a 2-vCPU AMD EPYC (AVX-512 with bf16, no AMX), 30 different weights one after the
other as in a forward pass, 2 threads: SmolLM2-135M's shapes ran 1.2-1.35x faster at 64 rows
with the weight laid out once (``F.linear`` 232-303 GFLOP/s, this 297-365) and its LM head
1.24x; from about 512 rows on the two are level, so longer calls stay with ``F.linear``.

Numerics: the same oneDNN kernel sums in the same order, so the results are the bits of
``F.linear`` (the tests check equality). ``MQINFER_CPU_LINEAR=torch`` turns this off with the
other dense kernels (then every call is ``F.linear``).
"""

from __future__ import annotations

import functools
import os

import torch

# Calls with more rows go to F.linear (see above).
MAX_ROWS = 512
# The row count oneDNN is told to expect when the weight is laid out (a decoding step's).
ROWS_HINT = 64


@functools.cache
def _supported() -> bool:
    """Whether this PyTorch has oneDNN's CPU linear with a laid-out weight and the CPU runs
    bfloat16 matmuls in oneDNN natively without AMX tiles (AVX-512 with bf16)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if not getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)():
        return False
    # With AMX tiles, F.linear's oneDNN chooses its AMX kernels by the call's shape, and from some
    # row counts on they sum in another order than the laid-out weight's kernel: the bits would
    # differ (and the model's layers take the AMX kernel there anyway, kernels/linear_amx.py).
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return not (amx is not None and amx())


def available() -> bool:
    """Whether bfloat16 dense layers can take this path here (oneDNN, a CPU with native bfloat16
    matmuls and no AMX, the ``MQINFER_CPU_LINEAR`` switch not ``torch``)."""
    return os.environ.get("MQINFER_CPU_LINEAR", "auto") != "torch" and _supported()


class OneDnnWeight:
    """A bfloat16 ``[out_features, in_features]`` weight in oneDNN's layout; remembers the tensor
    it was laid out from (``packed_from``), as the other packed weights do."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.source = weight
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)

    def packed_from(self, weight: torch.Tensor) -> bool:
        return (weight.data_ptr() == self.source.data_ptr() and weight.shape == self.source.shape
                and weight.dtype == self.source.dtype)


def pack(weight: torch.Tensor) -> OneDnnWeight | None:
    """``weight`` laid out for oneDNN, or None where this path does not apply (then use
    ``F.linear``): not a 2-D bfloat16 CPU tensor, or not ``available()``."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not available():
        return None
    return OneDnnWeight(weight)


def takes(x: torch.Tensor) -> bool:
    """Whether rows ``x`` go this way: 2-D bfloat16 on CPU, 1 to ``MAX_ROWS`` rows, available."""
    return (x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and 0 < x.shape[0] <= MAX_ROWS and available())


def linear(x: torch.Tensor, weight: OneDnnWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bfloat16 ``x`` ``[T, in_features]``, as a new tensor (oneDNN
    writes its own output; at these row counts the allocator hands back recently freed memory,
    so there is none of the page faulting that large outputs would meet)."""
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a bfloat16 tensor [T, {weight.in_features}], got {list(x.shape)} {x.dtype}")
    if bias is not None and (bias.shape != (weight.out_features,) or bias.dtype != torch.bfloat16):
        raise ValueError(f"bias must be a bfloat16 tensor [{weight.out_features}]")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.data, bias, "none", [], "")


__all__ = ["MAX_ROWS", "OneDnnWeight", "available", "linear", "pack", "takes"]
