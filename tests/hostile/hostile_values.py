"""Hypothesis strategies for hostile input: broken encodings, wrong types, extreme numbers, odd text.

Shared by the fuzz tests and sized by ``MQINFER_FUZZ_EXAMPLES`` (examples per property in a normal
run) and ``MQINFER_FUZZ_EXAMPLES_LONG`` (per property in the ``-m slow`` run).
"""

from __future__ import annotations

import json
import math
import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqinfer.schemas.errors import ALL_CODES, RequestError
from mqinfer.schemas.request import (
    INT32_MAX,
    MAX_SLO_MS,
    REPLY_PREFIX,
    Request,
    decode_request,
    encode_request,
    usable_id,
)

EXAMPLES = int(os.environ.get("MQINFER_FUZZ_EXAMPLES", "150"))
LONG_EXAMPLES = int(os.environ.get("MQINFER_FUZZ_EXAMPLES_LONG", "5000"))

FIELD_NAMES = [
    "id", "prompt", "prompt_token_ids", "messages", "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "tenant", "model", "request_type", "priority",
    "deadline", "reply_to", "job_id", "metadata", "api", "custom_id", "method", "url", "body",
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "slo_ttft_ms", "slo_tpot_ms",
]

ids = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["../../etc/passwd", "a/b", "C:\\x", "x\x00y", "line\nbreak", "\x1b[2J", "\u202eevil", ""]),
    st.text(min_size=120, max_size=140),
)
numbers = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(st.text(max_size=20), st.sampled_from(["mqinfer:reply:x", "mqinfer:{requests}", "\ud800", "\x00"]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts, st.binary(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
token_lists = st.one_of(
    st.lists(st.integers(min_value=-5, max_value=300), min_size=0, max_size=8),
    st.lists(numbers, max_size=4),
    st.builds(lambda n: [65] * n, st.integers(min_value=0, max_value=5000)),
)


@st.composite
def request_objects(draw) -> dict:
    """Objects shaped roughly like requests: real field names with hostile values."""
    obj = {}
    if draw(st.booleans()):
        obj["id"] = draw(st.one_of(ids, scalars))
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES[1:]), max_size=6, unique=True)):
        if name in ("prompt_token_ids", "stop_token_ids"):
            obj[name] = draw(st.one_of(token_lists, values))
        elif name in ("reply_to", "job_id", "tenant", "model", "prompt"):
            obj[name] = draw(st.one_of(ids, texts, scalars))
        else:
            obj[name] = draw(values)
    if draw(st.booleans()):
        obj[draw(st.text(max_size=8))] = draw(scalars)
    return obj


def json_bytes(obj) -> bytes | None:
    try:
        return json.dumps(obj, allow_nan=True, default=lambda b: b.decode("latin-1")).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        return None


def msgpack_bytes(obj) -> bytes | None:
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return None


@st.composite
def payloads(draw) -> tuple[str, bytes]:
    """(field name, bytes): an encoded hostile object, maybe damaged, or plain noise."""
    fmt = draw(st.sampled_from(["r", "json"]))
    kind = draw(st.sampled_from(["object", "object", "truncated", "flipped", "noise"]))
    if kind == "noise":
        return fmt, draw(st.binary(max_size=64))
    obj = draw(request_objects())
    data = (msgpack_bytes if fmt == "r" else json_bytes)(obj)
    if data is None:
        data = draw(st.binary(max_size=16))
    if kind == "truncated" and data:
        data = data[: draw(st.integers(min_value=0, max_value=len(data) - 1))]
    elif kind == "flipped" and data:
        i = draw(st.integers(min_value=0, max_value=len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(min_value=1, max_value=255))]) + data[i + 1:]
    return fmt, data


@st.composite
def entry_fields(draw) -> dict:
    """The field map of a stream entry: usually one payload, sometimes none, two, or odd extras."""
    fields: dict = {}
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        name, data = draw(payloads())
        fields[name] = data if draw(st.integers(0, 9)) else data.decode("utf-8", "surrogateescape")
    if draw(st.booleans()):
        fields["v"] = draw(st.sampled_from([b"1", "1", b"2", b"", b" 1 ", b"\xff"]))
    if draw(st.integers(0, 4)) == 0:
        fields[draw(st.one_of(st.text(max_size=6), st.binary(max_size=6)))] = draw(st.binary(max_size=8))
    return fields


def check_request(req: Request) -> None:
    """What every accepted request guarantees, however hostile its source."""
    assert usable_id(req.id) == req.id
    assert req.job_id is None or usable_id(req.job_id) == req.job_id
    assert req.reply_to is None or (req.reply_to.startswith(REPLY_PREFIX) and len(req.reply_to) > len(REPLY_PREFIX))
    assert sum(x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)) == 1
    for t in (req.prompt_token_ids or []) + list(req.stop_token_ids):
        assert isinstance(t, int) and 0 <= t <= INT32_MAX
    assert 1 <= req.max_tokens <= INT32_MAX and 0 <= req.min_tokens <= req.max_tokens
    assert math.isfinite(req.temperature) and req.temperature >= 0
    assert 0 < req.top_p <= 1
    assert req.deadline is None or math.isfinite(req.deadline)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in req.metadata.items())
    assert 1 <= req.n <= 128
    assert all(math.isfinite(v) and -2 <= v <= 2 for v in (req.presence_penalty, req.frequency_penalty))
    assert math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0
    assert len(req.logit_bias) <= 300
    for target in (req.slo_ttft_ms, req.slo_tpot_ms):
        assert target is None or (type(target) is int and 1 <= target <= MAX_SLO_MS)
    assert all(isinstance(t, int) and 0 <= t <= INT32_MAX and -100 <= b <= 100 for t, b in req.logit_bias.items())
    for fmt in ("json", "msgpack"):
        assert decode_request(encode_request(req, fmt), fmt=fmt) == req


def check_error(exc: RequestError) -> None:
    assert exc.code in ALL_CODES, exc.code
    assert isinstance(exc.message, str) and exc.message
    assert exc.request_id is None or usable_id(exc.request_id) == exc.request_id or exc.request_id.startswith("line:")


def fuzz(strategy, check, examples: int) -> None:
    """Run ``check`` on ``examples`` values drawn from ``strategy`` (no deadline: a loaded CI box)."""

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(strategy)
    def run(value) -> None:
        check(value)

    run()
