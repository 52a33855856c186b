"""Stream entries: layout, versions, limits, and a fuzz proving only RequestError escapes."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request, decode_request
from mqinfer.schemas.stream import MAX_ENTRY_BYTES, decode_entry, encode_entry

REQ = decode_request(json.dumps({"id": "e-1", "prompt": "hi", "max_tokens": 4, "metadata": {"a": "b"}}))


def as_redis(fields: dict) -> dict[bytes, bytes]:
    """What redis-py hands back from XREADGROUP: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def reject(fields, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        decode_entry(fields, **kw)
    return info.value


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_entry_round_trip(fmt):
    fields = encode_entry(REQ, fmt)
    assert set(fields) == ({"r", "v"} if fmt == "msgpack" else {"json", "v"})
    assert fields["v"] == b"1"
    assert decode_entry(fields) == REQ
    assert decode_entry(as_redis(fields)) == REQ


def test_json_entry_as_text_and_without_version():
    # What a person types into redis-cli: a JSON text field and no version.
    assert decode_entry({"json": '{"id": "e-1", "prompt": "hi", "max_tokens": 4, "metadata": {"a": "b"}}'}) == REQ
    assert decode_entry({b"json": encode_entry(REQ, "json")["json"], b"trace": b"xyz"}) == REQ


def test_unsupported_version_keeps_the_id():
    fields = as_redis({**encode_entry(REQ), "v": b"2"})
    err = reject(fields)
    assert err.code == errors.UNSUPPORTED_VERSION and "'2'" in err.message and err.request_id == "e-1"


def test_missing_or_doubled_payload():
    err = reject({b"v": b"1"})
    assert err.code == errors.INVALID_REQUEST and "neither" in err.message and err.request_id is None
    both = {**encode_entry(REQ, "msgpack"), **encode_entry(REQ, "json")}
    err = reject(both)
    assert err.code == errors.INVALID_REQUEST and "both" in err.message and err.request_id == "e-1"
    err = reject({b"r": encode_entry(REQ)["r"], "r": encode_entry(REQ)["r"]})
    assert err.code == errors.INVALID_REQUEST and "twice" in err.message


def test_entry_size_limit():
    big = msgspec.structs.replace(REQ, prompt="x" * (MAX_ENTRY_BYTES + 1))
    err = reject(encode_entry(big))
    assert err.code == errors.INVALID_REQUEST and "over the limit" in err.message and err.request_id == "e-1"
    err = reject(encode_entry(REQ, "json"), max_entry_bytes=20)
    assert err.code == errors.INVALID_REQUEST and "20 bytes" in err.message
    assert decode_entry(encode_entry(big), max_entry_bytes=2 * MAX_ENTRY_BYTES).prompt == big.prompt


def test_undecodable_payloads():
    assert reject({b"r": b"\xc1\xc1", b"v": b"1"}).code == errors.INVALID_JSON
    assert reject({b"json": b"{not json", b"v": b"1"}).code == errors.INVALID_JSON
    err = reject({b"json": b'{"id": "e-2", "prompt": "x", "top_p": 0}'})
    assert err.code == errors.INVALID_REQUEST and "$.top_p" in err.message and err.request_id == "e-2"
    err = reject({"r": msgspec.msgpack.encode({"id": "e-3", "prompt": "x", "n": 0})})
    assert err.code == errors.INVALID_REQUEST and err.request_id == "e-3"
    assert reject({"json": "\ud800"}).code == errors.INVALID_JSON  # lone surrogate in text
    assert reject([("r", b"")]).code == errors.INVALID_REQUEST  # not a mapping
    assert reject({b"r": 5}).code == errors.INVALID_REQUEST
    assert reject({5: b"x"}).code == errors.INVALID_REQUEST


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=10),
                    st.binary(max_size=10))
_json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=12)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_request_like = st.fixed_dictionaries(
    {}, optional={
        "id": st.one_of(st.text(max_size=4), _scalar), "prompt": _json_like, "prompt_token_ids": _json_like,
        "max_tokens": _json_like, "temperature": _json_like, "stop": _json_like, "custom_id": _json_like,
        "body": _json_like, "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "x"]),
        "method": st.sampled_from(["POST", "GET"]), "metadata": _json_like,
    },
)


_entry_values = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=32),
    _request_like.map(lambda o: msgspec.msgpack.encode(o)),
    _request_like.map(lambda o: msgspec.json.encode(o)),
    st.integers(),
    st.none(),
)
_entry_keys = st.one_of(
    st.sampled_from(["r", "json", "v", b"r", b"json", b"v"]), st.text(max_size=4), st.binary(max_size=4)
)


def _check(fields) -> None:
    try:
        out = decode_entry(fields)
    except RequestError as exc:
        assert exc.code in errors.ALL_CODES and exc.message
        assert exc.request_id is None or isinstance(exc.request_id, str)
    else:
        assert isinstance(out, Request)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_entry_keys, _entry_values, max_size=4))
def test_fuzz_random_field_maps_raise_only_request_error(fields):
    _check(fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["r", "json"]), st.binary(max_size=256), st.sampled_from([None, b"1", b"2", "1"]))
def test_fuzz_random_payload_bytes_raise_only_request_error(field, payload, version):
    fields = {field: payload}
    if version is not None:
        fields["v"] = version
    _check(fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_request_like, st.sampled_from(["r", "json"]))
def test_fuzz_structured_payloads_raise_only_request_error(obj, field):
    raw = msgspec.msgpack.encode(obj) if field == "r" else msgspec.json.encode(obj)
    _check({field: raw, "v": "1"})
