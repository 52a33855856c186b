"""What a request asks of the engine's model, checked before it is queued.

A prompt becomes token ids (text through the model's tokenizer, chat messages through its chat
template, or ids given as they are), and the ids, the length and the sampling settings are checked
against the model: every token id inside its vocabulary, room left under the context limit
(``max_model_len``) to generate, a tokenizer for stop strings. A request that fails raises
:class:`EngineInputError` with a stable ``code`` (``schemas/errors.py``), so the worker writes an
error row instead of failing.
"""

from __future__ import annotations

from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas import errors
from mqinfer.workers.engine.loader import ModelInfo
from mqinfer.workers.engine.tokenizer import Tokenizer


class EngineInputError(Exception):
    """A request the engine cannot run, with a stable ``code`` and a human ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InputChecks:
    """The checks of one engine's model: its vocabulary, tokenizer (None: token ids only) and
    context limit."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def encode_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                      messages: list[dict] | None) -> list[int]:
        """Token ids for exactly one of a text prompt, token ids, or chat messages."""
        given = [name for name, v in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise EngineInputError(
                "invalid_request",
                "exactly one of prompt, prompt_token_ids or messages is required"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            self.check_token_ids(ids)
        else:
            if self.tokenizer is None:
                raise EngineInputError(
                    "invalid_request",
                    f"{given[0]}: model {self.info.name} has no tokenizer (no tokenizer.json); "
                    "send prompt_token_ids instead",
                )
            try:
                ids = self.tokenizer.encode(prompt) if prompt is not None else self.tokenizer.encode_chat(messages)
            except ValueError as exc:
                raise EngineInputError("invalid_request", f"{given[0]}: {exc}") from None
        if not ids:
            raise EngineInputError("invalid_request", f"{given[0]}: the prompt has no tokens")
        self.check_length(len(ids))
        return ids

    def check_prompt(self, ids: list[int]) -> None:
        """A prompt given as token ids: not empty, under the context limit, inside the vocabulary."""
        if not ids:
            raise EngineInputError("invalid_request", "prompt_token_ids: the prompt has no tokens")
        self.check_length(len(ids))
        self.check_token_ids(ids)

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.info.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise EngineInputError(
                    "invalid_token_id",
                    f"prompt_token_ids[{i}] = {t!r} is outside the vocabulary (0..{vocab - 1})",
                )

    def check_length(self, n: int) -> None:
        if n >= self.max_model_len:
            raise EngineInputError(
                "prompt_too_long",
                f"prompt has {n} tokens; the context limit (max_model_len) is {self.max_model_len}, "
                "which leaves no room to generate",
            )

    def check_sampling(self, sampling: SamplingParams) -> None:
        """What a request's sampling asks of this model: token ids in its vocabulary, a tokenizer
        for stop strings."""
        self._check_logit_bias(sampling)
        self._check_stop_token_ids(sampling)
        if sampling.stop and self.tokenizer is None:
            raise EngineInputError(
                "invalid_request",
                f"stop: stop strings need a tokenizer and model {self.info.name} has none; use stop_token_ids",
            )

    def _check_logit_bias(self, sampling: SamplingParams) -> None:
        vocab = self.info.vocab_size
        for token, _ in sampling.logit_bias:
            if token >= vocab:
                raise EngineInputError(
                    errors.INVALID_TOKEN_ID,
                    f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1}) of model "
                    f"{self.info.name} - at `{sampling.field_prefix}.logit_bias`",
                )

    def _check_stop_token_ids(self, sampling: SamplingParams) -> None:
        vocab = self.info.vocab_size
        for i, token in enumerate(sampling.stop_token_ids):
            if not 0 <= token < vocab:
                raise EngineInputError(
                    errors.INVALID_TOKEN_ID,
                    f"stop_token_ids: token id {token} is outside the vocabulary (0..{vocab - 1}) of model "
                    f"{self.info.name} - at `{sampling.field_prefix}.stop_token_ids[{i}]`",
                )
