"""The structured-output workload: JSON Schemas of the kinds bulk extraction and classification
jobs send, and the chat prompts that ask a model to fill them in.

``json_schemas(n)`` gives ``n`` named schemas, the same ones in every run: first a hand-written
set shaped like real jobs (a classification with a confidence, named entities, an invoice with
line items, an address, a product review, ...), then schemas drawn from a seeded generator that
combines what those use: nested objects, arrays with item bounds, string enums, integers and
numbers with ranges, booleans, nullable fields, patterns, and optional fields (``required`` a
subset of the properties). Strings are bounded (``maxLength``) so that a model that never
closes a string still finishes within a few hundred tokens.

``structured_requests(schemas, ...)`` turns them into native requests with ``response_format``
``json_schema`` and a chat prompt that shows the schema: what the structured bench and tests send.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = ("name", "title", "city", "country", "score", "price", "count", "label", "kind", "status", "owner",
         "email", "year", "rating", "size", "color", "tags", "items", "notes", "valid", "priority", "source",
         "target", "amount", "unit", "code", "language", "topic", "author", "summary")
ENUM_WORDS = ("low", "medium", "high", "red", "green", "blue", "yes", "no", "maybe", "open", "closed",
              "draft", "final", "cat", "dog", "bird", "north", "south", "east", "west")


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def _str(max_length: int = 24) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


HAND_WRITTEN: list[tuple[str, dict[str, Any]]] = [
    ("sentiment", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("topic", _obj({"topic": {"enum": ["sports", "politics", "science", "business", "arts"]},
                    "keywords": {"type": "array", "items": _str(16), "minItems": 1, "maxItems": 4}})),
    ("person", _obj({"name": _str(32), "age": {"type": "integer", "minimum": 0, "maximum": 130},
                     "email": {"type": ["string", "null"], "maxLength": 40}}, ["name", "age"])),
    ("address", _obj({"street": _str(40), "city": _str(24), "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"enum": ["DE", "FR", "US", "GB", "JP"]}})),
    ("entities", _obj({"entities": {"type": "array", "maxItems": 4, "items": _obj({
        "text": _str(24), "type": {"enum": ["PERSON", "ORG", "PLACE", "DATE"]}})}})),
    ("invoice", _obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                      "total": {"type": "number", "minimum": 0, "maximum": 100000},
                      "paid": {"type": "boolean"},
                      "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
                          "item": _str(20), "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                          "unit_price": {"type": "number", "minimum": 0, "maximum": 1000}})}})),
    ("review", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": _str(60),
                     "pros": {"type": "array", "items": _str(20), "maxItems": 3},
                     "cons": {"type": "array", "items": _str(20), "maxItems": 3}}, ["stars", "summary"])),
    ("event", _obj({"title": _str(40), "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "online": {"type": "boolean"},
                    "location": {"anyOf": [_obj({"city": _str(24)}), {"type": "null"}]}})),
    ("language", _obj({"language": {"enum": ["en", "de", "fr", "es", "it", "other"]},
                       "is_question": {"type": "boolean"}})),
    ("spam", _obj({"spam": {"type": "boolean"}, "reason": {"type": ["string", "null"], "maxLength": 40}})),
    ("product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "name": _str(30),
                      "price": {"type": "number", "minimum": 0.01, "maximum": 9999.99},
                      "in_stock": {"type": "boolean"},
                      "dimensions": _obj({"width": {"type": "number", "minimum": 0, "maximum": 500},
                                          "height": {"type": "number", "minimum": 0, "maximum": 500}})},
                     ["sku", "name", "price"])),
    ("triage", _obj({"priority": {"enum": ["p0", "p1", "p2", "p3"]}, "team": {"enum": ["infra", "web", "data"]},
                     "duplicate_of": {"type": ["integer", "null"], "minimum": 1, "maximum": 99999}})),
    ("qa", _obj({"answer": _str(80), "answerable": {"type": "boolean"},
                 "evidence": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50},
                              "maxItems": 3}})),
    ("recipe", _obj({"dish": _str(30), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                     "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": _obj({
                         "name": _str(20), "grams": {"type": "integer", "minimum": 1, "maximum": 2000}},
                         ["name"])}})),
    ("meeting", _obj({"attendees": {"type": "array", "items": _str(20), "minItems": 1, "maxItems": 4},
                      "decisions": {"type": "array", "items": _str(40), "maxItems": 2},
                      "follow_up": {"type": "boolean"}})),
    ("geo", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                  "lon": {"type": "number", "minimum": -180, "maximum": 180}, "place": _str(30)})),
]


class _Generator:
    """Random schemas from a seeded generator; depth-bounded."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def value(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        kinds = ["string", "integer", "number", "boolean", "enum", "nullable", "pattern"]
        if depth < 2:
            kinds += ["array", "object", "array_of_objects"]
        kind = rng.choice(kinds)
        if kind == "string":
            return _str(rng.randint(1, 24))
        if kind == "integer":
            lo = rng.randint(-100, 100)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
        if kind == "number":
            lo = rng.choice([-1000, -1, 0, 0.5, 10])
            return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 10, 100, 5000])}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(ENUM_WORDS, rng.randint(2, 5))}
        if kind == "nullable":
            inner = rng.choice([{"type": ["string", "null"], "maxLength": rng.randint(1, 16)},
                                {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
                                {"type": ["boolean", "null"]}])
            return inner
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[a-z]{2,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$",
                                                             "^[A-Z][a-z]{1,8}$"])}
        if kind == "array":
            lo = rng.randint(0, 2)
            return {"type": "array", "items": self.value(depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
        if kind == "array_of_objects":
            return {"type": "array", "items": self.object(depth + 1), "maxItems": rng.randint(1, 3)}
        return self.object(depth + 1)

    def object(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        names = rng.sample(WORDS, rng.randint(1, 5 if depth == 0 else 3))
        properties = {name: self.value(depth) for name in names}
        required = [n for n in names if rng.random() < 0.7] or names[:1]
        return _obj(properties, required)


def json_schemas(n: int = 60, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``n`` (name, JSON Schema) pairs: the hand-written ones first, then generated ones."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    schemas = list(HAND_WRITTEN[:n])
    gen = _Generator(seed)
    while len(schemas) < n:
        schemas.append((f"generated_{len(schemas):03d}", gen.object(0)))
    return schemas


def prompt_messages(name: str, schema: dict[str, Any], index: int = 0) -> list[dict[str, str]]:
    """A chat asking for one JSON object of ``schema`` (``index`` varies the wording)."""
    asks = ("Invent a realistic example", "Fill in plausible values", "Give one example record")
    return [
        {"role": "system", "content": "You answer with a single JSON object and nothing else."},
        {"role": "user", "content": f"{asks[index % len(asks)]} for the schema `{name}`:\n"
                                    f"{json.dumps(schema)}"},
    ]


def structured_requests(schemas: list[tuple[str, dict[str, Any]]], *, per_schema: int = 1, max_tokens: int = 384,
                        temperature: float = 0.0, seed: int | None = None) -> list[dict[str, Any]]:
    """Native requests (dicts): ``per_schema`` for each schema, chat prompts, ``response_format``
    ``json_schema``. With a ``seed`` each request gets ``seed + its index``."""
    requests = []
    for k in range(per_schema):
        for name, schema in schemas:
            i = len(requests)
            request: dict[str, Any] = {
                "id": f"{name}-{k}", "messages": prompt_messages(name, schema, k), "max_tokens": max_tokens,
                "temperature": temperature,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": name, "schema": schema, "strict": True}},
            }
            if seed is not None:
                request["seed"] = seed + i
            requests.append(request)
    return requests


__all__ = ["HAND_WRITTEN", "json_schemas", "prompt_messages", "structured_requests"]
