"""The tokenizer a GGUF file describes in its metadata, rebuilt with the ``tokenizers`` library.

A GGUF has no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``), its kind
(``tokenizer.ggml.model``), merges or scores, token types, the special ids and flags, and the
chat template. Two kinds are built here, both as a BPE model and the settings that
``workers/engine/tokenizer.py`` wraps in an ``HFTokenizer`` (``tokenizer_from_gguf``), so BOS, EOS and the
chat template behave as for a checkpoint folder:

- ``gpt2``: byte-level BPE. Tokens are already spelled in the byte-to-unicode alphabet and the
  merges are given. Text is split by the pre-tokenizer regex that ``tokenizer.ggml.pre`` names
  (Llama 3's, Qwen2's), else GPT-2's. Llama 3 files also match whole words before merging, as
  llama.cpp does for them.
- ``llama``: sentencepiece-style BPE over "▁"-marked pieces with byte fallback (``<0xNN>``
  tokens). Files store scores instead of merges: every split of a token into two tokens is a
  merge, ranked by the score of the token it makes (then longer left part, longer right part,
  vocabulary order).

Control tokens (type 3) become special tokens, user-defined ones (type 4) added tokens, so
that both are matched whole in the text. Any other kind is a ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mqinfer.workers.engine.gguf import GGUFFile
from mqinfer.workers.engine.models.config import ModelLoadError

log = logging.getLogger("mqinfer.gguf")

SUPPORTED_TOKENIZERS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4
_SPACE_MARK = "\u2581"

# Pre-tokenizer splits by tokenizer.ggml.pre: how each vocabulary's merges were learned.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers whose whole words are looked up before any merge (llama.cpp's ignore_merges).
_WHOLE_WORDS_FIRST = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
# Pre-tokenizers that are GPT-2's own split (no warning for these).
_GPT2_SPLIT_NAMES = {None, "default", "gpt2", "gpt-2", "smollm"}


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    ranked = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], -len(left), -len(right), i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _special_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    added = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    return control, added


def _byte_level(meta: dict[str, Any]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens, pre = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.pre")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in _WHOLE_WORDS_FIRST))
    split = _SPLITS.get(pre)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _GPT2_SPLIT_NAMES:
            log.warning("GGUF tokenizer.ggml.pre %r is not known here; splitting text like GPT-2", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError("GGUF tokenizer 'llama' needs tokenizer.ggml.scores, one per token")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE_MARK, prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def tokenizer_parts(meta: dict[str, Any], source: str = "GGUF") -> tuple[Any, dict[str, Any]] | None:
    """The tokenizer of GGUF metadata (``GGUFFile.metadata``) as a ``tokenizers.Tokenizer`` and the
    settings of a tokenizer_config.json (BOS, EOS, chat template), or None when it has no vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or not meta.get("tokenizer.ggml.tokens"):
        return None
    if kind not in SUPPORTED_TOKENIZERS:
        raise ModelLoadError(f"{source}: GGUF tokenizer type {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TOKENIZERS)})")
    tok = _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    control, added = _special_tokens(tokens, meta.get("tokenizer.ggml.token_type") or [])
    if control:
        tok.add_special_tokens(control)
    if added:
        tok.add_tokens(added)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        # llama.cpp's defaults when the file does not say: BOS for sentencepiece vocabularies only.
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, config


def tokenizer_parts_from_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, Any]] | None:
    """``tokenizer_parts`` of a .gguf file's metadata."""
    return tokenizer_parts(GGUFFile(path).metadata, str(path))


__all__ = ["SUPPORTED_TOKENIZERS", "tokenizer_parts", "tokenizer_parts_from_gguf"]
