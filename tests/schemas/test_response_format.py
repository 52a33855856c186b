"""``response_format`` on native requests and OpenAI Batch lines: the shapes accepted, the grammar
each names, and errors naming the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import decode_request, encode_request, request_from_obj, to_sampling_kwargs
from mqinfer.schemas.response_format import ANY_JSON_OBJECT, GrammarSpec, JsonSchemaFormat

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}},
          "required": ["b", "a"]}


def native(response_format) -> dict:
    return {"id": "r1", "prompt": "Extract", "response_format": response_format}


def chat(response_format, url="/v1/chat/completions") -> dict:
    body = {"messages": [{"role": "user", "content": "Extract"}], "response_format": response_format}
    if url == "/v1/completions":
        body = {"prompt": "Extract", "response_format": response_format}
    return {"custom_id": "c1", "method": "POST", "url": url, "body": body}


def grammar_of(obj) -> GrammarSpec | None:
    return to_sampling_kwargs(decode_request(json.dumps(obj)))["grammar"]


def test_native_shapes_name_their_grammar():
    assert grammar_of(native({"type": "text"})) is None
    assert grammar_of({"id": "r", "prompt": "x"}) is None
    assert grammar_of(native({"type": "json_object"})) == GrammarSpec("json_schema", ANY_JSON_OBJECT)
    spec = grammar_of(native({"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}))
    # Property order is kept: the output follows it.
    assert spec.kind == "json_schema" and json.loads(spec.source) == SCHEMA and spec.source.index('"b"') < spec.source.index('"a"')
    assert spec.path == "$.response_format.json_schema.schema"
    assert grammar_of(native({"type": "regex", "regex": "[0-9]+"})) == GrammarSpec("regex", "[0-9]+")
    lark = grammar_of(native({"type": "grammar", "grammar": 'start: "a"'}))
    assert (lark.kind, lark.source, lark.path) == ("lark", 'start: "a"', "$.response_format.grammar")
    assert grammar_of(native({"type": "grammar", "grammar": 'root ::= "a"', "syntax": "gbnf"})).kind == "gbnf"


def test_equal_grammars_share_a_key_whatever_their_path():
    a = GrammarSpec("regex", "a+", "$.response_format.regex")
    b = GrammarSpec("regex", "a+", "$.body.response_format.regex")
    assert a == b and a.key == b.key and a.key != GrammarSpec("lark", "a+").key
    with pytest.raises(ValueError):
        GrammarSpec("ebnf", "x")
    with pytest.raises(ValueError):
        GrammarSpec("regex", "")


def test_response_format_survives_the_stream_encodings():
    req = decode_request(json.dumps(native({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})))
    for fmt in ("json", "msgpack"):
        again = decode_request(encode_request(req, fmt), fmt=fmt)
        assert isinstance(again.response_format, JsonSchemaFormat) and again.response_format == req.response_format
    assert request_from_obj(native({"type": "json_object"})).response_format is not None


NATIVE_INVALID = [
    ({"type": "xml"}, "Invalid value 'xml' - at `$.response_format.type`"),
    ({}, "Object missing required field `type` - at `$.response_format`"),
    ("json", "Expected `object | null`, got `str` - at `$.response_format`"),
    ({"type": "json_schema"}, "Object missing required field `json_schema` - at `$.response_format`"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
     "Object missing required field `name` - at `$.response_format.json_schema`"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
     "at `$.response_format.json_schema.name`"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}},
     "Expected `object`, got `str` - at `$.response_format.json_schema.schema`"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}},
     "at `$.response_format.json_schema.strict`"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "extra": 1}},
     "Object contains unknown field `extra` - at `$.response_format.json_schema`"),
    ({"type": "json_object", "schema": SCHEMA}, "Object contains unknown field `schema` - at `$.response_format`"),
    ({"type": "regex"}, "Object missing required field `regex` - at `$.response_format`"),
    ({"type": "regex", "regex": ""}, "at `$.response_format.regex`"),
    ({"type": "grammar", "grammar": "x", "syntax": "ebnf"}, "Invalid enum value 'ebnf' - at `$.response_format.syntax`"),
]


@pytest.mark.parametrize(("value", "message"), NATIVE_INVALID)
def test_invalid_native_shapes_are_errors_naming_the_field(value, message):
    with pytest.raises(RequestError) as info:
        decode_request(json.dumps(native(value)))
    assert info.value.code == errors.INVALID_REQUEST and info.value.request_id == "r1"
    assert message in info.value.message


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_openai_lines_map_json_object_and_json_schema(url):
    obj = decode_request(json.dumps(chat({"type": "json_schema", "json_schema": {
        "name": "pick", "description": "a pick", "schema": SCHEMA, "strict": True}}, url)))
    assert obj.id == "c1" and obj.api in ("chat", "completions")
    spec = to_sampling_kwargs(obj)["grammar"]
    assert json.loads(spec.source) == SCHEMA and spec.path == "$.body.response_format.json_schema.schema"
    spec = grammar_of(chat({"type": "json_object"}, url))
    assert (spec.source, spec.path) == (ANY_JSON_OBJECT, "$.body.response_format")
    assert grammar_of(chat({"type": "text"}, url)) is None
    assert grammar_of(chat(None, url)) is None  # null counts as absent


OPENAI_INVALID = [
    ({"type": "regex", "regex": "a+"}, errors.UNSUPPORTED_PARAMETER,
     'body.response_format.type = "regex" is not supported in OpenAI Batch lines'),
    ({"type": "grammar", "grammar": 'start: "a"'}, errors.UNSUPPORTED_PARAMETER, "- at `$.body.response_format.type`"),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, errors.INVALID_REQUEST,
     "Object missing required field `schema` - at `$.body.response_format.json_schema`"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}}, errors.INVALID_REQUEST,
     "at `$.body.response_format.json_schema.name`"),
    ({"type": "xml"}, errors.INVALID_REQUEST, "Invalid value 'xml' - at `$.body.response_format.type`"),
    (["json_object"], errors.INVALID_REQUEST, "- at `$.body.response_format`"),
]


@pytest.mark.parametrize(("value", "code", "message"), OPENAI_INVALID)
def test_invalid_openai_response_formats_name_the_body_field(value, code, message):
    with pytest.raises(RequestError) as info:
        decode_request(json.dumps(chat(value)))
    assert info.value.code == code and info.value.request_id == "c1"
    assert message in info.value.message


def test_json_schema_keeps_large_and_nested_schemas_as_sent():
    nested = {"type": "object", "properties": {"x": {"type": "array", "items": SCHEMA, "maxItems": 2}}}
    req = msgspec.json.decode(msgspec.json.encode(native({"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": nested}})))
    assert json.loads(grammar_of(req).source) == nested


def test_parquet_response_format_as_json_text_or_as_a_struct(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mqinfer.schemas.files import iter_input

    as_text = tmp_path / "text.parquet"
    pq.write_table(pa.table({
        "id": ["a", "b", "c", "d"], "prompt": ["x"] * 4,
        "response_format": [json.dumps({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
                            None, json.dumps({"type": "regex", "regex": "[0-9]+"}), "{not json"],
    }), as_text)
    items = list(iter_input(as_text))
    assert json.loads(to_sampling_kwargs(items[0].request)["grammar"].source) == SCHEMA
    assert items[1].request.response_format is None
    assert to_sampling_kwargs(items[2].request)["grammar"] == GrammarSpec("regex", "[0-9]+")
    assert items[3].error.code == errors.INVALID_REQUEST and "$.response_format" in items[3].error.message

    # Arrow unifies the rows' structs: each gains the other rows' fields as nulls.
    as_struct = tmp_path / "struct.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "s1", "prompt": "x", "response_format": {"type": "json_object"}},
        {"id": "s2", "prompt": "x", "response_format": {"type": "regex", "regex": "a+"}},
    ]), as_struct)
    first, second = (i.request for i in iter_input(as_struct))
    assert to_sampling_kwargs(first)["grammar"].source == ANY_JSON_OBJECT
    assert to_sampling_kwargs(second)["grammar"] == GrammarSpec("regex", "a+")
