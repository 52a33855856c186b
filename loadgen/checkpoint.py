"""The benchmark checkpoints: random Llama-architecture models saved as Hugging Face folders.

Owns ``make_standard_checkpoint`` (the standard benchmark model: hidden 512, 8 layers, 8 heads, 2 KV
heads, intermediate 1408, vocabulary 32000, context 2048, about 55M parameters), the checkpoints of
the shapes people run on CPUs (``SHAPES``: ``0.5b`` and ``1.5b``, Qwen2.5-0.5B's and -1.5B's
shapes as bias-free Llamas, tied embeddings; ``make_shape_checkpoint``, each with a bf16 GGUF of
the same bytes beside its safetensors for llama.cpp, ``loadgen/gguf_checkpoint.py``) and the
general ``make_llama_checkpoint`` they are built on. Weights are N(0, 0.02) from a
``torch.Generator`` seeded 0, drawn in float32 in a fixed tensor order and stored in bf16
(RMSNorm weights are 1); ``config.json`` names ``LlamaForCausalLM`` and ``torch_dtype: bfloat16``;
there is no tokenizer, since benchmark prompts are token ids. Both transformers and mqinfer's
loader read the folder.

A folder that already holds the same checkpoint (same config and seed, recorded in a stamp file
written last) is reused, so a benchmark run creates it once per machine.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

STANDARD_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

# Shapes of models people run on CPUs, as Llama-architecture overrides of the standard config:
# Qwen2.5-0.5B's and Qwen2.5-1.5B's layer shapes and vocabulary, without their q/k/v biases, with
# their tied embeddings (494M and 1.54B parameters).
SHAPES: dict[str, dict[str, Any]] = {
    "standard": {},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}
GGUF_NAME = "model-bf16.gguf"  # the GGUF beside a shape checkpoint's safetensors

_STAMP = "mqinfer-checkpoint.json"
_DTYPES = ("float32", "bfloat16", "float16")


def default_cache_dir() -> Path:
    """``$MQINFER_CACHE_DIR`` or ``$XDG_CACHE_HOME/mqinfer`` or ``~/.cache/mqinfer``."""
    explicit = os.environ.get("MQINFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mqinfer"


def standard_checkpoint_dir() -> Path:
    return default_cache_dir() / "standard-llama"


def shape_checkpoint_dir(shape: str) -> Path:
    """Where ``make_shape_checkpoint(shape)`` writes by default (the standard one's own folder)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown checkpoint shape {shape!r}: choose from {', '.join(SHAPES)}")
    return standard_checkpoint_dir() if shape == "standard" else default_cache_dir() / f"llama-{shape}"


def _full_config(overrides: dict[str, Any], dtype: str) -> dict[str, Any]:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    config = {**STANDARD_CONFIG, **overrides, "torch_dtype": dtype}
    if "head_dim" not in overrides and ("hidden_size" in overrides or "num_attention_heads" in overrides):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise ValueError(f"config {key} must be a positive integer, got {config[key]!r}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if config["attention_bias"] or config["mlp_bias"]:
        raise ValueError("this writer makes bias-free Llama checkpoints only")
    return config


def _tensors(config: dict[str, Any], seed: int):
    """(HF name, float32 tensor) in a fixed order, so a seed names exactly one checkpoint."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * d
    kv_size = config["num_key_value_heads"] * d
    vocab = config["vocab_size"]

    def normal(*shape: int):
        return torch.randn(*shape, generator=gen).mul_(0.02)

    yield "model.embed_tokens.weight", normal(vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", normal(q_size, h)
        yield f"{p}.self_attn.k_proj.weight", normal(kv_size, h)
        yield f"{p}.self_attn.v_proj.weight", normal(kv_size, h)
        yield f"{p}.self_attn.o_proj.weight", normal(h, q_size)
        yield f"{p}.mlp.gate_proj.weight", normal(inter, h)
        yield f"{p}.mlp.up_proj.weight", normal(inter, h)
        yield f"{p}.mlp.down_proj.weight", normal(h, inter)
        yield f"{p}.input_layernorm.weight", torch.ones(h)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h)
    yield "model.norm.weight", torch.ones(h)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", normal(vocab, h)


def _stamp(config: dict[str, Any], seed: int, gguf: bool = False) -> dict[str, Any]:
    # Without a GGUF the stamp is the one earlier versions wrote, so their checkpoints are reused.
    return {"format": 1, "seed": seed, "config": config, **({"gguf": GGUF_NAME} if gguf else {})}


def is_checkpoint(folder: str | os.PathLike, config: dict[str, Any], seed: int, gguf: bool = False) -> bool:
    """Whether ``folder`` holds the complete checkpoint this module would write for (config, seed)
    (and its GGUF, with ``gguf``)."""
    folder = Path(folder)
    stamp = folder / _STAMP
    if not (stamp.is_file() and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()):
        return False
    if gguf and not (folder / GGUF_NAME).is_file():
        return False
    try:
        return json.loads(stamp.read_text()) == _stamp(config, seed, gguf)
    except (OSError, ValueError):
        return False


def make_llama_checkpoint(folder: str | os.PathLike, *, seed: int = 0, dtype: str = "bfloat16",
                          gguf: bool = False, **overrides: Any) -> Path:
    """Write (or reuse) a random Llama checkpoint: the standard config with HF-key ``overrides``;
    with ``gguf`` (bfloat16 only) also ``GGUF_NAME``, the same weights for llama.cpp.

    The files are written in a temporary sibling folder and moved into place, so an interrupted
    run never leaves a half checkpoint that a later run would take for a whole one.
    """
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    config = _full_config(overrides, dtype)
    if gguf and dtype != "bfloat16":
        raise ValueError("the GGUF beside a checkpoint holds its bfloat16 bytes: dtype must be bfloat16")
    if is_checkpoint(folder, config, seed, gguf):
        return folder
    if folder.exists() and any(folder.iterdir()) and not (folder / _STAMP).exists():
        raise FileExistsError(f"{folder} exists and is not a checkpoint written by mqinfer.loadgen; "
                              "choose another folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    store = getattr(torch, dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        tensors = {name: t.to(store).contiguous() for name, t in _tensors(config, seed)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if gguf:
            from mqinfer.loadgen.gguf_checkpoint import write_gguf

            write_gguf(tmp / GGUF_NAME, config, tensors, name=folder.name)
        del tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
        # The stamp goes in last: its presence means the rest is complete.
        (tmp / _STAMP).write_text(json.dumps(_stamp(config, seed, gguf), sort_keys=True) + "\n")
        if folder.exists() and not is_checkpoint(folder, config, seed, gguf):
            shutil.rmtree(folder)  # an older or different mqinfer checkpoint (it had a stamp)
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process finished the same checkpoint first: keep theirs.
            if not is_checkpoint(folder, config, seed, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def make_standard_checkpoint(folder: str | os.PathLike | None = None) -> Path:
    """The standard benchmark checkpoint in ``folder`` (default: the cache's standard-llama)."""
    return make_llama_checkpoint(folder if folder is not None else standard_checkpoint_dir(), seed=0)


def make_shape_checkpoint(shape: str, folder: str | os.PathLike | None = None) -> Path:
    """The checkpoint of ``SHAPES[shape]`` with its GGUF (``folder / GGUF_NAME``), in ``folder``
    (default: ``shape_checkpoint_dir(shape)``); written once, reused after."""
    target = Path(folder) if folder is not None else shape_checkpoint_dir(shape)
    if shape == "standard":
        return make_standard_checkpoint(target)
    return make_llama_checkpoint(target, seed=0, gguf=True, **SHAPES[shape])


def checkpoint_from_gguf(gguf: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """A model from a GGUF file (any type mqinfer reads: SmolLM2's Q4_1, say) as a bfloat16 Hugging
    Face folder with its tokenizer, and ``GGUF_NAME`` beside it: those bfloat16 weights again, for
    llama.cpp. Both engines then run the same bytes (the source's dequantized values rounded once to
    bfloat16). Written once per source file (its size and modification time in the stamp)."""
    import torch
    from safetensors.torch import save_file

    from mqinfer.loadgen.gguf_checkpoint import write_gguf
    from mqinfer.workers.engine.gguf import GGUFCheckpoint
    from mqinfer.workers.engine.tokenizer import tokenizer_from_gguf

    source, folder = Path(gguf).resolve(), Path(folder)
    stamp = {"format": 1, "source": str(source), "size": source.stat().st_size,
             "mtime_ns": source.stat().st_mtime_ns, "gguf": GGUF_NAME}
    if (folder / _STAMP).is_file() and json.loads((folder / _STAMP).read_text()) == stamp:
        return folder
    if folder.exists() and any(folder.iterdir()) and not (folder / _STAMP).exists():
        raise FileExistsError(f"{folder} exists and is not a checkpoint written by mqinfer.loadgen; "
                              "choose another folder")
    checkpoint = GGUFCheckpoint(source)
    config = {**checkpoint.hf_config, "torch_dtype": "bfloat16"}
    eos = config.get("eos_token_id")
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in checkpoint.weights()
               if not (name == "lm_head.weight" and config.get("tie_word_embeddings"))}
    tokenizer = tokenizer_from_gguf(source)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}, indent=2) + "\n")
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(tokenizer.to_json())
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                {key: getattr(tokenizer, key) for key in
                 ("bos_token", "eos_token", "add_bos_token", "add_eos_token", "chat_template")}, indent=2) + "\n")
        write_gguf(tmp / GGUF_NAME, {**config, "eos_token_id": eos[0] if isinstance(eos, list) else eos},
                   tensors, name=source.stem)
        (tmp / _STAMP).write_text(json.dumps(stamp, sort_keys=True) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.checkpoint",
        description="Write (or find) a benchmark checkpoint and print its folder: a random one of a shape, "
                    "or a GGUF model as a bfloat16 folder with a bfloat16 GGUF of the same weights beside it.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--shape", choices=tuple(SHAPES), help="Random weights of this shape (with its GGUF).")
    what.add_argument("--from-gguf", metavar="FILE", help="A GGUF model to write as a bfloat16 folder and GGUF.")
    parser.add_argument("--out", metavar="DIR", help="The folder (default for --shape: under ~/.cache/mqinfer).")
    args = parser.parse_args(argv)
    if args.from_gguf and not args.out:
        parser.error("--from-gguf needs --out DIR")
    try:
        folder = (checkpoint_from_gguf(args.from_gguf, args.out) if args.from_gguf
                  else make_shape_checkpoint(args.shape, args.out))
    except (OSError, ValueError) as exc:
        print(f"checkpoint: error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def read_config(model: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint folder's config.json, with a clear error when it is missing."""
    path = Path(model) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{model} is not a checkpoint folder: no config.json") from None


if __name__ == "__main__":
    sys.exit(main())
