"""A fuzz of grammars, regexes and JSON schemas (hypothesis) against one real worker: every request
ends with a row (an ordinary one, or an error row ``invalid_response_format``), no row says
``stop`` for text its constraint rejects, and the worker is alive and answering at the end.

The generated grammars reach the shapes that have crashed or hung grammar compilers: long chains
of rules, deep nesting, many alternatives, rules that derive nothing, and schemas whose ``$ref``s
form cycles. In the slow suite (`pytest -m slow`)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqinfer.schemas import keys
from tests.faults.faultkit import STREAM, spawn
from tests.helpers import rows, wait_until

pytestmark = pytest.mark.slow

_NAMES = st.integers(0, 40)


@st.composite
def gbnf(draw) -> str:
    """A GBNF grammar: rules r0..rN, each alternatives of sequences of literals, references (to any
    rule, cycles included), groups nested a few deep and repetitions; sometimes a long chain."""
    if draw(st.integers(0, 9)) == 0:
        n = draw(st.integers(500, 3000))
        return "\n".join(["root ::= r0", *(f'r{k} ::= "t{k}" | r{k + 1}' for k in range(n)), f'r{n} ::= "z"'])
    count = draw(st.integers(1, 12))

    def term(depth: int) -> str:
        kind = draw(st.integers(0, 4 if depth < 6 else 1))
        if kind == 0:
            return json.dumps(draw(st.text("abcxyz{}\":, 0123", min_size=1, max_size=4)))
        if kind == 1:
            return f"r{draw(st.integers(0, count - 1))}"
        if kind == 2:
            return "[a-z0-9]"
        inner = " ".join(term(depth + 1) for _ in range(draw(st.integers(1, 3))))
        alts = " | ".join([inner] + [term(depth + 1) for _ in range(draw(st.integers(0, 2)))])
        return f"({alts}){draw(st.sampled_from(['', '*', '+', '?', '{2,3}']))}"

    rules = []
    for k in range(count):
        alts = [" ".join(term(0) for _ in range(draw(st.integers(1, 3)))) for _ in range(draw(st.integers(1, 4)))]
        rules.append(f"r{k} ::= " + " | ".join(alts))
    return "\n".join(["root ::= r0", *rules])


@st.composite
def regex(draw) -> str:
    def part(depth: int) -> str:
        kind = draw(st.integers(0, 5 if depth < 8 else 1))
        if kind == 0:
            return re.escape(draw(st.text("abc012 ", min_size=1, max_size=3)))
        if kind == 1:
            return draw(st.sampled_from(["[a-c]", r"\d", "[^a]", "[a&&b]", ".", "[a-z&&[^aeiou]]"]))
        if kind == 2:
            return part(depth + 1) + draw(st.sampled_from(["*", "+", "?", "{0,3}", "{2}", "{1000}"]))
        if kind == 3:
            return "(" + "|".join(part(depth + 1) for _ in range(draw(st.integers(1, 3)))) + ")"
        return part(depth + 1) + part(depth + 1)

    return part(0)


@st.composite
def schema(draw, depth: int = 0) -> dict:
    kind = draw(st.integers(0, 6 if depth < 5 else 2))
    if kind == 0:
        return {"type": draw(st.sampled_from(["string", "integer", "number", "boolean", "null"]))}
    if kind == 1:
        return {"enum": draw(st.lists(st.sampled_from(["a", 1, None, True]), min_size=0, max_size=3))}
    if kind == 2:
        return {"$ref": draw(st.sampled_from(["#", "#/$defs/a", "#/$defs/b"]))}
    if kind == 3:
        return {"type": "array", "items": draw(schema(depth + 1)), "minItems": draw(st.integers(0, 3))}
    if kind == 4:
        return {"anyOf": [draw(schema(depth + 1)) for _ in range(draw(st.integers(1, 3)))]}
    props = {f"p{i}": draw(schema(depth + 1)) for i in range(draw(st.integers(0, 3)))}
    return {"type": "object", "properties": props, "required": list(props)[: draw(st.integers(0, len(props)))]}


@st.composite
def top_schema(draw) -> dict:
    root = draw(schema())
    return {**root, "$defs": {"a": draw(schema(1)), "b": draw(schema(1))}}


def formats() -> st.SearchStrategy[dict]:
    return st.one_of(
        gbnf().map(lambda g: {"type": "grammar", "syntax": "gbnf", "grammar": g}),
        regex().map(lambda r: {"type": "regex", "regex": r}),
        top_schema().map(lambda s: {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": s}}),
    )


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    url = redis_server.url
    import redis

    client = redis.Redis.from_url(url)
    client.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    out = tmp_path_factory.mktemp("fuzz") / "out"
    proc = spawn(url, out, "fuzzer", "--claim-idle-ms", "1000")
    yield client, out, proc
    proc.signal(15)
    proc.wait()


_seen = {"n": 0}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(response_format=formats())
def test_fuzzed_constraints_end_with_rows_and_the_worker_lives(worker, response_format):
    client, out, proc = worker
    _seen["n"] += 1
    rid = f"fuzz-{_seen['n']}"
    request = {"id": rid, "prompt_token_ids": [256, 123], "max_tokens": 12, "temperature": 0,
               "response_format": response_format}
    client.xadd(STREAM, {"json": json.dumps(request), "v": "1"})
    row = wait_until(lambda: next((r for r in rows(out / "results") if r["id"] == rid), None), timeout=90,
                     what=f"the row of {rid}")
    assert proc.proc.poll() is None, proc.log()[-3000:]
    assert row["finish_reason"] in ("stop", "length", "error"), row
    if row["finish_reason"] == "error":
        assert row["error_code"] == "invalid_response_format" and row["error"].startswith("response_format: ")
    if row["finish_reason"] == "stop":
        assert row["schema_valid"] is True, row


def test_the_worker_still_answers_after_the_fuzz(worker):
    client, out, proc = worker
    client.xadd(STREAM, {"json": json.dumps({"id": "after-fuzz", "prompt_token_ids": [256, 1], "max_tokens": 3,
                                             "ignore_eos": True}), "v": "1"})
    row = wait_until(lambda: next((r for r in rows(out / "results") if r["id"] == "after-fuzz"), None), timeout=90,
                     what="the last row")
    assert row["finish_reason"] == "length" and proc.proc.poll() is None
