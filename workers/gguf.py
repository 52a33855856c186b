"""llama.cpp's GGUF checkpoints: metadata to a Hugging Face config, tensors to HF names.

Owns ``GGUFCheckpoint`` (one ``.gguf`` file opened with the ``gguf`` package's reader): its
config as the equivalent Hugging Face ``config.json`` dict (so ``ModelConfig.from_hf`` checks it
like any other), its tensors dequantized and renamed to the HF names the model loads, and the
file's digest for the model id. The tokenizer in the same metadata is gguf_tokenizer.py's.

Layout differences from a HF checkpoint, undone here:
- llama.cpp's converter reorders the rows of a Llama q/k projection within each head, from HF's
  rotate-half pairing (dimension i with i + d/2) to interleaved pairs (2i with 2i + 1);
  ``unpermute_rows`` puts them back. Qwen2/Qwen3 files are written without that reordering.
- Llama 3 frequency scaling is stored as a per-frequency divisor tensor (``rope_freqs.weight``)
  instead of its four parameters; ``_llama3_rope_scaling`` recovers parameters that reproduce it
  and refuses a tensor that no Llama 3 scaling explains.
- A file without ``output.weight`` ties the LM head to the embedding.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from mqinfer.workers.models.config import ModelConfig, ModelLoadError

# general.architecture -> (HF architecture, whether q/k rows are stored in llama.cpp's order).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types read here: the float types and the block quantizations that the gguf package
# dequantizes and that the tests hold to their float originals.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"
# Bytes of the file hashed in full for the model id when it is larger than the full-hash limit:
# the metadata at its start, and samples across the tensor data.
_HEADER_HASH_BYTES = 16 << 20


def _field_value(field) -> Any:
    """A metadata value as Python: int, float, bool, str, or a list of those."""
    from gguf import GGUFValueType

    def scalar(kind, part) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        if kind == GGUFValueType.BOOL:
            return bool(part[0])
        if kind == GGUFValueType.FLOAT32:
            return float(str(part[0]))  # its shortest decimal: 1e-05, not 9.99999974e-06
        if kind == GGUFValueType.FLOAT64:
            return float(part[0])
        return int(part[0])

    if field.types[0] == GGUFValueType.ARRAY:
        kind = field.types[-1]
        if kind == GGUFValueType.ARRAY:
            raise ModelLoadError(f"GGUF metadata {field.name}: nested arrays are not supported")
        return [scalar(kind, field.parts[i]) for i in field.data]
    return scalar(field.types[0], field.parts[field.data[0]])


def open_reader(path: str | os.PathLike):
    """The ``gguf`` package's reader on ``path``; ``ModelLoadError`` when it cannot be read."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError("reading a .gguf model needs the gguf package: pip install 'mqinfer[worker]'") from None
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


def read_metadata(reader, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every metadata key of the file but those in ``skip``, as Python values."""
    return {name: _field_value(field) for name, field in reader.fields.items()
            if name not in skip and not name.startswith("GGUF.")}


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved q/k row order back to HF's rotate-half order, head by head.

    Within each head llama.cpp stores row ``2i + j`` where HF has row ``i + j * d/2``
    (j in {0, 1}); works for weights ``[heads * d, in]`` and biases ``[heads * d]``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        if parts[3] in ("weight", "bias"):
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in this model (unknown tensor name)")


def tensor_to_torch(tensor) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in its logical shape: float types as they are stored,
    quantized types dequantized to float32. ``ModelLoadError`` for an unsupported type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind.name not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} has type {kind.name}, which is not supported "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    if kind == GGMLQuantizationType.F32:
        out = torch.from_numpy(np.array(data.view(np.float32)))
    elif kind == GGMLQuantizationType.F16:
        out = torch.from_numpy(np.array(data.view(np.float16)))
    elif kind == GGMLQuantizationType.BF16:
        out = torch.from_numpy(np.array(data.view(np.int16))).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.ascontiguousarray(dequantize(data, kind)))
    return out.reshape(shape)


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int,
                         original_len: int | None) -> dict[str, Any] | None:
    """Llama 3 rope scaling parameters that reproduce a ``rope_freqs.weight`` divisor tensor.

    Llama 3 divides the long-wavelength frequencies by ``factor``, keeps the short ones, and
    blends the band between linearly in 1/wavelength. The blend only depends on where the band
    starts and ends (``original / low`` and ``original / high`` in wavelength), so any
    ``original`` works once low and high follow it. None when every divisor is 1.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    u = inv_freq / (2 * math.pi)  # 1 / wavelength
    kept = np.abs(factors - 1.0) < 1e-5
    slowed = np.abs(factors - factor) < 1e-5 * factor
    band = ~kept & ~slowed
    blend = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    u_slowed = u[slowed].max() if slowed.any() else u.min() / 2
    u_kept = u[kept].min() if kept.any() else u.max() * 2
    if band.sum() >= 2:
        slope, intercept = np.polyfit(u[band], blend, 1)
        u_low, u_high = -intercept / slope, (1.0 - intercept) / slope
    elif band.sum() == 1:
        u_low = (u_slowed + u[band][0]) / 2
        u_high = u_low + (u[band][0] - u_low) / blend[0]
    else:
        u_low, u_high = u_slowed + (u_kept - u_slowed) / 3, u_slowed + 2 * (u_kept - u_slowed) / 3
    original = float(original_len or 8192)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(u_low * original),
            "high_freq_factor": float(u_high * original), "original_max_position_embeddings": original}


def _check_rope(config: ModelConfig, factors: np.ndarray, source: str) -> None:
    """The recovered scaling must give the file's frequencies: base / divisor."""
    from mqinfer.workers.models.llama import rope_inv_freq

    base = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64).float()
                                       / config.head_dim)
    expected = base / torch.from_numpy(factors.astype(np.float32))
    got = rope_inv_freq(config)
    if not torch.allclose(got, expected, rtol=1e-4, atol=0):
        raise ModelLoadError(f"{source}: rope_freqs.weight is not a Llama 3 frequency scaling; "
                             "other per-frequency rope factors are not supported")


class GGUFCheckpoint:
    """One GGUF file: ``hf_config`` (the HF config.json it is equivalent to), ``weights()`` and
    ``digest()``. ``ModelLoadError`` names an unsupported architecture, tensor or setting."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.reader = open_reader(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        meta = read_metadata(self.reader, skip=("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                "tokenizer.ggml.scores", "tokenizer.ggml.token_type"))
        if int(meta.get("split.count") or 1) > 1:
            raise ModelLoadError(f"{self.path}: one part of a GGUF split into {meta['split.count']} files; merge "
                                 "the parts into one file first (llama.cpp's llama-gguf-split --merge)")
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.gguf_architecture = arch
        self.hf_config = self._hf_config(meta, arch)

    # ------------------------------------------------------------------ config
    def _hf_config(self, meta: dict[str, Any], arch: str) -> dict[str, Any]:
        source = str(self.path)

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        def need(key: str) -> Any:
            if get(key) is None:
                raise ModelLoadError(f"{source}: missing GGUF metadata {arch}.{key}")
            return get(key)

        if (get("expert_count") or 0) > 0:
            raise ModelLoadError(f"{source}: mixture-of-experts models ({arch}.expert_count) are not supported")
        hidden = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        num_kv_heads = get("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # one count per layer
            if len(set(num_kv_heads)) != 1:
                raise ModelLoadError(f"{source}: a different number of KV heads per layer is not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(get("attention.key_length") or hidden // num_heads)
        embedding = self._tensors.get("token_embd.weight")
        if embedding is None:
            raise ModelLoadError(f"{source}: no token_embd.weight tensor")
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch][0]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(num_kv_heads),
            "head_dim": head_dim,
            "vocab_size": int(embedding.shape[-1]),
            "max_position_embeddings": int(get("context_length") or 2048),
            "rope_theta": float(get("rope.freq_base") or 10000.0),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon") or 1e-6),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in self._tensors,
            "torch_dtype": self._float_type(),
        }
        rotary_dim = get("rope.dimension_count")
        if rotary_dim and int(rotary_dim) != head_dim:
            hf["partial_rotary_factor"] = int(rotary_dim) / head_dim
        scaling = self._rope_scaling(meta, arch, hf)
        if scaling:
            hf["rope_scaling"] = scaling
        for key in ("bos_token_id", "padding_token_id"):
            if meta.get(f"tokenizer.ggml.{key}") is not None:
                hf[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
        # llama.cpp ends generation at any end-of-generation token: eos, end of turn, end of message.
        eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if meta.get(f"tokenizer.ggml.{k}") is not None]
        if eos:
            hf["eos_token_id"] = list(dict.fromkeys(eos))
        config = ModelConfig.from_hf(hf, source)
        if _ROPE_FREQS in self._tensors and hf.get("rope_scaling", {}).get("rope_type") == "llama3":
            _check_rope(config, tensor_to_torch(self._tensors[_ROPE_FREQS]).numpy(), source)
        return hf

    def _rope_scaling(self, meta: dict[str, Any], arch: str, hf: dict[str, Any]) -> dict[str, Any] | None:
        kind = meta.get(f"{arch}.rope.scaling.type")
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
            kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
        if kind not in (None, "none") and not (kind == "linear" and factor in (None, 1.0)):
            scaling: dict[str, Any] = {"rope_type": kind}
            if factor is not None:
                scaling["factor"] = float(factor)
            return scaling
        if _ROPE_FREQS in self._tensors:
            factors = tensor_to_torch(self._tensors[_ROPE_FREQS]).float().numpy()
            if factors.shape != (hf["head_dim"] // 2,):
                raise ModelLoadError(f"{self.path}: rope_freqs.weight has shape {factors.shape}, expected "
                                     f"({hf['head_dim'] // 2},)")
            return _llama3_rope_scaling(factors, hf["rope_theta"], hf["head_dim"],
                                        meta.get(f"{arch}.rope.scaling.original_context_length"))
        return None

    def _float_type(self) -> str:
        """The dtype the file's weights are in: its float type, bfloat16 for quantized files."""
        matrices = [t for t in self.reader.tensors if len(t.shape) == 2]
        names = {getattr(t.tensor_type, "name", str(t.tensor_type)) for t in matrices}
        for kind, dtype in (("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16")):
            if names == {kind}:
                return dtype
        return "bfloat16"

    # ------------------------------------------------------------------ tensors
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every model tensor, in HF layout, one tensor in memory at a time."""
        unpermute = ARCHITECTURES[self.gguf_architecture][1]
        heads = {"self_attn.q_proj": self.hf_config["num_attention_heads"],
                 "self_attn.k_proj": self.hf_config["num_key_value_heads"]}
        for tensor in self.reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue  # folded into the config's rope scaling
            name = _hf_name(tensor.name)
            value = tensor_to_torch(tensor)
            if unpermute:
                proj = name.rsplit(".", 2)[-2]
                key = f"self_attn.{proj}"
                if key in heads:
                    value = unpermute_rows(value, heads[key])
            yield name, value

    def digest(self, full_hash_limit: int, sample_bytes: int) -> str:
        """8 hex digits over the config and the file: all of it up to ``full_hash_limit`` bytes,
        else its first 16 MiB (the metadata) and ``sample_bytes`` at three places."""
        import json

        digest = hashlib.blake2b(json.dumps(self.hf_config, sort_keys=True).encode(), digest_size=16)
        size = self.path.stat().st_size
        digest.update(f"{self.path.name}:{size}".encode())
        with self.path.open("rb") as fh:
            if size <= full_hash_limit:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
            else:
                digest.update(fh.read(_HEADER_HASH_BYTES))
                for offset in (size // 3, 2 * size // 3, max(0, size - sample_bytes)):
                    fh.seek(offset)
                    digest.update(fh.read(sample_bytes))
        return digest.hexdigest()[:8]


__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "SUPPORTED_TENSOR_TYPES", "open_reader", "read_metadata",
           "tensor_to_torch", "unpermute_rows"]
