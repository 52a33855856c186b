"""response_format through a worker (the embedded Redis server, the tiny model, real Parquet rows):
native requests and OpenAI Batch lines come back as rows whose text validates and says so in
``schema_valid``; a bad response_format is an error row naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.workers.harness import WorkerHarness, submit

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
def harness(redis_url, tmp_path):
    h = WorkerHarness(redis_url, tmp_path / "out").start()
    yield h
    h.worker.redis.close()


def _openai(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 200, "temperature": 0, **body}}


def test_rows_of_constrained_requests_validate_and_bad_formats_are_error_rows(harness, redis_client):
    json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    submit(redis_client, {"id": "native", "prompt": "Who?", "max_tokens": 200, "temperature": 0,
                          "response_format": json_schema, "reply_to": "mqinfer:reply:n"})
    submit(redis_client, {"id": "seeded", "prompt": "Who?", "max_tokens": 200, "temperature": 1.0, "seed": 3,
                          "response_format": {"type": "regex", "regex": "(cat|dog)s? [0-9]{1,2}"}})
    submit(redis_client, _openai("oa-chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Who?"}], "response_format": json_schema}))
    submit(redis_client, _openai("oa-completion", "/v1/completions", {
        "prompt": "Anything", "response_format": {"type": "json_object"}, "max_tokens": 400}))
    submit(redis_client, {"id": "free", "prompt_token_ids": [256, 1], "max_tokens": 3, "temperature": 0})
    submit(redis_client, {"id": "bad-shape", "prompt": "x",
                          "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}})
    submit(redis_client, {"id": "bad-schema", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "ref", "schema": {"$ref": "#/definitions/missing"}}}})
    submit(redis_client, _openai("oa-regex", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex", "regex": "a"}}))
    harness.until(lambda: len(harness.results()) == 8, advance_s=0.3, what="eight rows")
    rows = {r["id"]: r for r in harness.results()}

    for rid in ("native", "oa-chat"):
        assert rows[rid]["finish_reason"] == "stop" and rows[rid]["schema_valid"] is True
        jsonschema.validate(json.loads(rows[rid]["text"]), PERSON)
    assert rows["seeded"]["schema_valid"] is True
    assert rows["oa-completion"]["finish_reason"] in ("stop", "length")
    if rows["oa-completion"]["finish_reason"] == "stop":
        assert isinstance(json.loads(rows["oa-completion"]["text"]), dict)
    assert rows["oa-completion"]["schema_valid"] is (rows["oa-completion"]["finish_reason"] == "stop")
    assert rows["free"]["finish_reason"] == "length" and rows["free"]["schema_valid"] is None

    shape = rows["bad-shape"]
    assert (shape["finish_reason"], shape["error_code"], shape["schema_valid"]) == ("error", "invalid_request", None)
    assert "at `$.response_format.json_schema.name`" in shape["error"]
    schema = rows["bad-schema"]
    assert (schema["finish_reason"], schema["error_code"]) == ("error", "invalid_response_format")
    assert "the JSON schema cannot be compiled" in schema["error"]
    assert schema["error"].endswith("- at `$.response_format.json_schema.schema`")
    regex = rows["oa-regex"]
    assert regex["error_code"] == "unsupported_parameter" and "$.body.response_format.type" in regex["error"]

    finals = [f for _, f in redis_client.xrange("mqinfer:reply:n") if f[b"type"] == b"final"]
    assert json.loads(finals[0][b"row"])["schema_valid"] is True
