"""llama.cpp's GGUF checkpoints: metadata to a Hugging Face config, tensors to HF names.

Owns ``GGUFFile`` (a .gguf file's header parsed: metadata and tensor index; tensor values read
and dequantized with the ``gguf`` package) and ``GGUFCheckpoint`` (one model file): its config
as the equivalent Hugging Face ``config.json`` dict (so ``ModelConfig.from_hf`` checks it like
any other), its tensors dequantized and renamed to the HF names the model loads, and the file's
digest for the model id. The tokenizer in the same metadata is gguf_tokenizer.py's.

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
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError

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


# GGUF metadata value types: struct formats of the scalars (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    # Logical shape, outermost first (as numpy and torch order it; GGUF lists it innermost first).
    shape: tuple[int, ...]
    # Byte offset of its data in the file.
    start: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown type {self.type_id}"


class GGUFFile:
    """A .gguf file's header, parsed: ``metadata`` (every key, as Python values) and ``tensors``
    (name -> ``GGUFTensor``, in file order); ``read`` gives a tensor's values.

    The header is parsed here rather than by the gguf package's reader, which builds a numpy view
    per array element: SmolLM2's 49k tokens and merges took it 5 s, a 128k-token vocabulary tens of
    seconds. The gguf package still names the types, sizes their blocks and dequantizes them.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: file not found")
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._offset = 0
            self._parse()
        except (OSError, ValueError, KeyError, struct.error, OverflowError, MemoryError) as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from None

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (size,) = self._unpack("<Q")
        end = self._offset + size
        if end > len(self._map):
            raise ValueError("a string runs past the end of the file")
        text = self._map[self._offset:end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item in _SCALARS:  # numbers in one read
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._offset)
                self._offset += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        (value,) = self._unpack(_SCALARS[kind])
        # A float32 as its shortest decimal (1e-05, not 9.99999974e-06).
        return float(str(np.float32(value))) if kind == _FLOAT32 else value

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise ValueError("no GGUF magic number at its start")
        (version,) = struct.unpack_from("<I", self._map, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; versions 2 and 3 (little-endian) are read")
        self._offset = 8
        num_tensors, num_keys = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_keys):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            type_id, offset = self._unpack("<IQ")
            infos.append((name, dims, type_id, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._offset // align) * align
        self.tensors = {name: GGUFTensor(name, type_id, tuple(reversed(dims)), data_start + offset)
                        for name, dims, type_id, offset in infos}

    def read(self, tensor: GGUFTensor) -> torch.Tensor:
        """A tensor's values in its logical shape: float types as they are stored, quantized types
        dequantized to float32. ``ModelLoadError`` for an unsupported type or a truncated file."""
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has type {tensor.type_name}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
        kind = GGMLQuantizationType(tensor.type_id)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row = tensor.shape[-1] if tensor.shape else 1
        count = math.prod(tensor.shape)
        if row % block:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r}: rows of {row} values do not fill {kind.name} "
                                 f"blocks of {block}")
        size = count // block * block_bytes
        if tensor.start + size > len(self._map):
            raise ModelLoadError(f"{self.path}: tensor {tensor.name!r} runs past the end of the file (truncated?)")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=size, offset=tensor.start)
        if kind == GGMLQuantizationType.F32:
            out = torch.from_numpy(raw.view(np.float32).copy())
        elif kind == GGMLQuantizationType.F16:
            out = torch.from_numpy(raw.view(np.float16).copy())
        elif kind == GGMLQuantizationType.BF16:
            out = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        else:
            blocks = raw.reshape(-1, row // block * block_bytes)
            out = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, kind)))
        return out.reshape(tensor.shape)


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
    from mqinfer.workers.engine.models.rotary import rope_inv_freq

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
        self.file = GGUFFile(self.path)
        self._tensors = self.file.tensors
        meta = self.file.metadata
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
            "vocab_size": int(embedding.shape[0]),
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
            _check_rope(config, self.file.read(self._tensors[_ROPE_FREQS]).numpy(), source)
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
            factors = self.file.read(self._tensors[_ROPE_FREQS]).float().numpy()
            if factors.shape != (hf["head_dim"] // 2,):
                raise ModelLoadError(f"{self.path}: rope_freqs.weight has shape {factors.shape}, expected "
                                     f"({hf['head_dim'] // 2},)")
            return _llama3_rope_scaling(factors, hf["rope_theta"], hf["head_dim"],
                                        meta.get(f"{arch}.rope.scaling.original_context_length"))
        return None

    def _float_type(self) -> str:
        """The dtype the file's weights are in: its float type, bfloat16 for quantized files."""
        names = {t.type_name for t in self._tensors.values() if len(t.shape) == 2}
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
        for tensor in self._tensors.values():
            if tensor.name == _ROPE_FREQS:
                continue  # folded into the config's rope scaling
            name = _hf_name(tensor.name)
            value = self.file.read(tensor)
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


__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "GGUFFile", "GGUFTensor", "SUPPORTED_TENSOR_TYPES",
           "unpermute_rows"]
