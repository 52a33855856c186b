"""Structured output in the engine (tiny model, random weights): every row that ends "stop" parses
and validates against its JSON Schema (the 60-schema set of loadgen/structured_workload.py, greedy
and seeded), masks computed in the background equal masks computed inline, EOS only where the
grammar accepts, preemption, prefix caching, stop strings, speculative decoding, a GGUF tokenizer,
and uncompilable grammars as errors naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from mqinfer.loadgen.structured_workload import json_schemas, structured_requests
from mqinfer.scheduler.output import ScheduledRequest
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.schemas.request import request_from_obj, to_sampling_kwargs
from mqinfer.schemas.response_format import GrammarSpec
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.engine.structured import MAX_GRAMMAR_BYTES, GrammarCompiler, StructuredOutputs, build_tokenizer
from mqinfer.workers.engine.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_token_id
SCHEMAS = json_schemas(60)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_threads=1, **{"num_kv_blocks": 2048, **kw}))


def _json(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def _finish(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                outs[o.request_id] = o
    return outs


def _add_workload(engine: LLMEngine, prefix: str = "", **kw) -> dict[str, dict]:
    """The 60-schema workload as native requests through the request schema, their ids after
    ``prefix``; schema by request id."""
    by_id = {}
    for obj in structured_requests(SCHEMAS, **kw):
        req = request_from_obj(obj)
        prompt = engine.encode_prompt(None, None, [{"role": m.role, "content": m.content} for m in req.messages])
        engine.add_request(prefix + req.id, prompt, SamplingParams(**to_sampling_kwargs(req)))
        by_id[prefix + req.id] = obj["response_format"]["json_schema"]["schema"]
    return by_id


def test_every_stop_row_of_the_60_schemas_parses_and_validates():
    """The workload greedy and seeded, in one engine: each of the 60 grammars is compiled once and
    serves both."""
    # Room for all 120 requests' full contexts at once, in 8-bit blocks: a quarter of the bytes
    # each decode step's attention reads, and what a grammar allows does not depend on them.
    engine = _engine(num_kv_blocks=4096, kv_cache_dtype="int8")
    # Most rows close their object within 250 tokens; the few that never do run to the limit.
    schemas = {**_add_workload(engine, "greedy-", max_tokens=256, temperature=0.0),
               **_add_workload(engine, "seeded-", max_tokens=256, temperature=1.0, seed=11)}
    outs = _finish(engine)
    assert set(outs) == set(schemas) and len(schemas) == 120
    for mode in ("greedy-", "seeded-"):
        rows = [o for o in outs.values() if o.request_id.startswith(mode)]
        # A random model given a free hand rarely closes a JSON object; masked, most rows complete.
        assert len(rows) == 60 and sum(o.finish_reason == "stop" for o in rows) >= 0.7 * len(rows), mode
    for o in outs.values():
        assert o.finish_reason in ("stop", "length")
        assert o.schema_valid is (o.finish_reason == "stop")
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schemas[o.request_id])
            assert o.output_token_ids[-1] != EOS  # the grammar ended it
    assert engine.num_preemptions_total == 0
    assert engine.structured.compiler.misses == 60 and len(engine.structured) == 0


def test_seeded_constrained_output_does_not_depend_on_the_batch():
    alone = _engine()
    alone.add_request("x", [256, 65, 66], SamplingParams(max_tokens=200, temperature=0.9, seed=5,
                                                         grammar=_json(PERSON)))
    ref = _finish(alone)["x"]
    batched = _engine()
    for i in range(6):
        batched.add_request(f"o{i}", [256, 70 + i], SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                                   grammar=_json(SCHEMAS[i][1]) if i % 2 else None))
    batched.add_request("x", [256, 65, 66], SamplingParams(max_tokens=200, temperature=0.9, seed=5,
                                                           grammar=_json(PERSON)))
    out = _finish(batched)["x"]
    assert out.output_token_ids == ref.output_token_ids and out.text == ref.text and out.schema_valid


def _recording(engine: LLMEngine) -> tuple[list, list[str]]:
    """Every StepMasks the engine makes, and the thread each fill ran on."""
    made, threads = [], []
    structured = engine.structured
    begin, fill = structured.begin_step, structured._fill

    def begin_step(scheduled):
        masks = begin(scheduled)
        if masks is not None:
            made.append(masks)
        return masks

    def on_thread(matchers, bitmask):
        import threading

        threads.append(threading.current_thread().name)
        fill(matchers, bitmask)

    structured.begin_step, structured._fill = begin_step, on_thread
    return made, threads


def test_masks_filled_in_the_background_equal_masks_filled_inline():
    runs = {}
    for background in (True, False):
        engine = _engine()
        engine.structured.background = background
        made, threads = _recording(engine)
        for i, (name, schema) in enumerate(SCHEMAS[:24]):
            engine.add_request(name, [256, 80 + i, 81], SamplingParams(max_tokens=160, temperature=0.0 if i % 2 else 1.0,
                                                                       seed=i, grammar=_json(schema)))
        for i in range(4):  # unconstrained neighbours in the same batches
            engine.add_request(f"free{i}", [256, 90 + i], SamplingParams(max_tokens=50, temperature=0.0))
        outs = _finish(engine)
        runs[background] = (made, threads, {k: o.output_token_ids for k, o in outs.items()})
    (bg, bg_threads, bg_out), (inline, inline_threads, inline_out) = runs[True], runs[False]
    assert bg_out == inline_out
    assert len(bg) == len(inline) > 100
    for a, b in zip(bg, inline):
        assert a.rows == b.rows and torch.equal(a.bitmask, b.bitmask)
    assert set(bg_threads) == {"grammar-masks_0"} and set(inline_threads) == {"MainThread"}


def test_the_mask_kernel_and_its_pytorch_reference_sample_the_same(monkeypatch):
    """The PyTorch path is the one other devices take; on this CPU it must pick the same tokens."""
    from mqinfer.kernels.cpu_ops import reference_apply_token_bitmask
    from mqinfer.workers.engine import structured

    def run() -> dict:
        engine = _engine()
        for i, (name, schema) in enumerate(SCHEMAS[:12]):
            engine.add_request(name, [256, 30 + i], SamplingParams(max_tokens=150, temperature=0.0 if i % 2 else 1.0,
                                                                   seed=i, logprobs=1 if i % 3 == 0 else None,
                                                                   grammar=_json(schema)))
        return {k: (o.output_token_ids, o.logprobs) for k, o in _finish(engine).items()}

    native = run()
    monkeypatch.setattr(structured, "apply_token_bitmask", reference_apply_token_bitmask)
    assert run() == native


def test_unconstrained_requests_pay_nothing_and_are_unchanged_beside_constrained_ones():
    free = [[256, 40 + i, 41, 42] for i in range(4)]
    alone = _engine()
    for i, p in enumerate(free):
        alone.add_request(f"f{i}", p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.8, seed=i))
    ref = {k: o.output_token_ids for k, o in _finish(alone).items()}
    assert alone.structured.stats.steps == 0  # no constrained request: no masks, no thread
    assert alone.structured._thread is None
    mixed = _engine()
    for i, p in enumerate(free):
        mixed.add_request(f"f{i}", p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.8, seed=i))
        mixed.add_request(f"c{i}", p, SamplingParams(max_tokens=120, temperature=0.0, grammar=_json(PERSON)))
    outs = _finish(mixed)
    assert {k: outs[k].output_token_ids for k in ref} == ref
    assert all(outs[k].schema_valid is None for k in ref)
    assert mixed.structured.stats.masks > 0 and mixed.structured.stats.fill_seconds > 0


def _matcher_request(spec: GrammarSpec, **sampling) -> EngineRequest:
    return EngineRequest("r", [256], SamplingParams(max_tokens=20, grammar=spec, **sampling),
                         eos_token_ids=frozenset({EOS}))


def test_eos_and_stop_tokens_only_where_the_grammar_accepts():
    structured = StructuredOutputs(ByteTokenizer(), 264, [EOS], background=False)
    request = _matcher_request(GrammarSpec("regex", "(ab)+"), stop_token_ids=(260,))
    structured.add(request)

    def allowed() -> set[int]:
        masks = structured.begin_step([ScheduledRequest(request, request.num_tokens - request.num_computed_tokens)])
        return set(torch.nonzero(masks.allowed(264)[0]).flatten().tolist())

    assert allowed() == {ord("a")}
    for token, expected in ((ord("a"), {ord("b")}), (ord("b"), {ord("a"), EOS, 260}),
                            (ord("a"), {ord("b")}), (ord("b"), {ord("a"), EOS, 260})):
        request.append_output_token(token)
        assert structured.advance(request, [token]) is None
        request.num_computed_tokens = request.num_tokens - 1
        assert allowed() == expected


def test_a_regex_ends_at_eos_where_it_accepts_and_by_itself_where_it_is_complete():
    engine = _engine()
    for i in range(40):
        engine.add_request(f"r{i}", [256, 50 + i], SamplingParams(max_tokens=10, temperature=1.5, seed=i,
                                                                  grammar=GrammarSpec("regex", "[ab]{2,5}")))
    for o in _finish(engine).values():
        assert o.finish_reason == "stop" and o.schema_valid and re.fullmatch("[ab]{2,5}", o.text), o.text
        ended_by_eos = o.output_token_ids[-1] == EOS
        assert len(o.text) == len(o.output_token_ids) - ended_by_eos
        assert ended_by_eos == (len(o.text) < 5)  # five letters: complete, nothing may follow
    engine.add_request("n", [256, 1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                     grammar=GrammarSpec("regex", "a{3}")))
    out = _finish(engine)["n"]
    assert (out.text, out.finish_reason, out.schema_valid, out.output_token_ids) == ("aaa", "stop", True, [97] * 3)


def test_the_grammar_ends_a_request_whatever_min_tokens_and_ignore_eos_say():
    engine = _engine()
    regex = GrammarSpec("regex", "[ab]{2,5}")
    for i in range(6):
        engine.add_request(f"m{i}", [256, i + 1], SamplingParams(max_tokens=20, min_tokens=8, temperature=1.5,
                                                                 seed=i, grammar=regex))
        engine.add_request(f"i{i}", [256, i + 1], SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.5,
                                                                 seed=i, grammar=regex))
    outs = _finish(engine)
    for i in range(6):
        m, n = outs[f"m{i}"], outs[f"i{i}"]
        # min_tokens holds EOS back while the grammar allows anything else: the text goes on to five
        # letters, where the grammar is complete and ends it, three tokens short of min_tokens.
        assert m.finish_reason == "stop" and m.schema_valid and re.fullmatch("[ab]{5}", m.text)
        assert m.output_token_ids == list(m.text.encode())
        # ignore_eos: EOS may come where the grammar accepts, and then it ends the text too.
        assert n.finish_reason == "stop" and n.schema_valid and re.fullmatch("[ab]{2,5}", n.text)
        assert len(n.output_token_ids) <= 6


def test_lark_and_gbnf_grammars():
    engine = _engine()
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    gbnf = 'root ::= ("red" | "green") " " [0-9]'
    for i in range(8):
        engine.add_request(f"l{i}", [256, i + 1], SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                                 grammar=GrammarSpec("lark", lark)))
        engine.add_request(f"g{i}", [256, i + 1], SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                                 grammar=GrammarSpec("gbnf", gbnf)))
    for rid, o in _finish(engine).items():
        pattern = r"yes|no|maybe [0-9]{1,3}" if rid.startswith("l") else r"(red|green) [0-9]"
        assert o.finish_reason == "stop" and o.schema_valid and re.fullmatch(pattern, o.text), (rid, o.text)


def test_preemption_keeps_the_tokens_consumed():
    """A cache too small for the batch preempts constrained requests, by recomputing them and by
    swapping them out; either way they give the tokens of a cache roomy enough for none (one
    roomy run for both: without preemptions the mode changes nothing)."""

    def run(num_kv_blocks: int, **swap):
        engine = _engine(num_kv_blocks=num_kv_blocks, block_size=16, max_num_batched_tokens=256, **swap)
        for i, (name, schema) in enumerate(SCHEMAS[:16]):
            engine.add_request(name, [256] + [60 + (i + k) % 60 for k in range(70)],
                               SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 1.0, seed=i,
                                              grammar=_json(schema)))
        outs = _finish(engine)
        return outs, sum(o.num_preemptions for o in outs.values())

    roomy, none = run(2048)
    assert none == 0
    schemas = dict(SCHEMAS)
    for mode, swap in (("recompute", {}), ("swap", {"preemption_mode": "swap", "swap_space_gib": 0.05})):
        tight, preemptions = run(40, **swap)
        assert preemptions >= 5, mode
        assert (sum(o.num_swaps for o in tight.values()) > 0) == (mode == "swap")
        assert {k: o.output_token_ids for k, o in tight.items()} == {k: o.output_token_ids for k, o in roomy.items()}
        for rid, o in tight.items():
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schemas[rid])
            assert o.schema_valid is (o.finish_reason == "stop")


def test_prefix_cache_hits_change_nothing():
    engine = _engine(block_size=16)
    prompt = [256] + list(b"Extract the person from this long shared document, please. " * 2)
    sampling = SamplingParams(max_tokens=120, temperature=0.0, grammar=_json(PERSON))
    engine.add_request("first", prompt, sampling)
    first = _finish(engine)["first"]
    engine.add_request("again", prompt, sampling)
    again = _finish(engine)["again"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 96
    assert again.output_token_ids == first.output_token_ids and again.schema_valid is first.schema_valid is True
    assert engine.structured.compiler.hits == 1


def test_a_stop_string_that_cuts_the_text_leaves_it_not_valid():
    engine = _engine()
    spec = _json(PERSON)
    engine.add_request("cut", [256, 9], SamplingParams(max_tokens=120, temperature=0.0, stop=('", "',), grammar=spec))
    engine.add_request("whole", [256, 9], SamplingParams(max_tokens=120, temperature=0.0, stop=("@@@",), grammar=spec))
    engine.add_request("short", [256, 9], SamplingParams(max_tokens=6, temperature=0.0, grammar=spec))
    outs = _finish(engine)
    assert outs["cut"].finish_reason == "stop" and outs["cut"].schema_valid is False
    assert outs["cut"].text.startswith('{"name": "') and '", "' not in outs["cut"].text
    assert outs["whole"].finish_reason == "stop" and outs["whole"].schema_valid is True
    json.loads(outs["whole"].text)
    assert outs["short"].finish_reason == "length" and outs["short"].schema_valid is False
    assert len(outs["short"].output_token_ids) == 6


def test_a_cancelled_constrained_request_is_not_valid_and_is_forgotten():
    engine = _engine()
    engine.add_request("c", [256, 9], SamplingParams(max_tokens=120, temperature=0.0, grammar=_json(PERSON)))
    engine.step()
    engine.cancel("c")
    out = _finish(engine)["c"]
    assert out.finish_reason == "cancelled" and out.schema_valid is False and len(engine.structured) == 0


def test_speculative_decoding_leaves_constrained_requests_out():
    def run(**kw):
        engine = _engine(**kw)
        proposed_for = set()
        if engine.proposer is not None:
            propose = engine.proposer.propose

            def spy(request, max_tokens):
                proposed_for.add(request.request_id)
                return propose(request, max_tokens)

            engine.proposer.propose = spy
        for i in range(4):
            engine.add_request(f"c{i}", [256] + [97, 98] * 20, SamplingParams(max_tokens=80, temperature=0.0,
                                                                              grammar=_json(SCHEMAS[i][1])))
            engine.add_request(f"f{i}", [256] + [97, 98] * 20, SamplingParams(max_tokens=30, temperature=0.0))
        return {k: o.output_token_ids for k, o in _finish(engine).items()}, proposed_for

    plain, _ = run()
    # The fixed policy proposes whatever the measured step costs say, so the test does not depend
    # on how fast this machine runs the tiny model.
    spec, proposed_for = run(speculative="ngram", num_speculative_tokens=3, speculative_policy="fixed")
    assert spec == plain
    assert proposed_for and all(rid.startswith("f") for rid in proposed_for)


BAD = [
    (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
                 "$.response_format.json_schema.schema"), "the JSON schema cannot be compiled: "),
    (GrammarSpec("json_schema", json.dumps({"type": "strnig"}), "$.response_format.json_schema.schema"),
     "the JSON schema cannot be compiled: "),
    (GrammarSpec("regex", "[a-z", "$.response_format.regex"), "the regex cannot be compiled: "),
    (GrammarSpec("lark", "start: undefined_rule", "$.response_format.grammar"), "the Lark grammar cannot be compiled"),
    (GrammarSpec("gbnf", "root ::= (", "$.response_format.grammar"), "the GBNF grammar cannot be compiled"),
    (GrammarSpec("json_schema", json.dumps({"enum": ["x" * 1000] * 300}), "$.body.response_format.json_schema.schema"),
     f"over the limit of {MAX_GRAMMAR_BYTES} bytes"),
]


@pytest.mark.parametrize(("spec", "text"), BAD, ids=["ref", "type", "regex", "lark", "gbnf", "too-large"])
def test_a_grammar_that_cannot_be_used_is_an_error_naming_the_field(spec, text):
    engine = _engine()
    for attempt in range(2):
        with pytest.raises(EngineInputError) as info:
            engine.add_request(f"bad{attempt}", [256, 1], SamplingParams(grammar=spec))
        assert info.value.code == "invalid_response_format"
        assert text in info.value.message and info.value.message.endswith(f" - at `{spec.path}`")
        assert "\n" not in info.value.message
    assert not engine.has_unfinished() and len(engine.structured) == 0
    assert (engine.structured.compiler.misses, engine.structured.compiler.hits) == (1, 1)  # failures are cached


def test_compiled_grammars_are_kept_least_recently_used_first_out():
    compiler = GrammarCompiler(build_tokenizer(ByteTokenizer(), 264, [EOS]), capacity=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.matcher(a)
    compiler.matcher(b)
    assert first.consume_token(ord("a")) and not first.is_error()
    second = compiler.matcher(a)  # a copy in the initial state, not the one that consumed "a"
    assert not second.is_accepting() and not second.consume_token(ord("b"))
    compiler.matcher(c)  # evicts b, the least recently used
    assert len(compiler) == 2 and (compiler.hits, compiler.misses) == (1, 3)
    compiler.matcher(a)
    compiler.matcher(b)
    assert (compiler.hits, compiler.misses) == (2, 4)
    with pytest.raises(ValueError):
        GrammarCompiler(compiler.tokenizer, capacity=0)


def test_a_model_without_a_tokenizer_refuses_grammars(tmp_path):
    from mqinfer.workers.engine.loader import save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / "tiny")  # a checkpoint folder without tokenizer.json
    engine = LLMEngine(EngineConfig(model=str(folder), num_threads=1, num_kv_blocks=64))
    assert engine.tokenizer is None and engine.structured is None
    with pytest.raises(EngineInputError) as info:
        engine.add_request("x", [256, 1], SamplingParams(grammar=_json(PERSON)))
    assert info.value.code == "invalid_response_format" and "has no tokenizer" in info.value.message


def test_a_gguf_models_tokenizer_drives_the_masks(tmp_path, make_hf_checkpoint):
    """A byte-level BPE vocabulary rebuilt from a GGUF file's metadata: JSON text it tokenizes is
    accepted token by token, and generation with it validates."""
    from mqinfer.workers.engine.tokenizer import load_tokenizer
    from tests.workers.gguf_files import byte_level_vocab, write_gguf

    vocab = byte_level_vocab(300)
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=5, vocab_size=len(vocab["tokens"]))
    state = {k: v for k, v in model.state_dict().items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    path = write_gguf(tmp_path / "m.gguf", "llama", model.config.to_dict(), state, "F32", vocab)
    tok = load_tokenizer(path)
    compiler = GrammarCompiler(build_tokenizer(tok, 300, [tok.eos_token_id]))
    matcher = compiler.matcher(_json(PERSON))
    text = '{"name": "sea shells", "age": 36}'
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) and matcher.consume_tokens(ids) and matcher.is_accepting()

    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_threads=1, num_kv_blocks=512))
    schemas = dict(SCHEMAS)
    for i, (name, schema) in enumerate(SCHEMAS[:12]):
        engine.add_request(name, engine.encode_prompt("Give JSON", None, None),
                           SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 1.0, seed=i, grammar=_json(schema)))
    outs = _finish(engine)
    assert sum(o.finish_reason == "stop" for o in outs.values()) >= 6
    for rid, o in outs.items():
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schemas[rid])
        assert o.schema_valid is (o.finish_reason == "stop")


def test_logprobs_stay_those_of_the_raw_distribution():
    engine = _engine()
    engine.add_request("lp", [256, 3], SamplingParams(max_tokens=120, temperature=0.0, logprobs=2,
                                                      grammar=_json(PERSON)))
    out = _finish(engine)["lp"]
    assert out.schema_valid and len(out.logprobs) == len(out.output_token_ids)
    assert [e["token_id"] for e in out.logprobs] == out.output_token_ids
    assert all(e["logprob"] > float("-inf") for e in out.logprobs)
    # The mask chose tokens the raw model did not rank first.
    assert any(e["top_token_ids"][0] != e["token_id"] for e in out.logprobs)
