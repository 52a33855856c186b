"""OpenAI Batch API lines mapped onto Requests, and everything we refuse."""

from __future__ import annotations

import json

import pytest

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import ChatMessage, decode_request, encode_request, request_from_obj


def line(body: dict, url: str = "/v1/completions", **top) -> dict:
    return {"custom_id": "c-1", "method": "POST", "url": url, "body": body, **top}


def chat(body: dict, **top) -> dict:
    return line(body, "/v1/chat/completions", **top)


def reject(obj: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        decode_request(json.dumps(obj))
    # The parsed-object path gives the same answer.
    with pytest.raises(RequestError) as again:
        request_from_obj(obj)
    assert (again.value.code, again.value.message, again.value.request_id) == (
        info.value.code, info.value.message, info.value.request_id,
    )
    return info.value


def test_completions_line_maps_every_supported_parameter():
    req = decode_request(json.dumps(line({
        "model": "tiny", "prompt": "Once", "max_tokens": 7, "temperature": 0.2, "top_p": 0.5, "n": 1,
        "stop": "\n", "seed": 3, "logprobs": 2, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "stream": False, "user": "someone", "top_k": 5, "min_tokens": 1, "ignore_eos": True,
        "stop_token_ids": [9],
    })))
    assert (req.id, req.api, req.model, req.prompt) == ("c-1", "completions", "tiny", "Once")
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed, req.logprobs) == (7, 0.2, 0.5, ["\n"], 3, 2)
    assert (req.top_k, req.min_tokens, req.ignore_eos, req.stop_token_ids) == (5, 1, True, [9])
    assert decode_request(encode_request(req), fmt="msgpack") == req


def test_cache_salt_in_either_body_and_a_bad_one_named_in_the_body():
    assert decode_request(json.dumps(line({"prompt": "x", "cache_salt": "team-red"}))).cache_salt == "team-red"
    req = decode_request(json.dumps(chat({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"})))
    assert req.cache_salt == "s" and decode_request(encode_request(req), fmt="msgpack") == req
    for bad in ("", 3, "s" * 257):
        err = reject(line({"prompt": "x", "cache_salt": bad}))
        assert err.code == errors.INVALID_REQUEST and "$.body.cache_salt" in err.message, err.message
        assert err.request_id == "c-1"


def test_completions_prompt_forms():
    assert decode_request(json.dumps(line({"prompt": [1, 2, 3]}))).prompt_token_ids == [1, 2, 3]
    assert decode_request(json.dumps(line({"prompt": ["only one"]}))).prompt == "only one"
    assert decode_request(json.dumps(line({"prompt": [[4, 5]]}))).prompt_token_ids == [4, 5]
    err = reject(line({"prompt": ["a", "b"]}))
    assert err.code == errors.UNSUPPORTED_PARAMETER and "body.prompt with 2 prompts" in err.message
    assert reject(line({"prompt": []})).code == errors.INVALID_REQUEST
    assert reject(line({"prompt": 5})).code == errors.INVALID_REQUEST
    missing = reject(line({"max_tokens": 3}))
    assert missing.code == errors.INVALID_REQUEST and "`prompt`" in missing.message


def test_null_parameters_count_as_absent():
    req = decode_request(json.dumps(line({"prompt": "x", "temperature": None, "stop": None, "n": None, "tools": None})))
    assert (req.temperature, req.stop) == (1.0, [])


def test_chat_line_keeps_messages_for_the_worker_to_render():
    req = decode_request(json.dumps(chat({
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello", "name": None},
        ],
        "max_completion_tokens": 12, "logprobs": True, "top_logprobs": 3, "n": 1, "stream": False,
    })))
    assert req.api == "chat" and req.prompt is None and req.prompt_token_ids is None
    assert req.messages == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi\nthere"),
        ChatMessage(role="assistant", content="Hello"),
    ]
    assert (req.max_tokens, req.logprobs) == (12, 3)
    assert decode_request(encode_request(req, "json")) == req


def test_chat_logprobs_forms():
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert decode_request(json.dumps(chat({**base, "logprobs": True}))).logprobs == 0
    assert decode_request(json.dumps(chat({**base, "logprobs": False}))).logprobs is None
    err = reject(chat({**base, "top_logprobs": 2}))
    assert err.code == errors.INVALID_REQUEST and "body.top_logprobs requires body.logprobs" in err.message
    err = reject(chat({**base, "logprobs": 2}))
    assert err.code == errors.INVALID_REQUEST and "$.body.logprobs" in err.message
    err = reject(chat({**base, "logprobs": True, "top_logprobs": 21}))
    assert err.code == errors.INVALID_REQUEST and "$.body.top_logprobs" in err.message


UNSUPPORTED = [
    (line({"prompt": "x", "best_of": 3}), "body.best_of = 3 is not supported (only 1); generating best_of"),
    (line({"prompt": "x", "echo": True}), "body.echo = true"),
    (line({"prompt": "x", "stream": True}), "body.stream = true"),
    (chat({"messages": [{"role": "user", "content": "x"}], "best_of": 2}), "ask for n choices"),
    (chat({"messages": [{"role": "user", "content": "x"}], "tools": []}), "body.tools is not supported"),
    (chat({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex", "regex": "a+"}}),
     "body.response_format.type = \"regex\" is not supported"),
    (line({"prompt": "x", "response_format": {"type": "grammar", "grammar": "start: \"a\""}}),
     "body.response_format.type = \"grammar\" is not supported"),
    (chat({"messages": [{"role": "tool", "content": "x"}]}), "body.messages[0].role = \"tool\""),
    (chat({"messages": [{"role": "user", "content": "x", "name": "bob"}]}), "body.messages[0].name is not supported"),
    (chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
     "body.messages[0].content[0].type = \"image_url\""),
    (line({"prompt": "x"}, url="/v1/embeddings"), "url = \"/v1/embeddings\" is not supported"),
    (line({"prompt": "x"}, method="GET"), "method = \"GET\" is not supported"),
]


@pytest.mark.parametrize(("obj", "text"), UNSUPPORTED)
def test_unsupported_parameters_are_named(obj, text):
    err = reject(obj)
    assert err.code == errors.UNSUPPORTED_PARAMETER
    assert text in err.message
    assert err.request_id == "c-1"


INVALID = [
    (line({"prompt": "x"}, extra=1), "unknown field `extra`"),
    (line({"prompt": "x", "temperature": "hot"}), "Expected `float`, got `str` - at `$.body.temperature`"),
    (line({"prompt": "x", "max_tokens": 0}), "$.body.max_tokens"),
    (line({"prompt": "x", "n": "1"}), "Expected `int`, got `str` - at `$.body.n`"),
    (line({"prompt": "x", "stream": 0}), "$.body.stream"),
    (chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
     "$.body.max_completion_tokens"),
    (chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}), "disagree"),
    (chat({"messages": []}), "$.body.messages"),
    (chat({"messages": [{"role": "user"}]}), "$.body.messages[0].content"),
    (chat({"messages": [{"role": "wizard", "content": "x"}]}), "$.body.messages[0].role"),
    (chat({"max_tokens": 3}), "`messages`"),
    ({"custom_id": "c-1", "method": "POST", "url": "/v1/completions", "body": "x"}, "$.body"),
    ({"custom_id": "c-1", "method": "POST", "body": {}}, "`url`"),
]


@pytest.mark.parametrize(("obj", "text"), INVALID)
def test_invalid_lines_name_the_field(obj, text):
    err = reject(obj)
    assert err.code == errors.INVALID_REQUEST
    assert text in err.message
    assert err.request_id == "c-1"


def test_out_of_range_number_is_invalid_not_malformed():
    raw = (
        '{"custom_id": "c-1", "method": "POST", "url": "/v1/completions",'
        ' "body": {"prompt": "x", "temperature": 1e999}}'
    )
    with pytest.raises(RequestError) as info:
        decode_request(raw)
    assert info.value.code == errors.INVALID_REQUEST and "$.body.temperature" in info.value.message


def test_unusable_custom_id_gives_no_request_id():
    for bad in (7, "", "x" * 129, "a\tb"):
        err = reject({"custom_id": bad, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
        assert err.code == errors.INVALID_REQUEST and "$.custom_id" in err.message and err.request_id is None


# -- n, penalties and logit_bias -------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda b: line({"prompt": "x", **b}),
                                  lambda b: chat({"messages": [{"role": "user", "content": "x"}], **b})])
def test_choices_penalties_and_logit_bias_map_on_both_endpoints(make):
    req = decode_request(json.dumps(make({
        "n": 4, "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {"65": 100, "7": -100.0}, "min_tokens": 2, "seed": 9,
    })))
    assert (req.n, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (4, 1.5, -0.5, 1.2)
    assert req.logit_bias == {65: 100.0, 7: -100.0} and req.min_tokens == 2
    assert decode_request(encode_request(req), fmt="msgpack") == req
    assert decode_request(encode_request(req, "json")) == req
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.schemas.request import to_sampling_kwargs

    params = SamplingParams(**to_sampling_kwargs(req))
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (4, 1.5, -0.5, 1.2)
    assert params.logit_bias == ((7, -100.0), (65, 100.0)) and params.field_prefix == "$.body"
    assert params.penalised and params.processes_logits


OUT_OF_RANGE = [
    ({"n": 0}, "Expected `int` >= 1 - at `$.body.n`"),
    ({"n": 129}, "Expected `int` <= 128 - at `$.body.n`"),
    ({"presence_penalty": 2.01}, "Expected `float` <= 2.0 - at `$.body.presence_penalty`"),
    ({"frequency_penalty": -2.5}, "Expected `float` >= -2.0 - at `$.body.frequency_penalty`"),
    ({"repetition_penalty": 0}, "Expected `float` >= 0.01 - at `$.body.repetition_penalty`"),
    ({"repetition_penalty": 1e-308}, "Expected `float` >= 0.01 - at `$.body.repetition_penalty`"),
    ({"repetition_penalty": 1e308}, "Expected `float` <= 100.0 - at `$.body.repetition_penalty`"),
    ({"logit_bias": {"5": 100.5}}, "Expected `float` <= 100.0 - at `$.body.logit_bias[...]`"),
    ({"logit_bias": {"five": 1}}, "Expected `int`, got `str` - at `key` in `$.body.logit_bias`"),
    ({"logit_bias": {"-1": 1}}, "Expected `int` >= 0 - at `key` in `$.body.logit_bias`"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "Expected `object` of length <= 300 - at `$.body.logit_bias`"),
    ({"logit_bias": [1, 2]}, "at `$.body.logit_bias`"),
]


@pytest.mark.parametrize(("body", "text"), OUT_OF_RANGE)
def test_out_of_range_sampling_parameters_name_the_body_field(body, text):
    for obj in (line({"prompt": "x", **body}), chat({"messages": [{"role": "user", "content": "x"}], **body})):
        err = reject(obj)
        assert err.code == errors.INVALID_REQUEST and text in err.message and err.request_id == "c-1"


def test_edges_of_the_ranges_are_accepted():
    req = decode_request(json.dumps(line({
        "prompt": "x", "n": 128, "presence_penalty": -2, "frequency_penalty": 2,
        "logit_bias": {str(i): (-100 if i % 2 else 100) for i in range(300)},
    })))
    assert req.n == 128 and len(req.logit_bias) == 300 and req.presence_penalty == -2.0
