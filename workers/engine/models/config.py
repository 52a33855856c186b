"""What a model family needs from a checkpoint's config.json, parsed and checked once.

Owns ``ModelConfig`` (the typed view of a Hugging Face config for the Llama family and its
close relatives), the table of supported architectures, and ``ModelLoadError``. Reads both
config layouts in the wild: transformers 4 (``rope_theta`` + ``rope_scaling``) and
transformers 5 (``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: missing files, unsupported architecture or settings.

    A ValueError, so the command line reports it as one line naming the problem."""


@dataclass(frozen=True)
class _Family:
    qkv_bias: str | bool  # a config key to read, or a fixed value
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool
    # Whether a set sliding_window is active without a use_sliding_window flag (Mistral).
    sliding_window_key_gates: bool


# Llama's attention_bias puts a bias on q, k, v and o; Qwen2 always has q/k/v biases and no o
# bias; Qwen3 normalises q and k per head; Mistral is Llama without biases.
_FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family("attention_bias", "attention_bias", "mlp_bias", False, False),
    "MistralForCausalLM": _Family(False, False, False, False, True),
    "Qwen2ForCausalLM": _Family(True, False, False, False, False),
    "Qwen3ForCausalLM": _Family("attention_bias", "attention_bias", False, True, False),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # rope_type ("default" | "linear" | "llama3") plus its parameters.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Active sliding-window size, or None. The engine refuses a max_model_len above it (this
    # implementation attends to the whole context).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; ``ModelLoadError`` names what is wrong."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in _FAMILIES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = _FAMILIES[arch]

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ModelLoadError(f"{source}: missing required field {key!r} for {arch}")
            return hf[key]

        def flag(spec: str | bool) -> bool:
            return bool(hf.get(spec, False)) if isinstance(spec, str) else spec

        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        head_dim = hf.get("head_dim") or hidden // num_heads

        rope_params = dict(hf.get("rope_scaling") or {})
        rope_params.update(hf.get("rope_parameters") or {})
        rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
        if rope_type not in _ROPE_TYPES:
            raise ModelLoadError(
                f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
            )
        if float(rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor other than 1 is not supported")
        rope_params["rope_type"] = rope_type
        rope_theta = float(rope_params.get("rope_theta") or hf.get("rope_theta") or 10000.0)

        window = hf.get("sliding_window")
        if family.sliding_window_key_gates:
            active_window = window
        else:
            active_window = window if hf.get("use_sliding_window", False) else None

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_params,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=flag(family.qkv_bias),
            o_bias=flag(family.o_bias),
            mlp_bias=flag(family.mlp_bias),
            qk_norm=family.qk_norm,
            sliding_window=int(active_window) if active_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
