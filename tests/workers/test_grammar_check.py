"""Grammars that would crash or hang the worker: the bounds counted on the source, the checker
process (a real native crash and a real time-out in a child), constraints that match nothing,
and a constraint that reaches a dead end in the middle of the output."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas.response_format import GrammarSpec
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.engine.grammar_check import (
    MAX_ALTERNATIVES,
    MAX_NESTING,
    MAX_REGEX_GROUPS,
    MAX_RULES,
    GrammarChecker,
    check_bounds,
)
from mqinfer.workers.engine.structured import JSON_OPTIONS, tokenizer_spec
from mqinfer.workers.engine.tokenizer import ByteTokenizer

BYTES = tokenizer_spec(ByteTokenizer(), 264, [ByteTokenizer.eos_token_id])


def chain(n: int) -> str:
    """``n`` rules, each an alternative of a literal and the next rule: compiling it recurses n deep."""
    return "\n".join(["root ::= r0", *(f'r{k} ::= "t{k}" | r{k + 1}' for k in range(n)), f'r{n} ::= "end"'])


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=256))


def test_bounds_name_what_is_over_and_count_only_structure():
    assert f"has {MAX_RULES + 2} rules, over the limit of {MAX_RULES}" in check_bounds("gbnf", chain(MAX_RULES))
    assert check_bounds("gbnf", chain(MAX_RULES - 2)) is None
    lark = "\n".join(["start: r0", *(f'r{k}: "a" | r{k + 1}' for k in range(MAX_RULES)), f'r{MAX_RULES}: "b"'])
    assert "the Lark grammar has" in check_bounds("lark", lark)
    deep = "start: " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1)
    assert f"nests {MAX_NESTING + 1} levels deep" in check_bounds("lark", deep)
    assert "nests" in check_bounds("regex", "(" * (MAX_NESTING + 1) + "a" + ")" * (MAX_NESTING + 1))
    assert "alternatives" in check_bounds("regex", "|".join(["a"] * (MAX_ALTERNATIVES + 2)))
    assert f"{MAX_REGEX_GROUPS + 1} groups" in check_bounds("regex", "(a)" * (MAX_REGEX_GROUPS + 1))
    # Brackets and bars inside string literals, character classes, escapes and comments are text.
    assert check_bounds("gbnf", 'root ::= "' + "(" * 500 + "|" * 500 + '"') is None
    assert check_bounds("regex", "[(((((((((]" * 100 + r"\(" * 100) is None
    assert check_bounds("lark", "start: /" + "(?:a)" * 10 + "/  # " + "(" * 500) is None
    assert check_bounds("json_schema", "{" * 1000) is None  # llguidance bounds schemas itself


def test_a_grammar_that_crashes_the_checker_is_refused_and_the_checker_comes_back():
    # A stack of 256 KiB is too small for 900 chained rules: the child dies of a real SIGSEGV.
    checker = GrammarChecker(BYTES, JSON_OPTIONS, stack_bytes=256 << 10)
    try:
        message = checker.check("gbnf", chain(900))
        assert message is not None and "crashed the grammar checker (signal SIGSEGV)" in message
        assert checker.restarts == 1
        assert checker.check("regex", "[a-z]+") is None  # a new child answers the next one
        assert "cannot be compiled" in checker.check("regex", "(")
    finally:
        checker.close()


def test_a_grammar_that_takes_too_long_is_refused():
    checker = GrammarChecker(BYTES, JSON_OPTIONS, timeout_s=0.05)
    try:
        message = checker.check("gbnf", chain(900))  # about a second to compile
        assert message == ("response_format: the GBNF grammar took longer than 0.05s to compile; "
                           "it is too complex")
        assert checker.restarts == 1
    finally:
        checker.close()


def test_the_deepest_grammar_within_the_bounds_compiles_in_the_worker(engine):
    spec = GrammarSpec("gbnf", chain(MAX_RULES - 2))
    engine.add_request("deep", [256, 1], SamplingParams(max_tokens=4, temperature=0.0, grammar=spec))
    while engine.has_unfinished():
        engine.step()
    assert engine.structured.compiler.checker.restarts == 0


@pytest.mark.parametrize(("spec", "text"), [
    (GrammarSpec("gbnf", chain(5000)), "has 5002 rules, over the limit of 1000"),
    (GrammarSpec("regex", "[a&&b]"), "the regex cannot be used: the constraint matches no text at all"),
    (GrammarSpec("gbnf", "root ::= x\nx ::= x"), "the GBNF grammar cannot be used: the constraint matches no text"),
    (GrammarSpec("lark", "start: x\nx: x"), "the Lark grammar cannot be used: the constraint matches no text"),
    (GrammarSpec("json_schema", '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'),
     "the JSON schema cannot be used: the constraint matches no text"),
    (GrammarSpec("regex", "(ab"), "error: unclosed group"),
])
def test_grammars_that_crash_or_match_nothing_are_refused_at_admission(engine, spec, text):
    with pytest.raises(EngineInputError) as info:
        engine.add_request("bad", [256, 1], SamplingParams(max_tokens=4, grammar=spec))
    assert info.value.code == "invalid_response_format"
    assert text in info.value.message and info.value.message.endswith(f" - at `{spec.path}`")
    assert not engine.has_unfinished()


def test_a_constraint_that_reaches_a_dead_end_ends_with_an_error_not_stop(engine):
    # After "a" nothing can follow (x derives no text), though "b" alone would have been valid:
    # the logit bias makes the model take "a".
    spec = GrammarSpec("gbnf", 'root ::= "a" x | "b"\nx ::= x')
    engine.add_request("dead-end", [256, 1], SamplingParams(max_tokens=8, temperature=0.0,
                                                             logit_bias=((ord("a"), 100.0),), grammar=spec))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.finished]
    [out] = outs
    assert out.finish_reason == "error" and out.error_code == "invalid_response_format"
    assert "after 1 output tokens the constraint allows no continuation" in out.error
    assert out.schema_valid is None


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(EngineInputError) as info:
        engine.add_request("oov-stop", [256, 1], SamplingParams(max_tokens=4, stop_token_ids=(72, 264)))
    assert info.value.code == "invalid_token_id"
    assert "token id 264 is outside the vocabulary (0..263)" in info.value.message
    assert info.value.message.endswith("at `$.stop_token_ids[1]`")
