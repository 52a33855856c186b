"""The OpenAI Batch API input format, mapped onto our Request.

A line is ``{"custom_id", "method": "POST", "url", "body"}``; ``custom_id`` becomes ``id``.
``/v1/completions`` bodies carry a ``prompt`` (text or token ids); ``/v1/chat/completions``
bodies carry ``messages``, which stay messages: the worker renders them with the model's chat
template. ``Request.api`` records the endpoint (``"completions"`` or ``"chat"``) so that output can
be written back in the OpenAI format.

What we cannot honour is refused, never silently dropped: a parameter we do not implement
(``best_of`` other than 1, ``tools``, ``stream``, ...) is an ``unsupported_parameter`` error naming
it; a value of the wrong type or out of OpenAI's range is ``invalid_request``. ``n`` (1..128),
``presence_penalty`` and ``frequency_penalty`` (-2..2), ``logit_bias`` (at most 300 token ids, each
biased by -100..100) are OpenAI's, on both endpoints; ``repetition_penalty`` (> 0) and the
latency targets ``slo_ttft_ms`` and ``slo_tpot_ms`` (positive integers) are extensions. ``response_format`` (``text``, ``json_object``, ``json_schema``) is honoured on both
endpoints; the ``regex`` and ``grammar`` types are extensions of native requests and are
``unsupported_parameter`` here.
A ``null`` parameter counts as absent, as in the OpenAI API. Where OpenAI and we differ in a
default we keep ours: ``max_tokens`` is 16 unless the body says otherwise, for chat too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import msgspec

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request_struct import Request, usable_id
from mqinfer.schemas.response_format import OPENAI_TYPES

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_TOP_LEVEL_KEYS = ("custom_id", "method", "url", "body")

# Body parameters copied as they are into the Request field of the same (or the given) name;
# msgspec validates them there and the error path is rewritten to point into the body.
_COMMON_PASSTHROUGH = {
    "model": "model",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    # Our extensions, accepted in the body of both endpoints.
    "top_k": "top_k",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "speculative": "speculative",
    "cache_salt": "cache_salt",
    "stop_token_ids": "stop_token_ids",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "repetition_penalty": "repetition_penalty",
    "slo_ttft_ms": "slo_ttft_ms",
    "slo_tpot_ms": "slo_tpot_ms",
}
# Parameters accepted only at one value (what we do anyway): name -> (allowed value, type).
_FIXED = {
    "best_of": (1, int),
    "echo": (False, bool),
    "stream": (False, bool),
}
# Why a fixed parameter is refused, where the bare "not supported" would leave the user guessing.
_FIXED_WHY = {
    "best_of": "; generating best_of candidates server-side and returning the most likely is not"
               " implemented: ask for n choices (one row each, with their logprobs) and choose among them",
}
_IGNORED = frozenset({"user"})
# response_format types of native requests only.
_NATIVE_ONLY_FORMATS = ("regex", "grammar")
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_UNSUPPORTED_ROLES = frozenset({"tool", "function"})
_PATH_IN_MESSAGE = re.compile(r"`\$\.([A-Za-z_]+)")


def _show(value: Any) -> str:
    """A short JSON rendering of a value for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _wrong_type(expected: str, value: Any, path: str, rid: str | None) -> RequestError:
    """msgspec's wording, so that every type error reads the same."""
    return RequestError(errors.INVALID_REQUEST, f"Expected `{expected}`, got `{_type_name(value)}` - at `{path}`", rid)


def request_from_openai(obj: dict[str, Any]) -> Request:
    """Map one parsed OpenAI Batch line onto a Request; raises RequestError naming the field."""
    rid = usable_id(obj.get("custom_id"))
    for key in obj:
        if key not in _TOP_LEVEL_KEYS:
            raise RequestError(errors.INVALID_REQUEST, f"Object contains unknown field `{key}` - at `$`", rid)
    if rid is None:
        raise RequestError(
            errors.INVALID_REQUEST,
            "custom_id must be a string of 1 to 128 characters without control characters"
            f", got {_show(obj.get('custom_id'))} - at `$.custom_id`",
            None,
        )
    for key in ("method", "url", "body"):
        if key not in obj:
            raise RequestError(errors.INVALID_REQUEST, f"Object missing required field `{key}` - at `$`", rid)
    method, url, body = obj["method"], obj["url"], obj["body"]
    if not isinstance(method, str):
        raise _wrong_type("str", method, "$.method", rid)
    if method.upper() != "POST":
        raise RequestError(
            errors.UNSUPPORTED_PARAMETER, f"method = {_show(method)} is not supported (only POST) - at `$.method`", rid
        )
    if not isinstance(url, str):
        raise _wrong_type("str", url, "$.url", rid)
    api = ENDPOINTS.get(url)
    if api is None:
        raise RequestError(
            errors.UNSUPPORTED_PARAMETER,
            f"url = {_show(url)} is not supported (only {' and '.join(ENDPOINTS)}) - at `$.url`",
            rid,
        )
    if not isinstance(body, dict):
        raise _wrong_type("object", body, "$.body", rid)

    fields: dict[str, Any] = {"id": rid, "api": api}
    # Request field -> body parameter it came from, to point error paths at the body.
    origin: dict[str, str] = {}
    handlers = _COMPLETIONS_HANDLERS if api == "completions" else _CHAT_HANDLERS
    present = {key: value for key, value in body.items() if value is not None}
    for key, value in present.items():
        if key in _COMMON_PASSTHROUGH:
            fields[_COMMON_PASSTHROUGH[key]] = value
            origin[_COMMON_PASSTHROUGH[key]] = key
        elif key in _FIXED:
            _check_fixed(key, value, rid)
        elif key in _IGNORED:
            continue
        elif key in handlers:
            handlers[key](value, present, fields, origin, rid)
        else:
            raise RequestError(
                errors.UNSUPPORTED_PARAMETER,
                f"body.{key} is not supported for {url} - at `$.body.{key}`",
                rid,
            )
    if api == "completions" and "prompt" not in present:
        raise RequestError(errors.INVALID_REQUEST, "Object missing required field `prompt` - at `$.body`", rid)
    if api == "chat" and "messages" not in present:
        raise RequestError(errors.INVALID_REQUEST, "Object missing required field `messages` - at `$.body`", rid)
    if api == "chat" and "top_logprobs" in present and present.get("logprobs") is not True:
        raise RequestError(
            errors.INVALID_REQUEST, "body.top_logprobs requires body.logprobs = true - at `$.body.top_logprobs`", rid
        )

    try:
        return msgspec.convert(fields, Request, str_keys=True)
    except msgspec.ValidationError as exc:
        message = _PATH_IN_MESSAGE.sub(lambda m: _body_path(m.group(1), origin), str(exc))
        raise RequestError(errors.INVALID_REQUEST, message, rid) from None


def _response_format(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    """OpenAI's types pass on to the Request's own validation (whose error paths are rewritten to
    point into the body); the native extensions are refused here."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in _NATIVE_ONLY_FORMATS:
        raise RequestError(
            errors.UNSUPPORTED_PARAMETER,
            f"body.response_format.type = {_show(kind)} is not supported in OpenAI Batch lines (only"
            f" {', '.join(OPENAI_TYPES)}; {kind} is an extension of native requests) - at `$.body.response_format.type`",
            rid,
        )
    fields["response_format"] = value
    origin["response_format"] = "response_format"


def _body_path(field: str, origin: dict[str, str]) -> str:
    if field == "id":
        return "`$.custom_id"
    return f"`$.body.{origin.get(field, field)}"


def _check_fixed(key: str, value: Any, rid: str) -> None:
    allowed, kind = _FIXED[key]
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        expected = "bool" if kind is bool else ("int" if kind is int else "number")
        raise _wrong_type(expected, value, f"$.body.{key}", rid)
    if value != allowed:
        raise RequestError(
            errors.UNSUPPORTED_PARAMETER,
            f"body.{key} = {_show(value)} is not supported (only {_show(allowed)}){_FIXED_WHY.get(key, '')}"
            f" - at `$.body.{key}`",
            rid,
        )


# -- /v1/completions -------------------------------------------------------------------------


def _is_token_ids(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completions_prompt(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    if isinstance(value, str):
        fields["prompt"] = value
    elif _is_token_ids(value):
        fields["prompt_token_ids"] = value
    elif isinstance(value, list) and value and all(isinstance(p, str) or _is_token_ids(p) for p in value):
        if len(value) > 1:
            raise RequestError(
                errors.UNSUPPORTED_PARAMETER,
                f"body.prompt with {len(value)} prompts is not supported (one prompt per line) - at `$.body.prompt`",
                rid,
            )
        return _completions_prompt(value[0], body, fields, origin, rid)
    else:
        raise RequestError(
            errors.INVALID_REQUEST,
            f"Expected a `str` or a non-empty `array` of token ids, got {_show(value)} - at `$.body.prompt`",
            rid,
        )
    origin["prompt"] = origin["prompt_token_ids"] = "prompt"


def _completions_logprobs(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    fields["logprobs"] = value  # an int (how many alternatives); validated by the Request schema
    origin["logprobs"] = "logprobs"


def _max_tokens(key: str) -> Callable[..., None]:
    def handle(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
        other = "max_completion_tokens" if key == "max_tokens" else "max_tokens"
        if other in body and body[other] != value:
            raise RequestError(
                errors.INVALID_REQUEST,
                f"body.max_tokens ({_show(body['max_tokens'])}) and body.max_completion_tokens"
                f" ({_show(body['max_completion_tokens'])}) disagree - at `$.body.{key}`",
                rid,
            )
        fields["max_tokens"] = value
        origin["max_tokens"] = key

    return handle


_COMPLETIONS_HANDLERS: dict[str, Callable[..., None]] = {
    "prompt": _completions_prompt,
    "max_tokens": _max_tokens("max_tokens"),
    "logprobs": _completions_logprobs,
    "response_format": _response_format,
}


# -- /v1/chat/completions --------------------------------------------------------------------


def _message_content(content: Any, where: str, rid: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise _wrong_type("object", part, f"$.{at}", rid)
            kind = part.get("type")
            if kind != "text":
                if isinstance(kind, str):
                    raise RequestError(
                        errors.UNSUPPORTED_PARAMETER,
                        f"{at}.type = {_show(kind)} is not supported (only text parts) - at `$.{at}.type`",
                        rid,
                    )
                raise RequestError(errors.INVALID_REQUEST, f"a content part needs `type` - at `$.{at}`", rid)
            text = part.get("text")
            if not isinstance(text, str):
                raise _wrong_type("str", text, f"$.{at}.text", rid)
            for extra in part:
                if extra not in ("type", "text"):
                    raise RequestError(
                        errors.UNSUPPORTED_PARAMETER, f"{at}.{extra} is not supported - at `$.{at}.{extra}`", rid
                    )
            texts.append(text)
        # Separate parts the way a reader would see them; OpenAI does not define a separator.
        return "\n".join(texts)
    raise RequestError(
        errors.INVALID_REQUEST,
        f"Expected a `str` or an `array` of text parts, got `{_type_name(content)}` - at `$.{where}`",
        rid,
    )


def _chat_messages(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    if not isinstance(value, list) or not value:
        raise RequestError(
            errors.INVALID_REQUEST,
            f"Expected a non-empty `array` of messages, got {_show(value)} - at `$.body.messages`",
            rid,
        )
    messages = []
    for i, message in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(message, dict):
            raise _wrong_type("object", message, f"$.{where}", rid)
        for key, item in message.items():
            if key not in ("role", "content") and item is not None:
                raise RequestError(
                    errors.UNSUPPORTED_PARAMETER, f"{where}.{key} is not supported - at `$.{where}.{key}`", rid
                )
        role = message.get("role")
        if not isinstance(role, str):
            raise _wrong_type("str", role, f"$.{where}.role", rid)
        if role in _UNSUPPORTED_ROLES:
            raise RequestError(
                errors.UNSUPPORTED_PARAMETER,
                f"{where}.role = {_show(role)} is not supported (no tool calling) - at `$.{where}.role`",
                rid,
            )
        if role not in _CHAT_ROLES:
            raise RequestError(
                errors.INVALID_REQUEST,
                f"{where}.role = {_show(role)} is not a chat role (system, developer, user, assistant)"
                f" - at `$.{where}.role`",
                rid,
            )
        content = _message_content(message.get("content"), f"{where}.content", rid)
        messages.append({"role": _CHAT_ROLES[role], "content": content})
    fields["messages"] = messages
    origin["messages"] = "messages"


def _chat_logprobs(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    if not isinstance(value, bool):
        raise _wrong_type("bool", value, "$.body.logprobs", rid)
    if value:
        top = body.get("top_logprobs", 0)
        fields["logprobs"] = top
        origin["logprobs"] = "top_logprobs" if "top_logprobs" in body else "logprobs"


def _chat_top_logprobs(value: Any, body: dict, fields: dict, origin: dict, rid: str) -> None:
    # Consumed by _chat_logprobs; its pairing with logprobs is checked after the loop.
    return None


_CHAT_HANDLERS: dict[str, Callable[..., None]] = {
    "messages": _chat_messages,
    "max_tokens": _max_tokens("max_tokens"),
    "max_completion_tokens": _max_tokens("max_completion_tokens"),
    "logprobs": _chat_logprobs,
    "top_logprobs": _chat_top_logprobs,
    "response_format": _response_format,
}
