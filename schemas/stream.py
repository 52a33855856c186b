"""The request stream entry: how one Request is laid out in the fields of a Redis stream entry.

Field ``r`` holds the request as msgpack, or field ``json`` holds it as JSON text (handy from
``redis-cli``); field ``v`` is the schema version, ``1``. An entry without ``v`` is read as
version 1. Other fields are ignored, so that producers may add tracing fields without breaking
workers. :func:`decode_entry` turns any input at all into either a Request or a RequestError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request, decode_request, encode_request, recover_id

SCHEMA_VERSION = "1"
MAX_ENTRY_BYTES = 1 << 20

_FIELD_FOR_FORMAT = {"msgpack": "r", "json": "json"}
_VERSION_BYTES = SCHEMA_VERSION.encode()


def encode_entry(req: Request, fmt: Literal["msgpack", "json"] = "msgpack") -> dict[str, bytes]:
    """The fields of a stream entry holding ``req`` (pass them to ``XADD``)."""
    field = _FIELD_FOR_FORMAT.get(fmt)
    if field is None:
        raise ValueError(f"unknown stream entry format {fmt!r}; expected 'msgpack' or 'json'")
    return {field: encode_request(req, fmt), "v": _VERSION_BYTES}


def _as_text(value: bytes | str) -> str:
    if isinstance(value, str):
        return value
    return bytes(value).decode("utf-8", "replace")


def _as_bytes(value: bytes | str) -> bytes:
    if isinstance(value, str):
        # Lone surrogates cannot be UTF-8; keep them so that the decoder reports invalid text.
        return value.encode("utf-8", "surrogatepass")
    return bytes(value)


def decode_entry(fields: Mapping[bytes | str, bytes | str], *, max_entry_bytes: int = MAX_ENTRY_BYTES) -> Request:
    """Decode and validate the request in a stream entry's fields.

    Raises only RequestError: ``unsupported_version`` for a version other than 1,
    ``invalid_request`` for a missing or doubled payload field or an entry over
    ``max_entry_bytes``, and whatever :func:`decode_request` raises for the payload. The error
    carries the request id whenever the payload holds a usable one.
    """
    if not isinstance(fields, Mapping):
        raise RequestError(errors.INVALID_REQUEST, f"a stream entry must be a field map, got {type(fields).__name__}")
    named: dict[str, bytes | str] = {}
    size = 0
    try:
        items = list(fields.items())
    except Exception as exc:  # a broken Mapping implementation: still only a RequestError
        raise RequestError(errors.INVALID_REQUEST, f"cannot read the stream entry's fields: {exc}") from None
    for key, value in items:
        if not isinstance(key, (bytes, bytearray, memoryview, str)):
            raise RequestError(errors.INVALID_REQUEST, f"stream entry field names must be text, got {key!r}")
        if not isinstance(value, (bytes, bytearray, memoryview, str)):
            raise RequestError(
                errors.INVALID_REQUEST,
                f"stream entry field `{_as_text(key)}` must be bytes or text, got {type(value).__name__}",
            )
        name = _as_text(key)
        if name in named:
            raise RequestError(errors.INVALID_REQUEST, f"stream entry field `{name}` is given twice")
        named[name] = value
        size += len(key) + len(value)

    payload_fields = [name for name in ("r", "json") if name in named]
    version = named.get("v")
    if version is not None and _as_text(version).strip() != SCHEMA_VERSION:
        raise RequestError(
            errors.UNSUPPORTED_VERSION,
            f"stream entry schema version {_as_text(version)[:32]!r} is not supported (this worker reads "
            f"version {SCHEMA_VERSION}) - at `v`",
            _recover(named, payload_fields),
        )
    if not payload_fields:
        raise RequestError(
            errors.INVALID_REQUEST, "stream entry has neither an `r` (msgpack) nor a `json` field", None
        )
    if len(payload_fields) == 2:
        raise RequestError(
            errors.INVALID_REQUEST, "stream entry has both `r` and `json` fields; exactly one is allowed",
            _recover(named, payload_fields),
        )
    if size > max_entry_bytes:
        raise RequestError(
            errors.INVALID_REQUEST,
            f"stream entry is {size} bytes, over the limit of {max_entry_bytes} bytes",
            _recover(named, payload_fields),
        )
    name = payload_fields[0]
    fmt = "msgpack" if name == "r" else "json"
    return decode_request(_as_bytes(named[name]), fmt=fmt)


def _recover(named: dict[str, Any], payload_fields: list[str]) -> str | None:
    """Best effort: the request id of the first payload field that holds a usable one."""
    for name in payload_fields:
        request_id = recover_id(_as_bytes(named[name]), "msgpack" if name == "r" else "json")
        if request_id is not None:
            return request_id
    return None
