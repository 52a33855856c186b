"""The OpenAI sampling parameters in the engine: presence, frequency and repetition penalties, logit
bias and min_tokens (against transformers' generate and a plain PyTorch reference loop), and n
choices (each seeded independently, the prompt computed once and shared through the prefix cache);
greedy and seeded sampling the same alone and in any batch."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from mqinfer.kernels.sampling import choice_seed, random_uniforms
from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas.request import decode_request, to_sampling_kwargs
from mqinfer.schemas.response_format import GrammarSpec
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.engine.outputs import choice_id

HF_EOS = 2


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory, make_hf_checkpoint):
    """A tiny random Llama (vocab 300, EOS 2) saved by transformers, and the transformers model."""
    folder = tmp_path_factory.mktemp("llama")
    return str(folder), make_hf_checkpoint("llama", folder, seed=1)


@pytest.fixture(scope="module")
def tiny():
    engine = LLMEngine(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=1024))
    yield engine
    engine.close()


def _engine(model: str = "tiny", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_threads=1, **{"num_kv_blocks": 512, **kw}))


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]):
    """Add the requests, step to the end; (finished outputs by (request id, index), the step work)."""
    for rid, prompt, sampling in requests:
        engine.add_request(rid, prompt, sampling)
    finished, work = {}, []
    steps = 0
    while engine.has_unfinished():
        result = engine.step()
        work.extend(result.work)
        steps += 1
        assert steps < 5000
        for out in result.outputs:
            if out.finished:
                key = (out.request_id, out.index)
                assert key not in finished
                finished[key] = out
    assert not engine.has_unfinished() and not engine.processors._states and not engine.outputs.choices
    return finished, work


def _prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- penalties, bias and min_tokens against references ------------------------------------------


def _hf_generate(model, prompt, n, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_bias_and_min_tokens_match_transformers_generate(small_llama, penalty):
    folder, model = small_llama
    engine = _engine(folder)
    try:
        prompts = [_prompt(i, 5 + 7 * i, 300) for i in range(4)]
        # A bias towards EOS makes it come early; min_tokens holds it back until the 5th token.
        bias = {HF_EOS: 6.0, 17: 3.0, 40: -50.0}
        sampling = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=penalty, min_tokens=5,
                                  logit_bias=tuple(sorted(bias.items())))
        finished, _ = _run(engine, [(f"p{i}", p, sampling) for i, p in enumerate(prompts)])
        for i, prompt in enumerate(prompts):
            expected = _hf_generate(model, prompt, 16, repetition_penalty=penalty, min_new_tokens=5,
                                    sequence_bias={(t,): b for t, b in bias.items()})
            got = finished[(f"p{i}", 0)].output_token_ids
            assert got == expected
            assert HF_EOS not in got[:5]
        assert any(finished[(f"p{i}", 0)].finish_reason == "stop" for i in range(4))  # EOS did end some
    finally:
        engine.close()


def _reference_tokens(model, prompt, n, *, presence, frequency, repetition=1.0, temperature=0.0, seed=0):
    """Plain PyTorch: the whole sequence through transformers each step, OpenAI's penalty formula
    on the last logits, then argmax (greedy) or Gumbel-max over the engine's seeded uniforms."""
    tokens: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        logits = logits.clone()  # out of inference mode, to change it in place
        for t in set(prompt + tokens):
            if repetition != 1.0:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(tokens):
            logits[t] -= frequency * tokens.count(t) + presence
        if temperature == 0.0:
            token = int(torch.argmax(logits))
        else:
            u = random_uniforms(torch.tensor([seed]), torch.tensor([len(prompt) + len(tokens)]), logits.shape[0])[0]
            token = int(torch.argmax(logits / temperature - torch.log(-torch.log(u))))
        tokens.append(token)
        if token == HF_EOS:
            break
    return tokens


@pytest.mark.parametrize(("presence", "frequency", "repetition", "temperature"), [
    (1.5, 0.0, 1.0, 0.0), (0.0, 2.0, 1.0, 0.0), (-0.5, 0.7, 1.2, 0.0), (0.8, 0.4, 1.0, 0.9),
])
def test_presence_and_frequency_penalties_match_a_plain_reference(small_llama, presence, frequency, repetition,
                                                                   temperature):
    folder, model = small_llama
    engine = _engine(folder)
    try:
        prompts = [_prompt(10 + i, 4 + 9 * i, 300) for i in range(3)]
        sampling = SamplingParams(max_tokens=14, temperature=temperature, seed=11, presence_penalty=presence,
                                  frequency_penalty=frequency, repetition_penalty=repetition)
        finished, _ = _run(engine, [(f"q{i}", p, sampling) for i, p in enumerate(prompts)])
        for i, prompt in enumerate(prompts):
            expected = _reference_tokens(model, prompt, 14, presence=presence, frequency=frequency,
                                         repetition=repetition, temperature=temperature, seed=11)
            assert finished[(f"q{i}", 0)].output_token_ids == expected
    finally:
        engine.close()


def test_a_large_positive_bias_forces_its_token_under_greedy(tiny):
    prompt = _prompt(1, 30)
    finished, _ = _run(tiny, [
        ("forced", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((65, 100.0),))),
        ("banned", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
    ])
    assert finished[("forced", 0)].output_token_ids == [65] * 6
    plain = finished[("banned", 0)].output_token_ids
    # -100 on the greedy choice makes greedy take another token there.
    first = plain[0]
    finished, _ = _run(tiny, [("avoid", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                               logit_bias=((first, -100.0),)))])
    assert first not in finished[("avoid", 0)].output_token_ids


def test_min_tokens_holds_back_eos_and_stop_tokens(tiny):
    eos = next(iter(tiny.eos_token_ids))
    prompt = _prompt(2, 12)
    finished, _ = _run(tiny, [
        ("eos", prompt, SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5, logit_bias=((eos, 100.0),))),
        ("stop", prompt, SamplingParams(max_tokens=20, temperature=0.7, seed=3, min_tokens=4,
                                        stop_token_ids=(70,), logit_bias=((70, 100.0),))),
        ("none", prompt, SamplingParams(max_tokens=20, temperature=0.0, logit_bias=((eos, 100.0),))),
    ])
    out = finished[("eos", 0)]
    assert len(out.output_token_ids) == 6 and out.output_token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.output_token_ids[:5]
    out = finished[("stop", 0)]
    assert out.output_token_ids[4] == 70 and 70 not in out.output_token_ids[:4] and out.finish_reason == "stop"
    assert finished[("none", 0)].output_token_ids == [eos]


def test_logprobs_stay_those_of_the_raw_distribution(tiny):
    prompt = _prompt(3, 20)
    finished, _ = _run(tiny, [
        ("plain", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True)),
        ("biased", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True,
                                          logit_bias=((65, 100.0),), repetition_penalty=1.5)),
    ])
    plain, biased = finished[("plain", 0)].logprobs[0], finished[("biased", 0)].logprobs[0]
    assert finished[("biased", 0)].output_token_ids == [65]
    assert biased["top_token_ids"] == plain["top_token_ids"]
    assert biased["top_logprobs"] == pytest.approx(plain["top_logprobs"], rel=1e-5)
    assert biased["logprob"] < plain["logprob"]  # 65 was not the model's own choice


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_naming_the_field(tiny):
    vocab = tiny.info.vocab_size
    for line, path in (({"id": "n", "prompt": "x", "logit_bias": {str(vocab): 1}}, "`$.logit_bias`"),
                       ({"custom_id": "o", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "x", "logit_bias": {str(vocab + 5): -1}}}, "`$.body.logit_bias`")):
        req = decode_request(json.dumps(line))
        with pytest.raises(EngineInputError) as info:
            tiny.add_request(req.id, [1, 2, 3], SamplingParams(**to_sampling_kwargs(req)))
        assert info.value.code == "invalid_token_id" and path in info.value.message
        assert f"token id {vocab}" in info.value.message or f"token id {vocab + 5}" in info.value.message
    assert not tiny.has_unfinished()


def _mixed_batch(prompt_seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests of every kind to share a batch with the request under test."""
    rng = random.Random(prompt_seed)
    kinds = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.1, seed=4, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.6, seed=5, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.4, logit_bias=((9, 4.0),)),
        SamplingParams(max_tokens=8, temperature=0.9, seed=6, n=3, min_tokens=3),
    ]
    return [(f"other{i}", _prompt(rng.randrange(1000), rng.randint(3, 50)), kinds[i % len(kinds)])
            for i in range(12)]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.2, frequency_penalty=0.4, repetition_penalty=1.3,
                   logit_bias=((20, 3.0), (21, -3.0)), min_tokens=6),
    SamplingParams(max_tokens=12, temperature=0.8, seed=123, presence_penalty=-0.5, frequency_penalty=1.1,
                   repetition_penalty=0.9, logit_bias=((30, 2.0),), min_tokens=4, top_p=0.9),
    SamplingParams(max_tokens=10, temperature=0.7, seed=99, n=4, repetition_penalty=1.2),
])
def test_the_same_tokens_alone_and_in_any_batch(tiny, sampling):
    prompt = _prompt(7, 35)
    alone, _ = _run(tiny, [("x", prompt, sampling)])
    for batch_seed in (1, 2):
        batch = _mixed_batch(batch_seed)
        at = batch_seed * 3  # somewhere in the middle of the batch
        together, _ = _run(tiny, batch[:at] + [("x", prompt, sampling)] + batch[at:])
        for index in range(sampling.n):
            assert together[("x", index)].output_token_ids == alone[("x", index)].output_token_ids


def test_penalties_together_with_a_grammar_still_follow_the_schema(tiny):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}
    sampling = SamplingParams(max_tokens=60, temperature=0.9, seed=8, n=3, repetition_penalty=1.3,
                              presence_penalty=0.5, logit_bias=((ord("7"), 5.0),),
                              grammar=GrammarSpec("json_schema", json.dumps(schema)))
    finished, _ = _run(tiny, [("g", _prompt(8, 10), sampling)])
    for index in range(3):
        out = finished[("g", index)]
        assert out.finish_reason == "stop" and out.schema_valid is True
        jsonschema.validate(json.loads(out.text), schema)


def test_penalised_requests_stay_out_of_speculation_and_bias_and_min_tokens_keep_their_tokens():
    base = _engine()
    spec = _engine(speculative="ngram", num_speculative_tokens=3, speculative_policy="fixed")
    try:
        prompt = [40, 41, 42, 43] * 6  # repetitive: the n-gram proposer has plenty to propose
        requests = [
            ("pen", prompt, SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)),
            ("bias", prompt, SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((41, 4.0),), ignore_eos=True)),
            ("min", prompt, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6)),
        ]
        expected, _ = _run(base, requests)
        got, _ = _run(spec, requests)
        for key in expected:
            assert got[key].output_token_ids == expected[key].output_token_ids
        assert got[("pen", 0)].num_rejected_tokens == 0
        assert spec.spec_stats.proposed_tokens > 0  # the other two did speculate
    finally:
        base.close()
        spec.close()


# -- n choices ----------------------------------------------------------------------------------


def test_n_choices_share_the_prompt_and_are_seeded_independently(tiny):
    prompt = _prompt(20, 45)  # two full blocks of 16 and a partial one
    bs = tiny.config.block_size
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=42, n=4, ignore_eos=True)
    hits_before = tiny.scheduler.prefix_cache_hits
    finished, work = _run(tiny, [("c", prompt, seeded)])
    outs = [finished[("c", i)] for i in range(4)]
    assert [o.index for o in outs] == [0, 1, 2, 3] and all(o.request_id == "c" for o in outs)
    assert len({tuple(o.output_token_ids) for o in outs}) == 4  # independent samples
    # The prompt is computed once: the other choices take its full blocks from the prefix cache and
    # compute only its last, partial block.
    shared = (len(prompt) - 1) // bs * bs
    assert [o.num_cached_tokens for o in outs] == [0, shared, shared, shared]
    assert tiny.scheduler.prefix_cache_hits - hits_before == 3 * shared
    prefill = {}
    for w in work:
        if w.is_prefill:
            prefill[w.request_id] = prefill.get(w.request_id, 0) + w.num_tokens
    assert prefill == {"c": len(prompt), **{choice_id("c", i): len(prompt) - shared for i in (1, 2, 3)}}
    # Choice 0 is the request as n = 1 samples it; choice i samples with the seed derived from (42, i).
    single, _ = _run(tiny, [("one", prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=42, ignore_eos=True))])
    assert single[("one", 0)].output_token_ids == outs[0].output_token_ids
    for i in (1, 2, 3):
        derived = SamplingParams(max_tokens=8, temperature=0.9, seed=choice_seed(42, i), ignore_eos=True)
        alone, _ = _run(tiny, [("d", prompt, derived)])
        assert alone[("d", 0)].output_token_ids == outs[i].output_token_ids
    # Without a seed each choice draws its own.
    unseeded, _ = _run(tiny, [("u", prompt, SamplingParams(max_tokens=8, temperature=1.0, n=3, ignore_eos=True))])
    assert len({tuple(unseeded[("u", i)].output_token_ids) for i in range(3)}) == 3


def test_choices_wait_for_the_first_to_compute_the_prompt_even_when_it_ends_at_once(tiny):
    prompt = _prompt(21, 40)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, n=3, ignore_eos=True)
    finished, _ = _run(tiny, [("short", prompt, sampling)])
    assert [finished[("short", i)].output_token_ids for i in range(3)] == [finished[("short", 0)].output_token_ids] * 3
    assert [finished[("short", i)].num_cached_tokens for i in range(3)] == [0, 32, 32]


def test_choices_survive_preemption_with_the_same_tokens():
    big = _engine(num_kv_blocks=512)
    small = _engine(num_kv_blocks=24, max_num_seqs=8)
    try:
        requests = [(f"p{i}", _prompt(30 + i, 20 + 10 * i), SamplingParams(max_tokens=40, temperature=0.8, seed=i,
                                                                           n=3, ignore_eos=True)) for i in range(3)]
        expected, _ = _run(big, requests)
        got, _ = _run(small, requests)
        assert small.scheduler.num_preemptions_total > 0
        assert {k: v.output_token_ids for k, v in got.items()} == {k: v.output_token_ids for k, v in expected.items()}
    finally:
        big.close()
        small.close()


def test_cancel_and_withdraw_end_every_choice(tiny):
    prompt = _prompt(22, 40)
    sampling = SamplingParams(max_tokens=30, temperature=0.0, n=3, ignore_eos=True)
    tiny.add_request("early", prompt, sampling)
    assert tiny.holds("early") and tiny.unstarted_request_ids() == ["early"]
    tiny.cancel("early")  # before any of them ran: the held choices end too
    outs = []
    while tiny.has_unfinished():
        outs.extend(tiny.step().outputs)
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "cancelled"), (1, "cancelled"), (2, "cancelled")]
    assert not tiny.holds("early")

    tiny.add_request("late", prompt, sampling)
    for _ in range(3):
        tiny.step()
    assert tiny.holds("late") and tiny.unstarted_request_ids() == []
    tiny.cancel("late")
    outs = []
    while tiny.has_unfinished():
        outs.extend(tiny.step().outputs)
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert {o.finish_reason for o in outs if o.finished} == {"cancelled"}

    tiny.add_request("gone", prompt, sampling)
    for _ in range(3):
        tiny.step()
    tiny.withdraw(["gone"])
    assert not tiny.has_unfinished() and not tiny.holds("gone") and not tiny.outputs.tracked
    tiny.add_request("gone", prompt, sampling)  # the id is free again
    tiny.withdraw(["gone"])
    assert not tiny.has_unfinished()


def test_a_choice_id_taken_by_another_request_is_refused(tiny):
    tiny.add_request(choice_id("taken", 2), [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in the engine"):
        tiny.add_request("taken", [5, 6, 7], SamplingParams(max_tokens=2, n=3))
    tiny.withdraw([choice_id("taken", 2)])
    assert not tiny.has_unfinished()


def test_each_choice_of_a_structured_request_validates(tiny):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    sampling = SamplingParams(max_tokens=30, temperature=1.0, seed=2, n=5,
                              grammar=GrammarSpec("json_schema", json.dumps(schema)))
    finished, _ = _run(tiny, [("s", _prompt(23, 18), sampling)])
    for i in range(5):
        assert finished[("s", i)].schema_valid is True
        jsonschema.validate(json.loads(finished[("s", i)].text), schema)


def test_without_prefix_caching_every_choice_computes_the_prompt_at_once():
    engine = _engine(enable_prefix_caching=False)
    cached = _engine()
    try:
        prompt = _prompt(24, 40)
        sampling = SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=3, ignore_eos=True)
        finished, work = _run(engine, [("p", prompt, sampling)])
        first = [w for w in work if w.is_prefill]
        assert sorted(w.request_id for w in first) == sorted(choice_id("p", i) for i in range(3))
        assert all(w.num_tokens == len(prompt) for w in first)
        with_cache, _ = _run(cached, [("p", prompt, sampling)])
        assert {k: v.output_token_ids for k, v in finished.items()} == {
            k: v.output_token_ids for k, v in with_cache.items()}
    finally:
        engine.close()
        cached.close()
