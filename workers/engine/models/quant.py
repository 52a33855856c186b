"""8-bit weights for the Llama-family model: the layer swap behind ``--quantization``.

``quantize_model(model, mode)`` replaces each decoder layer's four projections (q/k/v, the
attention output, gate/up, down) with an ``Int8Linear`` holding the int8 weight and its
per-output-feature scales; the float weight is dropped. The embeddings stay in the model dtype.

The LM head (``lm_head=True``, w8a8 only) becomes an ``Int8Linear`` too: an int8 copy of its
weight, one scale per vocabulary row, the final norm's output quantized per token. With tied
embeddings the embedding table keeps its float weight and the head gets its own int8 copy. Its
input, the final norm's output, is smoothed as the projections' are (below; the factors go into
the final norm and the head's own copy of the weight). It
pays on small models, whose head is a large share of the work: vocabulary x hidden
multiply-adds per sampled row (and in decode every row samples), on the standard benchmark
model 32000 x 512, about 0.7 times those of all eight decoder layers' projections for one
token. On one Zen 4 core the VNNI kernel ran it at 2.0-2.6x
bfloat16's rate from 32 to 128 rows, and it cost SmolLM2-135M-Instruct little perplexity
(README.md, "8-bit weights").

Activation outliers (SmoothQuant). Per-token int8 activations lose most where a few input
channels are much larger than the rest. ``smooth`` moves that range into the weights: for the
q/k/v and gate/up projections (whose input is an RMSNorm's output) and for down (whose input is
``silu(gate) * up``), each input channel j is divided by ``s_j = max|x_j|^a / max|W_j|^(1-a)``
and the weight's column j multiplied by it. The division is folded into the norm's weight, or
into the up rows of gate/up, so it costs nothing at run time and the float model computes the
same function. ``max|x_j|`` comes from a calibration pass (``activation_ranges``) over a short
fixed text (``calibration_text``: Python standard library docstrings, none of the modules that
``loadgen.quality`` scores), both as plain text and as conversations in the model's chat
template (``calibration_token_windows``): calibrated on plain text alone, the smoothing
amplified channels that only the chat markers use, and chat answers degenerated.

Modes:
- ``w8a8``: activations quantized per token on the fly, exact int32 sums, float32 out
  (``kernels/linear_int8.py``: the native kernel on CPUs with AVX2 or AVX-512 VNNI, for
  float32 rows, bfloat16 ones with the VNNI kernel, and otherwise bfloat16 and float16 rows
  widened to float32 for the plain projection; ``torch._int_mm`` elsewhere). All of them give
  ``reference_linear``'s bits.
- ``w8a16``: activations stay in the model dtype; the weight holds a quarter of float32's
  memory. On CPU with float32 activations the native kernel (``kernels/linear_w8a16.py``)
  widens it inside the matmul, bit for bit the float32 kernel on the dequantized weight. On
  one AVX2 core with the weights read from memory (measured under contention) it ran at
  2.6-3.1x the float32 kernel's rate at 1 row, 1.5-2.4x at 4, 1.1-1.3x at 16, 1.1x at 64
  and 0.90-1.0x at 256 (BENCHMARKS.md). Elsewhere the weight is dequantized for
  ``F.linear`` on every call, slower than float32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mqinfer.kernels import linear_int8 as q8
from mqinfer.kernels import linear_w8a16 as w16
from mqinfer.workers.engine.models.layers import Linear, LMHead
from mqinfer.workers.engine.models.llama import MLP, Attention, DecoderLayer

MODES = ("none", "w8a8", "w8a16")
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Modules whose docstrings calibrate the activation ranges: none of them is in the quality
# tool's text, so the perplexity it reports is not measured on the calibration data.
CALIBRATION_MODULES = ("email.message", "http.client", "unittest", "urllib.parse", "zipfile", "tarfile",
                       "sqlite3", "calendar", "pprint", "enum")


class Int8Linear(nn.Module):
    """A ``Linear`` (or the ``LMHead``, which has no bias) with an int8 weight (symmetric, one
    scale per output feature); the same ``forward`` and ``swiglu`` as ``Linear``."""

    def __init__(self, linear: Linear | LMHead | None, mode: str, *,
                 qweight: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> None:
        """``linear``'s weight quantized; or, with ``linear`` None, the given ``qweight``,
        ``scale`` and ``bias`` as they are."""
        super().__init__()
        if mode not in ("w8a8", "w8a16"):
            raise ValueError(f"Int8Linear mode must be w8a8 or w8a16, got {mode!r}")
        self.mode = mode
        if linear is not None:
            qweight, scale = q8.quantize_weight(linear.weight.data)
            bias = getattr(linear, "bias", None)
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = bias
        # The native kernel's packed weights (w8a8: q8.Int8Weight, w8a16: w16.W8A16Weight),
        # made on first use.
        self.packed = None
        self.packed_swiglu = None

    @classmethod
    def empty(cls, out_features: int, in_features: int, mode: str, *, bias: bool, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "Int8Linear":
        """A layer of this shape with uninitialised int8 weight, scales and bias (in ``dtype``), for
        a caller that fills them from a prepared model (``workers/engine/prepared.py``)."""
        return cls(None, mode, qweight=torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                   scale=torch.empty(out_features, dtype=torch.float32, device=device),
                   bias=nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                   if bias else None)

    def _native(self, x: torch.Tensor, fused: bool = False) -> bool:
        """Whether ``x`` goes through the native kernel: float32 rows on CPU; for w8a8 also
        bfloat16 rows where the kernel takes them, and otherwise, for the plain projection,
        bfloat16 and float16 rows widened to float32 for the kernel and the result rounded back
        (the bits of ``reference_linear``, which quantizes ``x.float()`` too)."""
        if x.device.type != "cpu" or x.dim() != 2:
            return False
        if self.mode == "w8a16" or x.dtype == torch.float32:
            return x.dtype == torch.float32 and (q8 if self.mode == "w8a8" else w16).native_available()
        if x.dtype == torch.bfloat16 and q8.native_takes_bf16():
            return True
        return not fused and x.dtype in HALF_DTYPES and q8.native_available()

    def _widened(self, x: torch.Tensor) -> bool:
        """Whether the native w8a8 call takes ``x`` widened to float32 (see ``_native``)."""
        return x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and q8.native_takes_bf16())

    def _kernels(self):
        """The native kernel module of this layer's mode (same pack / linear / swiglu calls)."""
        return q8 if self.mode == "w8a8" else w16

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "w8a8":
            return q8.reference_linear(x, self.qweight, self.scale, self.bias)
        weight = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, weight, self.bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._native(x):
            kernels = self._kernels()
            if self.packed is None:
                self.packed = kernels.pack(self.qweight, self.scale, self.bias)
            if self._widened(x):
                result = kernels.linear(x.float(), self.packed)
                return result.to(x.dtype) if out is None else out.copy_(result)
            return kernels.linear(x, self.packed, out)
        result = self._torch(x)
        return result if out is None else out.copy_(result)

    def swiglu(self, x: torch.Tensor, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """As ``Linear.swiglu``: the native kernel's fused SwiGLU (float32 rows, or bfloat16 ones
        where the kernel takes them), else None."""
        if not self._native(x, fused=True):
            return None
        kernels = self._kernels()
        if self.packed_swiglu is None:
            self.packed_swiglu = kernels.pack(self.qweight, self.scale, self.bias, swiglu=True)
        return kernels.swiglu(x, self.packed_swiglu, vector_chunk, out)

    def pack_now(self, dtype: torch.dtype, fused: bool = False) -> bool:
        """Pack the weight for the native kernel now, as the first call with rows of ``dtype``
        would (``fused``: for ``swiglu``), so that start-up pays it rather than the first step.
        Whether there was something to pack."""
        rows = torch.empty(1, self.in_features, dtype=dtype, device=self.qweight.device)
        if not self._native(rows, fused=fused):
            return False
        kernels = self._kernels()
        if fused and self.packed_swiglu is None:
            self.packed_swiglu = kernels.pack(self.qweight, self.scale, self.bias, swiglu=True)
        elif not fused and self.packed is None:
            self.packed = kernels.pack(self.qweight, self.scale, self.bias)
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def quantize_model(model: nn.Module, mode: str, lm_head: bool = False) -> int:
    """Swap the decoder layers' projections for ``Int8Linear`` (``mode`` w8a8 or w8a16; ``none``
    changes nothing), and with ``lm_head`` and w8a8 the model's ``lm_head`` too (an int8 copy;
    tied embeddings keep their float table). Returns how many layers were swapped. Run it after
    the weights are loaded."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    swapped = 0
    if lm_head and mode == "w8a8" and isinstance(getattr(model, "lm_head", None), LMHead):
        model.lm_head = Int8Linear(model.lm_head, mode)
        swapped += 1
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


def docstring_text(modules: tuple[str, ...]) -> str:
    """The docstrings of ``modules`` and of their public classes and functions, in a fixed order."""
    import importlib
    import inspect

    parts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module)
        if doc:
            parts.append(doc)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if (not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                    and getattr(obj, "__module__", None) == name):
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts)


def calibration_text() -> str:
    return docstring_text(CALIBRATION_MODULES)


def calibration_token_windows(tokenizer, window: int, max_windows: int = 4) -> list[list[int]]:
    """Token windows for the calibration pass: conversations in the model's chat template (the
    format requests arrive in: role markers and special tokens have activations of their own,
    often the largest) built from the calibration text's paragraphs, then that text as it is.
    At most ``max_windows`` windows of each kind, each at most ``window`` tokens."""
    paragraphs = [p for p in calibration_text().split("\n\n") if len(p) > 80]
    windows: list[list[int]] = []
    for i in range(0, min(len(paragraphs) - 1, 2 * max_windows), 2):
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": paragraphs[i]},
                    {"role": "assistant", "content": paragraphs[i + 1]}]
        try:
            ids = tokenizer.encode_chat(messages)
        except (ValueError, RuntimeError, KeyError, TypeError):  # no usable chat template
            break
        if ids:
            windows.append(ids[:window])
    text = tokenizer.encode(calibration_text())
    windows += [text[i : i + window] for i in range(0, min(len(text), max_windows * window), window)]
    return [w for w in windows if w]


def activation_ranges(model: nn.Module, run: Callable[[], None], lm_head: bool = False) -> dict[nn.Module, torch.Tensor]:
    """``max|x_j|`` over every token ``run()`` puts through the model, per input channel j of each
    decoder layer's q/k/v, gate/up and down projection (float32, keyed by the projection), and
    with ``lm_head`` of the LM head's input (the model's output: its final hidden states)."""
    ranges: dict[nn.Module, torch.Tensor] = {}

    def record(proj: nn.Module, inputs: tuple) -> None:
        amax = inputs[0].detach().abs().amax(dim=0).float()
        seen = ranges.get(proj)
        ranges[proj] = amax if seen is None else torch.maximum(seen, amax)

    hooks = []
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            # Each block's input is its first projection's: hooked on the block, since the MLP's
            # fused SwiGLU path never calls gate_up's own forward.
            for owner, proj in ((layer.self_attn, layer.self_attn.qkv_proj), (layer.mlp, layer.mlp.gate_up_proj),
                                (layer.mlp.down_proj, layer.mlp.down_proj)):
                hooks.append(owner.register_forward_pre_hook(lambda _m, inputs, p=proj: record(p, inputs)))
    if lm_head and isinstance(getattr(model, "lm_head", None), LMHead):
        hooks.append(model.register_forward_hook(lambda _m, _inputs, hidden: record(model.lm_head, (hidden,))))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def _factors(amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    wmax = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    s = amax.clamp(min=1e-5).pow(alpha) / wmax.pow(1 - alpha)
    return s.clamp(min=1e-5)


def smooth(model: nn.Module, ranges: dict[nn.Module, torch.Tensor], alpha: float) -> int:
    """Fold SmoothQuant's per-channel factors into each decoder layer (see the module's
    docstring), and into the final norm and the LM head where ``ranges`` has the head (a tied
    head first gets a weight of its own, so that the embedding table stays as it is): the float
    model computes the same function, with activations of a flatter range. Returns how many
    projections were smoothed."""
    smoothed = 0
    with torch.no_grad():
        head = getattr(model, "lm_head", None)
        if isinstance(head, LMHead) and head in ranges:
            s = _factors(ranges[head], head.weight, alpha)
            model.model.norm.weight.div_(s.to(model.model.norm.weight.dtype))
            head.weight = nn.Parameter(head.weight * s.to(head.weight.dtype)[None, :], requires_grad=False)
            head.packed = None
            smoothed += 1
        for layer in model.modules():
            if not isinstance(layer, DecoderLayer):
                continue
            attn, mlp = layer.self_attn, layer.mlp
            for proj, norm in ((attn.qkv_proj, layer.input_layernorm), (mlp.gate_up_proj, layer.post_attention_layernorm)):
                if proj in ranges:
                    s = _factors(ranges[proj], proj.weight, alpha)
                    norm.weight.div_(s.to(norm.weight.dtype))
                    proj.weight.mul_(s.to(proj.weight.dtype))
                    smoothed += 1
            down, gate_up = mlp.down_proj, mlp.gate_up_proj
            if down in ranges:
                s = _factors(ranges[down], down.weight, alpha)
                inter = mlp.intermediate_size
                gate_up.weight[inter:].div_(s.to(gate_up.weight.dtype)[:, None])
                if gate_up.bias is not None:
                    gate_up.bias[inter:].div_(s.to(gate_up.bias.dtype))
                down.weight.mul_(s.to(down.weight.dtype))
                smoothed += 1
            for proj in (attn.qkv_proj, mlp.gate_up_proj, mlp.down_proj):
                proj.packed = proj.packed_swiglu = None
    return smoothed


__all__ = ["CALIBRATION_MODULES", "MODES", "Int8Linear", "activation_ranges", "calibration_text",
           "calibration_token_windows", "docstring_text",
           "quantize_model", "smooth"]
