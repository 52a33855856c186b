"""Decoding and encoding the request wire type, and mapping it onto the engine's sampling parameters.

The struct and its constraints live in :mod:`mqinfer.schemas.request_struct`; every name of it is
re-exported here, so ``mqinfer.schemas.request.Request`` is the one producers and workers import.
Owns the JSON and msgpack codecs (one cached encoder/decoder per format), the routing of OpenAI Batch
lines to :mod:`mqinfer.schemas.openai_batch`, and the mapping onto the engine's sampling parameters.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.openai_batch import request_from_openai
from mqinfer.schemas.request_struct import (  # noqa: F401  (re-exported: the request's public names)
    Bias, CacheSalt, ChatMessage, INT32_MAX, INT64_MAX, INT64_MIN, Label, LogitBias, Logprobs, MAX_CHOICES,
    MAX_ID_LENGTH, MAX_LOGIT_BIAS, MAX_METADATA_KEYS, MAX_METADATA_KEY_LENGTH, MAX_METADATA_VALUE_LENGTH,
    MAX_REPETITION_PENALTY, MAX_SLO_MS, MAX_STOP_STRINGS, MIN_REPETITION_PENALTY, Metadata, MetadataKey,
    MetadataValue, NumChoices, Penalty, PositiveTokenCount, Priority, REPLY_PREFIX, RepetitionPenalty, ReplyTo,
    Request, RequestId, Role, Seed, SloMs, StopString, StopStrings, Temperature, TokenCount, TokenId, TokenIds,
    TopP, usable_id,
)
from mqinfer.schemas.response_format import grammar_spec


class _IdProbe(msgspec.Struct):
    """Reads only ``id`` / ``custom_id`` of an object, skipping everything else cheaply."""

    id: Any = None
    custom_id: Any = None


_DECODERS = {
    "json": msgspec.json.Decoder(Request),
    "msgpack": msgspec.msgpack.Decoder(Request),
}
# float_hook: a number too large for a float (1e999) is valid JSON; it must reach validation as
# inf and be rejected there, with its path, instead of failing the whole parse.
_ANY_DECODERS = {"json": msgspec.json.Decoder(float_hook=float), "msgpack": msgspec.msgpack.Decoder()}
_PROBE_DECODERS = {"json": msgspec.json.Decoder(_IdProbe), "msgpack": msgspec.msgpack.Decoder(_IdProbe)}
_ENCODERS = {"json": msgspec.json.Encoder(), "msgpack": msgspec.msgpack.Encoder()}


def recover_id_from_obj(obj: object) -> str | None:
    """The request id of an already-parsed object, if one is usable (``id``, else ``custom_id``)."""
    if not isinstance(obj, dict):
        return None
    return usable_id(obj.get("id")) or usable_id(obj.get("custom_id"))


def recover_id(data: bytes | str, fmt: str = "json") -> str | None:
    """The request id in raw encoded data, if the data parses and holds a usable one."""
    try:
        probe = _PROBE_DECODERS[fmt].decode(data)
    except Exception:  # any failure means "no id": this is a best-effort look
        return None
    return usable_id(probe.id) or usable_id(probe.custom_id)


def _check_fmt(fmt: str) -> None:
    if fmt not in _DECODERS:
        raise ValueError(f"unknown request format {fmt!r}; expected 'json' or 'msgpack'")


def _malformed(fmt: str, exc: Exception) -> str:
    what = "JSON" if fmt == "json" else "msgpack"
    if isinstance(exc, RecursionError):
        return f"invalid {what}: nested too deeply"
    return f"invalid {what}: {exc}"


def decode_request(data: bytes | str, *, fmt: Literal["json", "msgpack"] = "json") -> Request:
    """Decode and validate one request; OpenAI Batch lines (with ``custom_id``) are mapped.

    Raises RequestError: ``invalid_json`` when the data does not parse, ``invalid_request`` when
    it violates the schema (the message names the path), or what the OpenAI mapping raises.
    """
    _check_fmt(fmt)
    if fmt == "msgpack" and isinstance(data, str):
        raise RequestError(errors.INVALID_JSON, "msgpack request data must be bytes, got text")
    try:
        return _DECODERS[fmt].decode(data)
    except msgspec.ValidationError as exc:
        typed_error = exc
    except (msgspec.DecodeError, UnicodeError, RecursionError) as exc:
        raise RequestError(errors.INVALID_JSON, _malformed(fmt, exc)) from None
    # Not a valid native request: an OpenAI Batch line, or a bad one. The typed decoder stops at
    # the first violation, so the rest of the data may still turn out to be malformed.
    try:
        obj = _ANY_DECODERS[fmt].decode(data)
    except (msgspec.DecodeError, UnicodeError, RecursionError) as exc:
        raise RequestError(errors.INVALID_JSON, _malformed(fmt, exc)) from None
    if isinstance(obj, dict) and "custom_id" in obj:
        return request_from_openai(obj)
    raise RequestError(errors.INVALID_REQUEST, str(typed_error), recover_id_from_obj(obj)) from None


def request_from_obj(obj: Any) -> Request:
    """Validate an already-parsed object (a dict from a Parquet row, a client call) as a Request."""
    if isinstance(obj, Request):
        return obj
    if isinstance(obj, dict) and "custom_id" in obj:
        return request_from_openai(obj)
    try:
        return msgspec.convert(obj, Request, str_keys=True)
    except msgspec.ValidationError as exc:
        raise RequestError(errors.INVALID_REQUEST, str(exc), recover_id_from_obj(obj)) from None
    except RecursionError:
        raise RequestError(errors.INVALID_REQUEST, "request nested too deeply", recover_id_from_obj(obj)) from None


def encode_request(req: Request, fmt: Literal["json", "msgpack"] = "msgpack") -> bytes:
    """Encode a request (defaults omitted) for a stream entry or a file."""
    _check_fmt(fmt)
    return _ENCODERS[fmt].encode(req)


def to_sampling_kwargs(req: Request) -> dict[str, Any]:
    """Keyword arguments for ``mqinfer.scheduler.request.SamplingParams`` built from ``req``."""
    stop = req.stop if isinstance(req.stop, list) else [req.stop]
    # Where the sampling fields sat in what the producer sent, for errors the engine finds.
    prefix = "$.body" if req.api else "$"
    return {
        "max_tokens": req.max_tokens,
        "min_tokens": req.min_tokens,
        "temperature": float(req.temperature),
        "top_p": float(req.top_p),
        "top_k": req.top_k,
        "seed": req.seed,
        "stop": tuple(stop),
        "stop_token_ids": tuple(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
        "logprobs": req.logprobs,
        "grammar": grammar_spec(req.response_format, f"{prefix}.response_format"),
        "n": req.n,
        "presence_penalty": float(req.presence_penalty),
        "frequency_penalty": float(req.frequency_penalty),
        "repetition_penalty": float(req.repetition_penalty),
        "logit_bias": tuple(sorted((int(t), float(b)) for t, b in req.logit_bias.items())),
        "field_prefix": prefix,
    }
