"""A worker's prepared model kept on disk, so that the next worker on the machine starts in a second.

Owns ``load_prepared`` and ``save_prepared``. Preparing a model can cost far more than reading
it: a GGUF file's quantized blocks are dequantized in Python (about 4 s for SmolLM2-135M's
Q4_1), its header and vocabulary parsed twice (model and tokenizer), and ``--quantization w8a8``
runs a calibration pass through the model and then quantizes every projection (about 8 s more).
After the first start, a worker instead reads what that work produced: the model's parameters
and buffers (int8 weights and scales, smoothed norms included) from one safetensors file, its
``ModelInfo``, and a GGUF's tokenizer as ``tokenizer.json`` text.

An entry is used only when everything that made it is unchanged; its key hashes:
- the source: a ``.gguf`` file's resolved path, size, modification time and inode, or a folder's
  ``config.json`` bytes and each weight file's name, size and modification time;
- what the engine asks for: the resolved dtype, ``quantization``, ``smoothquant_alpha``,
  ``quantize_lm_head``;
- the code that prepares a model (loader, GGUF reader, model and quantization modules, the int8
  quantizer, this module) and the torch and Python versions (calibration runs the model).

Only plain CPU models are kept (one tensor-parallel rank, one pipeline stage), and only when there
is preparation to save: a GGUF file or 8-bit weights; a safetensors folder in its own dtype loads
as fast as an entry would. Entries live under ``$MQINFER_PREPARED_CACHE_DIR``, else
``$MQINFER_CACHE_DIR/prepared``, else ``$XDG_CACHE_HOME/mqinfer/prepared``, else
``~/.cache/mqinfer/prepared``, one folder each,
written in a temporary folder and renamed into place (two workers starting together both write;
one rename wins). The ``_MAX_ENTRIES`` most recently used are kept. ``MQINFER_PREPARED_CACHE=off``
turns it off; ``MQINFER_PREPARED_CACHE_DIR`` puts it elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mqinfer.workers.engine.loader import ModelInfo, resolve_dtype
from mqinfer.workers.engine.models import LlamaForCausalLM, ModelConfig
from mqinfer.workers.engine.models.quant import Int8Linear

log = logging.getLogger(__name__)

SWITCH = "MQINFER_PREPARED_CACHE"
DIR_ENV = "MQINFER_PREPARED_CACHE_DIR"
FORMAT = 1
_MAX_ENTRIES = 4
_WEIGHTS, _META = "model.safetensors", "prepared.json"
# The code whose output an entry holds (relative to the package root).
_CODE = ("workers/engine/loader.py", "workers/engine/gguf.py", "workers/engine/gguf_tokenizer.py", "workers/engine/prepared.py",
         "workers/engine/models/llama.py", "workers/engine/models/quant.py", "workers/engine/models/config.py",
         "kernels/linear_int8.py")


def cache_dir() -> Path:
    own = os.environ.get(DIR_ENV)
    if own:
        return Path(own)
    explicit = os.environ.get("MQINFER_CACHE_DIR")
    if explicit:
        return Path(explicit) / "prepared"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mqinfer" / "prepared"


def _enabled() -> bool:
    return os.environ.get(SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def _source_identity(model: str) -> list[Any] | None:
    path = Path(model)
    if model.lower().endswith(".gguf") and path.is_file():
        st = path.stat()
        return ["gguf", str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino]
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return ["folder", str(path.resolve()), config.read_text(),
            [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]


def _code_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.blake2b(digest_size=16)
    for name in _CODE:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()


def entry_key(config: Any, device: torch.device) -> str | None:
    """The cache key of the model ``config`` (an ``EngineConfig``) asks for on ``device``, or None
    when such a model is not kept (see the module's docstring)."""
    if (not _enabled() or device.type != "cpu" or config.model == "tiny"
            or config.tensor_parallel_size != 1 or getattr(config, "pipeline_parallel_size", 1) != 1):
        return None
    source = _source_identity(config.model)
    if source is None or (source[0] != "gguf" and config.quantization == "none"):
        return None
    parts = [FORMAT, source, str(config.dtype), config.quantization, config.smoothquant_alpha,
             config.quantize_lm_head, _code_digest(), torch.__version__, sys.version]
    return hashlib.blake2b(json.dumps(parts, default=str).encode(), digest_size=16).hexdigest()


def _skeleton(model_config: dict[str, Any], dtype: torch.dtype, device: torch.device,
              int8: dict[str, list[Any]], untied_head: bool) -> LlamaForCausalLM:
    """The model's modules with uninitialised tensors, int8 projections where the entry has them."""
    config = ModelConfig(**{**model_config, "eos_token_ids": tuple(model_config["eos_token_ids"])})
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    if untied_head:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight), requires_grad=False)
    for name, (mode, out_features, in_features, bias) in int8.items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, Int8Linear.empty(out_features, in_features, mode, bias=bias, dtype=dtype, device=device))
    return model


def load_prepared(config: Any, device: torch.device):
    """``(model, info, tokenizer)`` from the entry for ``config`` (``tokenizer`` None unless the
    entry holds a GGUF's), or None when there is none (or it cannot be read: it is then removed
    and the model prepared again)."""
    key = entry_key(config, device)
    if key is None:
        return None
    folder = cache_dir() / key
    if not (folder / _META).is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        meta = json.loads((folder / _META).read_text())
        info = ModelInfo(**{**meta["info"], "eos_token_ids": tuple(meta["info"]["eos_token_ids"])})
        dtype = resolve_dtype(info.dtype)
        model = _skeleton(meta["model_config"], dtype, device, meta["int8"], meta["untied_head"])
        state = model.state_dict()
        with safe_open(str(folder / _WEIGHTS), framework="pt", device="cpu") as fh:
            names = set(fh.keys())
            for name, target in state.items():
                source = meta["aliases"].get(name, name)
                if source not in names:
                    raise ValueError(f"no tensor {source}")
                target.copy_(fh.get_tensor(source))
        os.utime(folder / _META)  # most recently used
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        log.warning("prepared model %s unreadable (%s); preparing the model again", folder, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    tokenizer = None
    if meta.get("tokenizer_json"):
        from tokenizers import Tokenizer

        from mqinfer.workers.engine.tokenizer import HFTokenizer

        tokenizer = HFTokenizer(Tokenizer.from_str(meta["tokenizer_json"]), meta["tokenizer_config"])
    return model.eval(), info, tokenizer


def _int8_modules(model: torch.nn.Module) -> dict[str, list[Any]]:
    return {name: [m.mode, m.out_features, m.in_features, m.bias is not None]
            for name, m in model.named_modules() if isinstance(m, Int8Linear)}


def save_prepared(config: Any, device: torch.device, model: LlamaForCausalLM, info: ModelInfo,
                  tokenizer: Any) -> Path | None:
    """Keep ``model`` (as the engine will run it), ``info`` and a GGUF's tokenizer for the next
    start; the entry's folder, or None when such a model is not kept or it could not be written."""
    key = entry_key(config, device)
    if key is None:
        return None
    from safetensors.torch import save_file

    root = cache_dir()
    folder = root / key
    if (folder / _META).is_file():
        return folder
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_by_storage: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        where = (tensor.data_ptr(), tuple(tensor.shape))
        if where in first_by_storage:
            aliases[name] = first_by_storage[where]
        else:
            first_by_storage[where] = name
            tensors[name] = tensor.detach().contiguous()
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    meta = {"format": FORMAT, "info": dataclasses.asdict(info), "model_config": dataclasses.asdict(model.config),
            "int8": _int8_modules(model), "aliases": aliases,
            "untied_head": model.config.tie_word_embeddings and head in tensors and aliases.get(head) != embedding,
            "tokenizer_json": None, "tokenizer_config": None}
    if str(config.model).lower().endswith(".gguf") and tokenizer is not None and hasattr(tokenizer, "to_json"):
        meta["tokenizer_json"] = tokenizer.to_json()
        meta["tokenizer_config"] = {key: getattr(tokenizer, key) for key in
                                    ("bos_token", "eos_token", "add_bos_token", "add_eos_token", "chat_template")}
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            save_file(tensors, str(tmp / _WEIGHTS))
            (tmp / _META).write_text(json.dumps(meta))  # last: its presence means the entry is whole
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _META).is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _evict(root, keep=folder)
    except OSError as exc:
        log.warning("could not keep the prepared model in %s (%s); the next start prepares it again", root, exc)
        return None
    return folder


def _evict(root: Path, keep: Path) -> None:
    """Remove the least recently used entries beyond ``_MAX_ENTRIES`` (and stale temporary folders)."""
    entries = []
    for path in root.iterdir():
        if path.name.startswith(".") and time.time() - path.stat().st_mtime > 3600:
            shutil.rmtree(path, ignore_errors=True)
        elif (path / _META).is_file():
            entries.append(((path / _META).stat().st_mtime, path))
    entries.sort(reverse=True)
    for _, path in entries[_MAX_ENTRIES:]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


__all__ = ["DIR_ENV", "SWITCH", "cache_dir", "entry_key", "load_prepared", "save_prepared"]
