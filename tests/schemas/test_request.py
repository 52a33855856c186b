"""The Request wire type: round trips, every kind of bad input, sampling parameters."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import (
    ChatMessage,
    Request,
    decode_request,
    encode_request,
    request_from_obj,
    to_sampling_kwargs,
)

FULL = {
    "id": "req-1",
    "prompt": "Hello",
    "max_tokens": 32,
    "min_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
    "seed": -7,
    "stop": ["\n\n", "END"],
    "stop_token_ids": [2, 3],
    "ignore_eos": True,
    "logprobs": 5,
    "tenant": "acme",
    "cache_salt": "team-red",
    "model": "tiny",
    "request_type": "summarize",
    "priority": -3,
    "deadline": 1_700_000_000.25,
    "reply_to": "mqinfer:reply:abc",
    "job_id": "job-9",
    "metadata": {"source": "unit", "k": ""},
}


def reject(obj_or_raw, fmt="json") -> RequestError:
    raw = obj_or_raw if isinstance(obj_or_raw, (bytes, str)) else json.dumps(obj_or_raw)
    with pytest.raises(RequestError) as info:
        decode_request(raw, fmt=fmt)
    return info.value


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_full_request_round_trips(fmt):
    req = decode_request(json.dumps(FULL))
    assert req.stop == ["\n\n", "END"] and req.metadata == {"source": "unit", "k": ""}
    again = decode_request(encode_request(req, fmt), fmt=fmt)
    assert again == req
    assert msgspec.to_builtins(again) == FULL


def test_defaults_and_omitted_on_encode():
    req = decode_request(b'{"id": "a", "prompt": "x"}')
    assert (req.max_tokens, req.min_tokens, req.temperature, req.top_p, req.top_k) == (16, 0, 1.0, 1.0, 0)
    assert (req.seed, req.stop, req.stop_token_ids, req.ignore_eos, req.logprobs) == (None, [], [], False, None)
    assert (req.tenant, req.model, req.request_type, req.priority) == ("default", None, "default", 0)
    assert (req.deadline, req.reply_to, req.job_id, req.metadata, req.api) == (None, None, None, {}, None)
    assert json.loads(encode_request(req, "json")) == {"id": "a", "prompt": "x"}


def test_single_stop_string_becomes_a_list():
    req = decode_request(b'{"id": "a", "prompt": "x", "stop": "###"}')
    assert req.stop == ["###"]
    assert Request(id="b", prompt="y", stop="z").stop == ["z"]


def test_token_and_chat_prompts():
    req = decode_request(b'{"id": "a", "prompt_token_ids": [0, 5, 2147483647]}')
    assert req.prompt_token_ids == [0, 5, 2**31 - 1] and req.prompt is None
    chat = decode_request(b'{"id": "c", "messages": [{"role": "user", "content": "hi"}]}')
    assert chat.messages == [ChatMessage(role="user", content="hi")]


BAD = [
    # (input, code, text the message must contain)
    ('{"id": "a", "prompt": "x",', errors.INVALID_JSON, "invalid JSON"),
    ('{"id": "a", "prompt": NaN}', errors.INVALID_JSON, "invalid JSON"),
    ({"id": "a", "prompt": "x", "foo": 1}, errors.INVALID_REQUEST, "unknown field `foo`"),
    ({"id": "a", "prompt": "x", "prompt_token_ids": [1]}, errors.INVALID_REQUEST, "got prompt and prompt_token_ids"),
    ({"id": "a"}, errors.INVALID_REQUEST, "exactly one of `prompt`"),
    ({"id": "a", "prompt": "x", "max_tokens": 0}, errors.INVALID_REQUEST, "$.max_tokens"),
    ({"id": "a", "prompt": "x", "max_tokens": "16"}, errors.INVALID_REQUEST,
     "Expected `int`, got `str` - at `$.max_tokens`"),
    ({"id": "a", "prompt": "x", "top_p": -0.5}, errors.INVALID_REQUEST, "$.top_p"),
    ({"id": "a", "prompt": "x", "top_p": 1.5}, errors.INVALID_REQUEST, "$.top_p"),
    ({"id": "a", "prompt": "x", "temperature": -1}, errors.INVALID_REQUEST, "$.temperature"),
    ('{"id": "a", "prompt": "x", "temperature": 1e999}', errors.INVALID_REQUEST, "$.temperature"),
    ({"id": "a", "prompt": "x", "top_k": -1}, errors.INVALID_REQUEST, "$.top_k"),
    ({"id": "a", "prompt": "x", "min_tokens": 17}, errors.INVALID_REQUEST, "$.min_tokens"),
    ({"id": "a", "prompt_token_ids": [1, -1]}, errors.INVALID_REQUEST, "$.prompt_token_ids[1]"),
    ({"id": "a", "prompt_token_ids": []}, errors.INVALID_REQUEST, "$.prompt_token_ids"),
    ({"id": "a", "prompt_token_ids": [1.5]}, errors.INVALID_REQUEST, "$.prompt_token_ids[0]"),
    ({"id": "a", "prompt": "x", "stop": ["s"] * 17}, errors.INVALID_REQUEST, "$.stop"),
    ({"id": "a", "prompt": "x", "stop": ""}, errors.INVALID_REQUEST, "$.stop"),
    ({"id": "a", "prompt": "x", "stop_token_ids": [-2]}, errors.INVALID_REQUEST, "$.stop_token_ids[0]"),
    ({"id": "a", "prompt": "x", "seed": 2**63}, errors.INVALID_REQUEST, "$.seed"),
    ({"id": "a", "prompt": "x", "logprobs": 21}, errors.INVALID_REQUEST, "$.logprobs"),
    ({"id": "a", "prompt": "x", "ignore_eos": 1}, errors.INVALID_REQUEST, "$.ignore_eos"),
    ({"id": "a", "prompt": "x", "tenant": ""}, errors.INVALID_REQUEST, "$.tenant"),
    ({"id": "a", "prompt": "x", "cache_salt": ""}, errors.INVALID_REQUEST, "$.cache_salt"),
    ({"id": "a", "prompt": "x", "cache_salt": "s" * 257}, errors.INVALID_REQUEST, "$.cache_salt"),
    ({"id": "a", "prompt": "x", "cache_salt": 7}, errors.INVALID_REQUEST,
     "Expected `str | null`, got `int` - at `$.cache_salt`"),
    ({"id": "a", "prompt": "x", "cache_salt": ["s"]}, errors.INVALID_REQUEST, "$.cache_salt"),
    ({"id": "a", "prompt": "x", "reply_to": "other:stream"}, errors.INVALID_REQUEST, "$.reply_to"),
    ({"id": "a", "prompt": "x", "job_id": "j\x07"}, errors.INVALID_REQUEST, "$.job_id"),
    ({"id": "a", "prompt": "x", "metadata": {"k": 1}}, errors.INVALID_REQUEST, "$.metadata"),
    ({"id": "a", "prompt": "x", "api": "embeddings"}, errors.INVALID_REQUEST, "$.api"),
    ({"id": "a", "messages": [{"role": "user"}]}, errors.INVALID_REQUEST, "$.messages[0]"),
    ({"id": "a", "messages": []}, errors.INVALID_REQUEST, "$.messages"),
    ({"id": 5, "prompt": "x"}, errors.INVALID_REQUEST, "$.id"),
    ({"id": "", "prompt": "x"}, errors.INVALID_REQUEST, "$.id"),
    ({"id": "x" * 129, "prompt": "x"}, errors.INVALID_REQUEST, "$.id"),
    ({"id": "a\nb", "prompt": "x"}, errors.INVALID_REQUEST, "$.id"),
    ({"prompt": "x"}, errors.INVALID_REQUEST, "missing required field `id`"),
    ([1, 2], errors.INVALID_REQUEST, "Expected `object`, got `array`"),
]


@pytest.mark.parametrize(("raw", "code", "text"), BAD)
def test_bad_input_gives_code_and_names_the_field(raw, code, text):
    err = reject(raw)
    assert err.code == code
    assert text in err.message
    assert str(err) == err.message


@pytest.mark.parametrize(("raw", "code", "text"), [b for b in BAD if not isinstance(b[0], (str, bytes))])
def test_same_errors_from_parsed_objects(raw, code, text):
    with pytest.raises(RequestError) as info:
        request_from_obj(raw)
    assert (info.value.code, text in info.value.message) == (code, True)


def test_request_id_recovered_only_when_usable():
    assert reject({"id": "mine", "prompt": "x", "max_tokens": 0}).request_id == "mine"
    assert reject({"id": "mine", "prompt": "x", "oops": True}).request_id == "mine"
    assert reject({"id": 12, "prompt": "x"}).request_id is None
    assert reject({"id": "bad\x00id", "prompt": "x"}).request_id is None
    assert reject({"id": "x" * 129, "prompt": "x"}).request_id is None
    assert reject('{"id": "mine", "prompt": ').request_id is None
    # The typed decoder stops at the first bad field; what follows is still checked for syntax.
    err = reject('{"id": 5, "prompt": "x"')
    assert err.code == errors.INVALID_JSON


def test_nan_and_infinity_are_rejected_from_msgpack_and_objects():
    for value in (math.nan, math.inf, -math.inf):
        raw = msgspec.msgpack.encode({"id": "a", "prompt": "x", "temperature": value})
        err = reject(raw, fmt="msgpack")
        assert err.code == errors.INVALID_REQUEST and "$.temperature" in err.message and err.request_id == "a"
        for field in ("top_p", "deadline"):
            with pytest.raises(RequestError) as info:
                request_from_obj({"id": "a", "prompt": "x", field: value})
            assert f"$.{field}" in info.value.message


def test_malformed_msgpack_and_text_for_msgpack():
    assert reject(b"\xc1", fmt="msgpack").code == errors.INVALID_JSON
    assert reject("text", fmt="msgpack").code == errors.INVALID_JSON
    assert reject(b"[" * 100_000).code == errors.INVALID_JSON  # deep nesting is an error, not a crash
    with pytest.raises(ValueError):
        decode_request(b"{}", fmt="xml")


def test_sampling_kwargs_build_the_engine_params():
    req = decode_request(json.dumps(FULL))
    params = SamplingParams(**to_sampling_kwargs(req))
    assert params == SamplingParams(
        max_tokens=32, min_tokens=2, temperature=0.5, top_p=0.9, top_k=40, seed=-7, stop=("\n\n", "END"),
        stop_token_ids=(2, 3), ignore_eos=True, logprobs=5,
    )
    greedy = decode_request(b'{"id": "g", "prompt": "x", "temperature": 0}')
    assert SamplingParams(**to_sampling_kwargs(greedy)).greedy


_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, exclude_categories=("Cs", "Cc")), max_size=20)
_ids = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=128)


@st.composite
def requests(draw):
    max_tokens = draw(st.integers(1, 4096))
    kind = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages"]))
    prompt = {
        "prompt": draw(_text),
        "prompt_token_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)),
        "messages": [{"role": "user", "content": draw(_text)}],
    }[kind]
    obj = {
        "id": draw(_ids),
        kind: prompt,
        "max_tokens": max_tokens,
        "min_tokens": draw(st.integers(0, max_tokens)),
        "temperature": draw(st.floats(0, 100, allow_nan=False)),
        "top_p": draw(st.floats(0, 1, exclude_min=True)),
        "seed": draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        "stop": draw(st.lists(_text.filter(bool), max_size=16)),
        "metadata": draw(st.dictionaries(_text, _text, max_size=3)),
        "priority": draw(st.integers(-(2**63), 2**63 - 1)),
        "job_id": draw(st.none() | _ids),
    }
    return {k: v for k, v in obj.items() if v is not None}


@settings(max_examples=100, deadline=None)
@given(requests(), st.sampled_from(["json", "msgpack"]))
def test_any_valid_request_round_trips(obj, fmt):
    req = request_from_obj(obj)
    assert decode_request(encode_request(req, fmt), fmt=fmt) == req
    assert decode_request(json.dumps(obj)) == req


def test_choices_penalties_and_logit_bias_of_native_requests():
    req = decode_request(json.dumps({"id": "p", "prompt": "x", "n": 3, "presence_penalty": 0.5,
                                     "frequency_penalty": 1, "repetition_penalty": 1.3, "logit_bias": {"10": -7}}))
    assert (req.n, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (3, 0.5, 1.0, 1.3)
    assert req.logit_bias == {10: -7.0}
    for fmt in ("json", "msgpack"):
        assert decode_request(encode_request(req, fmt), fmt=fmt) == req
    # A dict with text keys (a client call, a Parquet row) converts the same way.
    assert request_from_obj({"id": "p", "prompt": "x", "n": 3, "presence_penalty": 0.5, "frequency_penalty": 1,
                             "repetition_penalty": 1.3, "logit_bias": {"10": -7}}) == req
    params = SamplingParams(**to_sampling_kwargs(req))
    assert params.logit_bias == ((10, -7.0),) and params.field_prefix == "$" and params.n == 3
    plain = SamplingParams(**to_sampling_kwargs(decode_request(b'{"id": "g", "prompt": "x"}')))
    assert not plain.processes_logits and not plain.penalised and plain.n == 1


@pytest.mark.parametrize(("obj", "path"), [
    ({"n": 0}, "$.n"), ({"n": 129}, "$.n"), ({"presence_penalty": -2.1}, "$.presence_penalty"),
    ({"frequency_penalty": 3}, "$.frequency_penalty"), ({"repetition_penalty": -1}, "$.repetition_penalty"),
    ({"repetition_penalty": 1e-308}, "$.repetition_penalty"), ({"repetition_penalty": 1e308}, "$.repetition_penalty"),
    ({"logit_bias": {"1": -101}}, "$.logit_bias"), ({"logit_bias": {"x": 1}}, "$.logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "$.logit_bias"), ({"best_of": 2}, "best_of"),
])
def test_out_of_range_sampling_fields_name_the_field(obj, path):
    with pytest.raises(RequestError) as info:
        decode_request(json.dumps({"id": "a", "prompt": "x", **obj}))
    assert info.value.code == errors.INVALID_REQUEST and path in info.value.message
    assert info.value.request_id == "a"


def test_an_infinite_repetition_penalty_is_refused():
    with pytest.raises(RequestError) as info:
        decode_request(b'{"id": "a", "prompt": "x", "repetition_penalty": 1e999}')
    assert "$.repetition_penalty" in info.value.message
    with pytest.raises(RequestError) as info:
        request_from_obj({"id": "a", "prompt": "x", "repetition_penalty": float("inf")})
    assert "$.repetition_penalty" in info.value.message


def test_sampling_params_check_the_new_fields():
    for bad in ({"n": 0}, {"n": 129}, {"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
