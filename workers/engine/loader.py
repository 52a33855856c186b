"""Loading models: local Hugging Face checkpoints and the built-in ``tiny`` model.

Owns ``load_model`` (checkpoint folder, ``.gguf`` file via gguf.py, or ``"tiny"`` -> model +
``ModelInfo``), the dtype rule (``auto`` = the checkpoint's ``torch_dtype``/``dtype``, else
float32), the model id (name + "@" + 8 hex digits of a hash of the config and weights), and the
checkpoint writers ``save_tiny_checkpoint`` and ``make_random_checkpoint``.

The tiny model is a Llama of about 3M parameters (hidden 256, 4 layers, 4 heads, 2 KV heads,
head_dim 64, intermediate 704, vocab 264 = 256 bytes + specials: 256 ``<|bos|>``, 257
``<|eos|>``, 258 ``<|pad|>``, 259-263 reserved; context 2048). Its weights are drawn from
N(0, 0.02) by a ``torch.Generator`` seeded 0 in a fixed tensor order (RMSNorm weights are 1),
so it is the same model on every machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from mqinfer.kernels import kv_quant
from mqinfer.workers.engine.models import LlamaForCausalLM, ModelConfig
from mqinfer.workers.engine.models.config import ModelLoadError
from mqinfer.workers.engine.models.stage import Stage, StageModel
from mqinfer.workers.engine.parallel import Shard, num_params, read_safetensors_shard

log = logging.getLogger("mqinfer.loader")

TINY = "tiny"
TINY_BOS, TINY_EOS, TINY_PAD = 256, 257, 258
TINY_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 264,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": TINY_BOS,
    "eos_token_id": TINY_EOS,
    "pad_token_id": TINY_PAD,
    "torch_dtype": "float32",
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# Checkpoints at most this big are hashed in full for the model id; bigger ones by their
# safetensors headers, sizes and sampled chunks (hashing 16 GB would take longer than loading).
_FULL_HASH_LIMIT = 256 << 20
_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    hidden_size: int
    intermediate_size: int
    num_params: int
    # Active sliding-window size (None when the model attends to the whole context).
    sliding_window: int | None = None
    # The checkpoint folder (or .gguf file); None for the built-in tiny model.
    path: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_as("auto")

    def kv_bytes_per_token_as(self, kv_cache_dtype: str) -> int:
        """One token's K and V in every layer for a ``--kv-cache-dtype``, 8-bit scales included."""
        return kv_quant.kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                           _DTYPE_SIZES[self.dtype], kv_cache_dtype)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# A CPU computes these half-precision types at full speed only with the matching instructions;
# without them PyTorch's matmuls fall back to paths many times slower than float32 (measured on an
# AVX2 CPU: bfloat16 matmul about 20x slower than float32).
_NATIVE_HALF_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def cpu_computes_natively(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    needed = _NATIVE_HALF_FLAGS.get(dtype)
    if needed is None:
        return True
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in needed)


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any] | None = None,
                  device: torch.device | str | None = None, flags: frozenset[str] | None = None) -> torch.dtype:
    """``auto`` -> the checkpoint's torch_dtype/dtype (float32 when absent); names -> dtypes.

    On a CPU without native instructions for the checkpoint's half-precision type, ``auto`` is
    float32: the same weights, computed many times faster there. An explicit dtype is kept.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        declared = (hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype")
        chosen = _DTYPES.get(str(declared).removeprefix("torch."), torch.float32)
        if device is not None and torch.device(device).type == "cpu" and not cpu_computes_natively(chosen, flags):
            log.info("dtype auto: the checkpoint is %s, but this CPU has no native %s matmul; computing in "
                     "float32 (--dtype %s forces it)", _dtype_name(chosen), _dtype_name(chosen), _dtype_name(chosen))
            return torch.float32
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------- random
def _random_weights(config: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors (HF names, float32) in a fixed order: N(0, 0.02), norms 1."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    yield "model.embed_tokens.weight", normal(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", normal(q_size, h)
        yield f"{p}.self_attn.k_proj.weight", normal(kv_size, h)
        yield f"{p}.self_attn.v_proj.weight", normal(kv_size, h)
        yield f"{p}.self_attn.o_proj.weight", normal(h, q_size)
        if config.qkv_bias:
            yield f"{p}.self_attn.q_proj.bias", normal(q_size)
            yield f"{p}.self_attn.k_proj.bias", normal(kv_size)
            yield f"{p}.self_attn.v_proj.bias", normal(kv_size)
        if config.o_bias:
            yield f"{p}.self_attn.o_proj.bias", normal(h)
        if config.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", torch.ones(d)
            yield f"{p}.self_attn.k_norm.weight", torch.ones(d)
        yield f"{p}.mlp.gate_proj.weight", normal(inter, h)
        yield f"{p}.mlp.up_proj.weight", normal(inter, h)
        yield f"{p}.mlp.down_proj.weight", normal(h, inter)
        if config.mlp_bias:
            yield f"{p}.mlp.gate_proj.bias", normal(inter)
            yield f"{p}.mlp.up_proj.bias", normal(inter)
            yield f"{p}.mlp.down_proj.bias", normal(h)
        yield f"{p}.input_layernorm.weight", torch.ones(h)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h)
    yield "model.norm.weight", torch.ones(h)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", normal(config.vocab_size, h)


def _tiny_tensors() -> dict[str, torch.Tensor]:
    return _tiny_checkpoint()[0]


@functools.cache
def _tiny_checkpoint() -> tuple[dict[str, torch.Tensor], str]:
    """The tiny model's tensors and its id (a hash of its config and weights), made once per
    process; a process forked after the first call shares them. Callers only read the tensors:
    loading copies them into the model's own parameters."""
    tensors = dict(_random_weights(ModelConfig.from_hf(TINY_HF_CONFIG, "tiny"), seed=0))
    digest = hashlib.blake2b(json.dumps(TINY_HF_CONFIG, sort_keys=True).encode(), digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].numpy().tobytes())
    return tensors, f"{TINY}@{digest.hexdigest()[:8]}"


def make_tiny_weights() -> None:
    """Make the tiny model's weights now, once per process, with PyTorch on this thread alone: a
    process that forks workers afterwards (a warm template) gives them the weights ready-made
    (about 60 ms of CPU each). A parallel operation would start OpenMP's threads here, and a
    forked child's first parallel region would then wait forever on threads the fork did not
    copy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _tiny_checkpoint()
    finally:
        torch.set_num_threads(threads)


def _write_checkpoint(folder: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                      generation: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if generation:
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def save_tiny_checkpoint(folder: str | os.PathLike) -> Path:
    """Write the tiny model as a HF checkpoint folder (config.json, model.safetensors; no
    tokenizer.json) that transformers can load."""
    folder = Path(folder)
    generation = {"bos_token_id": TINY_BOS, "eos_token_id": TINY_EOS, "pad_token_id": TINY_PAD}
    _write_checkpoint(folder, TINY_HF_CONFIG, _tiny_tensors(), generation)
    return folder


def make_random_checkpoint(folder: str | os.PathLike, dtype: str = "bfloat16", seed: int = 0,
                           **config: Any) -> Path:
    """Write a random Llama-architecture checkpoint (benchmarks): tiny's config overridden by
    ``config`` (HF keys, e.g. hidden_size=2048, num_hidden_layers=16), weights from a
    generator seeded ``seed``, stored in ``dtype``."""
    torch_dtype = resolve_dtype(dtype)
    hf = dict(TINY_HF_CONFIG)
    hf.update(config)
    if "head_dim" not in config and ("hidden_size" in config or "num_attention_heads" in config):
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    hf["torch_dtype"] = _dtype_name(torch_dtype)
    parsed = ModelConfig.from_hf(hf, "make_random_checkpoint")
    tensors = {name: t.to(torch_dtype) for name, t in _random_weights(parsed, seed)}
    folder = Path(folder)
    _write_checkpoint(folder, hf, tensors,
                      {"bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf.get("eos_token_id")})
    return folder


# ---------------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from None


def weight_files(folder: Path) -> list[Path]:
    """A checkpoint folder's safetensors files: those its index names, else ``model.safetensors``,
    else every ``*.safetensors``; ModelLoadError when there are none."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names weight files that do not exist: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files (only safetensors is supported)")
    return files


def _hash_files(config_bytes: bytes, files: list[Path]) -> str:
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    total = sum(f.stat().st_size for f in files)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as fh:
            if total <= _FULL_HASH_LIMIT:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
                continue
            header_len = int.from_bytes(fh.read(8), "little")
            digest.update(fh.read(header_len))
            for offset in (0, size // 2, max(0, size - _SAMPLE_BYTES)):
                fh.seek(offset)
                digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:8]


def iter_checkpoint(files: list[Path], shard: Shard | None = None,
                    keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files; with ``shard``, only that rank's slices of the split ones; with
    ``keep``, only the tensors it keeps (a pipeline stage's), the others never read."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            if shard is not None:
                yield from read_safetensors_shard(str(path), shard, keep)
                continue
            with safe_open(str(path), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    if keep is None or keep(name):
                        yield name, fh.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from None


def _eos_ids(*configs: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        for token in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _build(config: ModelConfig, weights, dtype: torch.dtype, device: torch.device,
           source: str, shard: Shard | None = None, stage: Stage | None = None) -> LlamaForCausalLM:
    if stage is not None:
        model = StageModel(config, stage, dtype=dtype, device=device, shard=shard)
    else:
        model = LlamaForCausalLM(config, dtype=dtype, device=device, shard=shard)
    loaded = model.load_weights(weights)
    missing = model.checkpoint_weight_names() - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(f"{source}: missing {len(missing)} weight tensors (e.g. {shown})")
    return model.eval()


def _sliced(weights, shard: Shard | None):
    """Whole tensors already in memory, cut to ``shard``'s parts."""
    if shard is None:
        yield from weights
        return
    for name, tensor in weights:
        yield name, shard.take(name, tensor)


def load_model(
    path_or_tiny: str, device: torch.device | str = "cpu", dtype: str | torch.dtype = "auto",
    shard: tuple[int, int] | None = None, stage: tuple[int, int] | None = None,
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """Load ``"tiny"``, a local HF checkpoint folder or a ``.gguf`` file onto ``device`` in ``dtype``.

    ``shard = (rank, size)``: that tensor-parallel rank's part only (``workers/engine/parallel.py``); a
    checkpoint folder's safetensors are read slice by slice, so a rank reads its own bytes and the
    replicated tensors (embedding, norms) only. ``stage = (index, count)``: that pipeline stage's
    layers only (``workers/engine/models/stage.py``), the other stages' tensors never read from a
    checkpoint folder. ``ModelInfo`` describes the whole model either way.
    ``ModelLoadError`` names the missing file, unsupported architecture or bad tensor.
    """
    device = torch.device(device)
    if path_or_tiny == TINY:
        return _load_tiny(device, dtype, shard, stage)
    if path_or_tiny.lower().endswith(".gguf"):
        return _load_gguf(path_or_tiny, device, dtype, shard, stage)
    return _load_folder(path_or_tiny, device, dtype, shard, stage)


def _shard_of(config: ModelConfig, shard: tuple[int, int] | None) -> Shard | None:
    """The tensor-parallel part of ``shard = (rank, size)``; None: every tensor whole."""
    return None if shard is None else Shard.of(config, *shard)


def _stage_of(config: ModelConfig, stage: tuple[int, int] | None) -> Stage | None:
    """The pipeline stage of ``stage = (index, count)``; None: every layer."""
    return None if stage is None else Stage.of(config.num_layers, *stage)


def _load_tiny(device: torch.device, dtype: str | torch.dtype, shard: tuple[int, int] | None,
               stage: tuple[int, int] | None) -> tuple[LlamaForCausalLM, ModelInfo]:
    """The built-in tiny model; its id hashes its config and its (seeded) weights."""
    hf = dict(TINY_HF_CONFIG)
    config = ModelConfig.from_hf(hf, "tiny")
    torch_dtype = resolve_dtype(dtype, hf, device)
    tensors, model_id = _tiny_checkpoint()
    split = _shard_of(config, shard)
    part = _stage_of(config, stage)
    model = _build(config, _sliced(tensors.items(), split), torch_dtype, device, "tiny", split, part)
    return model, _model_info(model, config, torch_dtype, name=TINY, model_id=model_id,
                              path=None, eos_token_ids=config.eos_token_ids, whole=split is None and part is None)


def _load_gguf(path: str, device: torch.device, dtype: str | torch.dtype, shard: tuple[int, int] | None,
               stage: tuple[int, int] | None) -> tuple[LlamaForCausalLM, ModelInfo]:
    """A ``.gguf`` file (workers/engine/gguf.py), its tensors in Hugging Face names and layout."""
    from mqinfer.workers.engine.gguf import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    hf = checkpoint.hf_config
    config = ModelConfig.from_hf(hf, path)
    torch_dtype = resolve_dtype(dtype, hf, device)
    weights = checkpoint.weights()
    split = _shard_of(config, shard)
    part = _stage_of(config, stage)
    model = _build(config, _sliced(weights, split), torch_dtype, device, path, split, part)
    name = Path(path).resolve().name
    return model, _model_info(model, config, torch_dtype, name=name,
                              model_id=f"{name}@{checkpoint.digest(_FULL_HASH_LIMIT, _SAMPLE_BYTES)}", path=path,
                              eos_token_ids=_eos_ids(hf), whole=split is None and part is None)


def _load_folder(path: str, device: torch.device, dtype: str | torch.dtype, shard: tuple[int, int] | None,
                 stage: tuple[int, int] | None) -> tuple[LlamaForCausalLM, ModelInfo]:
    """A Hugging Face checkpoint folder (config.json, safetensors); a stage reads its own tensors only."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model {path!r} is neither 'tiny' nor a checkpoint folder")
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{config_path}: file not found (a checkpoint folder needs config.json)")
    config_bytes = config_path.read_bytes()
    hf = _read_json(config_path)
    config = ModelConfig.from_hf(hf, str(config_path))
    gen_path = folder / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    torch_dtype = resolve_dtype(dtype, hf, device)
    files = weight_files(folder)
    part = _stage_of(config, stage)
    keep = None if part is None else (lambda name: part.holds(name, config.tie_word_embeddings))
    split = _shard_of(config, shard)
    model = _build(config, iter_checkpoint(files, split, keep), torch_dtype, device, str(folder), split, part)
    name = folder.resolve().name
    return model, _model_info(model, config, torch_dtype, name=name,
                              model_id=f"{name}@{_hash_files(config_bytes, files)}", path=str(folder),
                              eos_token_ids=_eos_ids(generation, hf), whole=split is None and part is None)


def _model_info(model: LlamaForCausalLM, config: ModelConfig, torch_dtype: torch.dtype, *, name: str,
                model_id: str, path: str | None, eos_token_ids: tuple[int, ...], whole: bool) -> ModelInfo:
    """The whole model's ``ModelInfo``; ``whole``: ``model`` is all of it (not a shard or a stage),
    so its parameters are counted, not computed from the config."""
    return ModelInfo(
        name=name,
        model_id=model_id,
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings,
        eos_token_ids=eos_token_ids,
        bos_token_id=config.bos_token_id,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=_dtype_name(torch_dtype),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_params=sum(p.numel() for p in model.parameters()) if whole else num_params(config),
        sliding_window=config.sliding_window,
        path=path,
    )


__all__ = [
    "ModelInfo",
    "ModelLoadError",
    "TINY",
    "load_model",
    "make_random_checkpoint",
    "resolve_dtype",
    "save_tiny_checkpoint",
]
