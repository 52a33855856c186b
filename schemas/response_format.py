"""The ``response_format`` request field: the shapes a producer may send, and the grammar they name.

A request constrains its output with one of:

- ``{"type": "text"}``: no constraint (OpenAI's default, accepted so that such lines pass as they are);
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``: JSON
  that validates against ``schema`` (OpenAI's shape; ``strict`` and ``description`` are accepted
  and change nothing: the output always follows the schema);
- ``{"type": "regex", "regex": "..."}``: text matching the regular expression (native requests only);
- ``{"type": "grammar", "grammar": "...", "syntax": "lark" | "gbnf"}``: text in the language of a
  context-free grammar (native requests only).

The shapes are msgspec structs (a union tagged by ``type``), so a bad one is an ``invalid_request``
naming its path (``$.response_format.json_schema.name``) when the request is decoded. Whether the
schema or grammar itself compiles is the worker's question (``invalid_response_format``):
:func:`grammar_spec` only turns the shape into a :class:`GrammarSpec`, the plain data the engine
compiles.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

# OpenAI's rule for json_schema.name.
SchemaName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]

GRAMMAR_KINDS = ("json_schema", "regex", "lark", "gbnf")
# What json_object compiles to: any JSON object.
ANY_JSON_OBJECT = '{"type":"object"}'


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """Unconstrained text."""


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    """Any JSON object."""


class JsonSchema(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI's ``json_schema`` object: a named JSON Schema."""

    name: SchemaName
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    """JSON that validates against ``json_schema.schema``."""

    json_schema: JsonSchema


class RegexFormat(msgspec.Struct, tag="regex", tag_field="type", forbid_unknown_fields=True):
    """Text matching ``regex`` as a whole (Rust ``regex`` syntax, no lookaround or backreferences)."""

    regex: NonEmpty


class GrammarFormat(msgspec.Struct, tag="grammar", tag_field="type", forbid_unknown_fields=True,
                    omit_defaults=True):
    """Text in the language of ``grammar``, written in Lark (llguidance's dialect) or GBNF
    (llama.cpp's); the start rule is ``start`` (Lark) or ``root`` (GBNF)."""

    grammar: NonEmpty
    syntax: Literal["lark", "gbnf"] = "lark"


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat
# The types an OpenAI Batch line may name; the others are extensions of native requests.
OPENAI_TYPES = ("text", "json_object", "json_schema")

_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class GrammarSpec:
    """What the engine compiles: a grammar ``kind`` and its ``source`` text (the JSON Schema as
    JSON, the regex, or the grammar). ``path`` is where the request gave it, for error messages;
    it is not part of the grammar's identity (``key``)."""

    kind: Literal["json_schema", "regex", "lark", "gbnf"]
    source: str
    path: str = field(default="$.response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not self.source:
            raise ValueError("a grammar's source must not be empty")

    @property
    def key(self) -> str:
        """A digest of kind and source: equal grammars share one compiled form."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @property
    def is_json(self) -> bool:
        return self.kind == "json_schema"


def grammar_spec(response_format: ResponseFormat | None, base_path: str = "$.response_format") -> GrammarSpec | None:
    """The grammar a ``response_format`` asks for; None for no constraint. ``base_path`` is where
    the field sits in the request as sent (``$.body.response_format`` for an OpenAI Batch line)."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JsonObjectFormat):
        return GrammarSpec("json_schema", ANY_JSON_OBJECT, base_path)
    if isinstance(response_format, JsonSchemaFormat):
        # Key order is kept: the output lists an object's properties in the schema's order.
        source = _JSON.encode(response_format.json_schema.schema).decode()
        return GrammarSpec("json_schema", source, f"{base_path}.json_schema.schema")
    if isinstance(response_format, RegexFormat):
        return GrammarSpec("regex", response_format.regex, f"{base_path}.regex")
    if isinstance(response_format, GrammarFormat):
        return GrammarSpec(response_format.syntax, response_format.grammar, f"{base_path}.grammar")
    raise TypeError(f"not a response_format: {response_format!r}")


__all__ = [
    "GrammarFormat",
    "GrammarSpec",
    "JsonObjectFormat",
    "JsonSchema",
    "JsonSchemaFormat",
    "OPENAI_TYPES",
    "RegexFormat",
    "ResponseFormat",
    "TextFormat",
    "grammar_spec",
]
