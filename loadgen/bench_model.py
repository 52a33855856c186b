"""The model a benchmark runs: `tiny`, the standard benchmark checkpoint, or any checkpoint folder.

Owns ``ModelSpec`` (what the workers get as ``--model``, the folder transformers loads, its
config) and the range prompt token ids are drawn from. Prompts are token ids, so a folder needs no
tokenizer; when it has one, its special tokens (and the config's bos/eos/pad ids) are kept out of
the prompts: a block of them at the low end of the vocabulary raises the lowest id drawn, a block
at the high end (Llama 3, Qwen2) lowers the highest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.workload import MIN_TOKEN_ID


@dataclass
class ModelSpec:
    arg: str  # what the workers get as --model
    folder: Path | None  # a checkpoint folder transformers can load (None until needed for tiny)
    config: dict[str, Any]  # its config.json
    vocab_size: int  # token ids for prompts are drawn below this
    max_model_len: int
    min_token_id: int = MIN_TOKEN_ID  # ... and from this up


def resolve_model(model: str | None) -> ModelSpec:
    """``model``: None (the standard checkpoint), a shape name of ``checkpoint.SHAPES`` (its random
    checkpoint and GGUF, written once under the cache), ``tiny``, or a checkpoint folder."""
    from mqinfer.loadgen.checkpoint import (
        SHAPES,
        make_shape_checkpoint,
        make_standard_checkpoint,
        read_config,
        shape_checkpoint_dir,
        standard_checkpoint_dir,
    )

    if model is None:
        folder = standard_checkpoint_dir()
        log(f"standard checkpoint: {folder}")
        make_standard_checkpoint(folder)
        model = str(folder)
    elif model in SHAPES:
        folder = shape_checkpoint_dir(model)
        log(f"the {model} checkpoint (random weights): {folder}; written once, with its GGUF")
        model = str(make_shape_checkpoint(model, folder))
    if model == "tiny":
        from mqinfer.workers.engine.loader import TINY_BOS, TINY_HF_CONFIG

        # Byte ids only: the ids from TINY_BOS up are special tokens.
        return ModelSpec("tiny", None, dict(TINY_HF_CONFIG), int(TINY_BOS),
                         int(TINY_HF_CONFIG["max_position_embeddings"]))
    folder = Path(model).resolve()
    config = read_config(folder)
    if not isinstance(config.get("vocab_size"), int) or config["vocab_size"] < 1:
        raise ValueError(f"{folder}/config.json has no vocab_size; prompt token ids are drawn below it")
    low, high = prompt_id_range(folder, config)
    return ModelSpec(str(folder), folder, config, high, int(config.get("max_position_embeddings") or 2048), low)


def special_token_ids(folder: Path, config: dict[str, Any]) -> set[int]:
    """The config's bos/eos/pad ids and the tokens a tokenizer file marks special (none without one)."""
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                ids.add(v)
    tokenizer = _read_json(folder / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and token.get("special") and isinstance(token.get("id"), int):
            ids.add(token["id"])
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    for key, token in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and token.get("special") and str(key).isdigit():
            ids.add(int(key))
    return ids


def prompt_id_range(folder: Path, config: dict[str, Any]) -> tuple[int, int]:
    """``(low, high)``: prompt token ids are drawn from ``low`` up to, not including, ``high``."""
    vocab_size = int(config["vocab_size"])
    special = special_token_ids(folder, config)
    low_block = [i for i in special if i < vocab_size // 2]
    high_block = [i for i in special if vocab_size // 2 <= i < vocab_size]
    low = max([MIN_TOKEN_ID] + [i + 1 for i in low_block])
    high = min([vocab_size] + high_block)
    if high - low < 2:
        raise ValueError(f"{folder}: no ordinary token ids left between the special ones "
                         f"(vocab_size {vocab_size}, ordinary ids {low}..{high - 1})")
    return low, high


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def hf_folder(spec: ModelSpec, scratch: Path) -> Path:
    """A folder transformers can load: the checkpoint's own, or the tiny model saved once to ``scratch``."""
    if spec.folder is not None:
        return spec.folder
    from mqinfer.workers.engine.loader import save_tiny_checkpoint

    spec.folder = save_tiny_checkpoint(scratch / "tiny-checkpoint")
    return spec.folder
