"""Text in and out of token ids: the tiny model's byte tokenizer, Hugging Face tokenizer.json
tokenizers, chat templates, and incremental detokenization with stop strings.

``ByteTokenizer`` (the built-in tiny model): ``encode`` = BOS (256) followed by the UTF-8 bytes;
``decode`` keeps ids below 256 (specials are skipped) and replaces invalid UTF-8 with U+FFFD.
Its chat template, documented here because it is the only place it is defined::

    for each message:  "<|" + role + "|>\\n" + content + "\\n"
    then:              "<|assistant|>\\n"

(the role markers are plain text, since the byte vocabulary has no room for them), and a chat
prompt is encoded like any text, BOS first.

``HFTokenizer`` wraps the ``tokenizers`` library on a checkpoint's tokenizer.json, honouring
tokenizer_config.json (``add_bos_token`` / ``add_eos_token``, ``bos_token`` / ``eos_token``,
``chat_template``, or a ``chat_template.jinja`` file). Chat templates are rendered in a
sandboxed jinja2 environment with ``add_generation_prompt=True``; the rendered text already
carries the template's special tokens, so it is encoded without adding any more.

``IncrementalDetokenizer`` turns a stream of output ids into text deltas that never end in a
partial multi-byte character, and ends the text before the first stop string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from mqinfer.workers.engine.gguf_tokenizer import tokenizer_parts_from_gguf

if TYPE_CHECKING:
    import tokenizers

# Prompt tokens fed to the detokenizer ahead of the output, so that the first output token is
# decoded in context (sentencepiece-style tokenizers drop a leading space at the start).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int
    # Whether decoding a window of ids can depend on the ids before it.
    decode_needs_context: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...


def validate_messages(messages: Any) -> list[dict]:
    """Chat messages: a non-empty list of {"role": str, "content": str}. ValueError otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    return messages


class ByteTokenizer:
    """The tiny model's tokenizer: 256 byte tokens plus specials (see the module docstring)."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 264
    decode_needs_context = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        validate_messages(messages)
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        parts.append("<|assistant|>\n")
        return "".join(parts)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A checkpoint's tokenizer.json through the ``tokenizers`` library."""

    decode_needs_context = True

    def __init__(self, tokenizer_json: str | Path | tokenizers.Tokenizer,
                 tokenizer_config: dict[str, Any] | None = None, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        # A tokenizer.json path, or a tokenizer already built (from a GGUF file's metadata).
        if isinstance(tokenizer_json, _RustTokenizer):
            self._tok = tokenizer_json
        else:
            self._tok = _RustTokenizer.from_file(str(tokenizer_json))
        cfg = tokenizer_config or {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token: bool | None = cfg.get("add_bos_token")
        self.add_eos_token: bool | None = cfg.get("add_eos_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template = chat_template if chat_template is not None else cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "HFTokenizer":
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        jinja_path = folder / "chat_template.jinja"
        template = jinja_path.read_text() if jinja_path.exists() else None
        return cls(folder / "tokenizer.json", config, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        # tokenizer.json's post-processor adds what it adds; tokenizer_config.json has the
        # final word on BOS/EOS when it says so explicitly.
        bos, eos = self.bos_token_id, self.eos_token_id
        if bos is not None:
            if self.add_bos_token is True and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            elif self.add_bos_token is False and ids and ids[0] == bos and not text.startswith(self.bos_token or "\0"):
                ids = ids[1:]
        if eos is not None and self.add_eos_token is True and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, for libraries that build their own copy of it
        (structured output's token masks)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict]) -> str:
        validate_messages(messages)
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat_template; send a prompt instead of messages")
        if self._compiled is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from None
        from jinja2 import TemplateError

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def tokenizer_from_gguf(path: str | Path) -> HFTokenizer | None:
    """The tokenizer stored in a .gguf file (workers/engine/gguf_tokenizer.py rebuilds it), or None when
    the file has no vocabulary."""
    parts = tokenizer_parts_from_gguf(path)
    return None if parts is None else HFTokenizer(*parts)


def load_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """The checkpoint's tokenizer, or None when the folder has no tokenizer.json (or the .gguf
    file no vocabulary in its metadata)."""
    folder = Path(folder)
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return tokenizer_from_gguf(folder)
    if not (folder / "tokenizer.json").exists():
        return None
    return HFTokenizer.from_folder(folder)


class IncrementalDetokenizer:
    """Output ids in, text deltas out; stops the text before the first stop string.

    ``feed`` returns the new text that is safe to show: never a trailing partial UTF-8
    character (held while the decoded window ends in U+FFFD), and never a tail that could be
    the start of a stop string (held until the next tokens decide). ``flush`` returns what is
    still held when the request ends. ``text`` is everything produced so far, cut before a
    matched stop string; ``stopped`` tells whether one matched.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if tokenizer.decode_needs_context else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        return self._text

    def feed(self, new_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(new_ids)
        self._decode_pending(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Everything still held (a partial character decodes as U+FFFD at the end)."""
        if not self.stopped:
            self._decode_pending(final=True)
        return self._release(final=True)

    def _decode_pending(self, final: bool) -> None:
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(_REPLACEMENT) and not final):
            return
        start = len(self._text)
        self._text += window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        if not self.stop:
            return
        search_from = max(0, start - self._max_stop + 1)
        hits = [i for i in (self._text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not final and not self.stopped:
            end -= self._stop_prefix_len()
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "validate_messages",
]
