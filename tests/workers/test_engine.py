"""LLMEngine end to end: greedy generation token for token equal to transformers (alone, in
big batches, with chunked prefill, with preemption), logprobs, stop rules, cancellation,
seeded sampling and the bookkeeping the worker relies on."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.engine.loader import save_tiny_checkpoint
from tests.helpers import FakeClock

NUM_NEW = 10


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory, make_hf_checkpoint):
    """A tiny random Llama saved by transformers (float32) and the transformers model itself."""
    folder = tmp_path_factory.mktemp("llama")
    return str(folder), make_hf_checkpoint("llama", folder, seed=0)


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompts(vocab: int, seed: int = 0, n: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(n):
        length = rng.randint(2, 70)
        if i % 5 == 0:  # a shared 40-token prefix: prefix-cache hits for later ones
            prompts.append(shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_threads=1, **{"num_kv_blocks": 512, **kw}))


def _run(engine, prompts, sampling, ids=None):
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, sampling)
    finished, deltas = {}, {}
    steps = 0
    while engine.has_unfinished():
        result = engine.step()
        steps += 1
        assert steps < 10_000
        for out in result.outputs:
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert set(ids) <= set(finished)
    return finished, deltas


GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=3)


def _check_against_reference(results, prompts, reference):
    for i, prompt in enumerate(prompts):
        out = results[f"r{i}"]
        tokens, ref_logprobs = reference[i]
        assert out.output_token_ids == tokens, f"prompt {i} (length {len(prompt)})"
        assert out.finish_reason == "length"
        assert out.num_prompt_tokens == len(prompt)
        assert len(out.logprobs) == NUM_NEW
        for entry, ref in zip(out.logprobs, ref_logprobs):
            assert abs(entry["logprob"] - float(ref[entry["token_id"]])) < 1e-4
            top = ref.topk(3)
            assert entry["top_token_ids"] == top.indices.tolist()
            assert max(abs(a - b) for a, b in zip(entry["top_logprobs"], top.values.tolist())) < 1e-4


@pytest.fixture(scope="module")
def llama_reference(small_llama, hf_greedy_steps):
    _, hf_model = small_llama
    prompts = _prompts(300)
    return prompts, [hf_greedy_steps(hf_model, p, NUM_NEW) for p in prompts]


def test_greedy_alone_matches_transformers(small_llama, llama_reference):
    folder, _ = small_llama
    prompts, reference = llama_reference
    engine = _engine(folder)
    for i in range(0, len(prompts), 4):  # every fourth prompt, each alone
        results, _ = _run(engine, [prompts[i]], GREEDY, ids=["r0"])
        _check_against_reference(results, [prompts[i]], [reference[i]])


@pytest.mark.parametrize(
    "settings",
    [
        {},  # one batch of 32, full prompts at once
        {"max_num_batched_tokens": 32, "max_num_seqs": 8},  # chunked prefill, few seqs at once
        {"num_kv_blocks": 12, "block_size": 16},  # a tiny cache: preemption
        {"enable_prefix_caching": False, "block_size": 32},
    ],
    ids=["batch32", "chunked", "preempt", "no-prefix-cache"],
)
def test_greedy_batch_matches_transformers(small_llama, llama_reference, settings):
    folder, _ = small_llama
    prompts, reference = llama_reference
    engine = _engine(folder, **settings)
    results, _ = _run(engine, prompts, GREEDY)
    _check_against_reference(results, prompts, reference)
    preemptions = sum(o.num_preemptions for o in results.values())
    if "num_kv_blocks" in settings:
        assert preemptions > 0 and engine.scheduler.num_preemptions_total == preemptions
    if "max_num_seqs" in settings:
        # Admitted a few at a time, later prompts sharing the 40-token prefix found its two
        # full blocks cached.
        assert sum(o.num_cached_tokens for o in results.values()) >= 32
    assert engine.scheduler.num_running == 0 and not engine.has_unfinished()


def test_tiny_model_matches_transformers(tiny_reference, hf_greedy_steps):
    prompts = _prompts(256, seed=1, n=12)
    prompts = [[256, *p] for p in prompts]
    reference = [hf_greedy_steps(tiny_reference, p, NUM_NEW) for p in prompts]
    engine = LLMEngine(EngineConfig(num_threads=1, num_kv_blocks=64, max_num_batched_tokens=128, max_num_seqs=8))
    assert engine.info.name == "tiny"
    results, _ = _run(engine, prompts, GREEDY)
    _check_against_reference(results, prompts, reference)


@pytest.fixture(scope="module")
def tiny_engine_factory():
    def make(**kw):
        return LLMEngine(EngineConfig(num_threads=1, **{"num_kv_blocks": 128, **kw}))
    return make


def test_encode_prompt_and_input_errors(tiny_engine_factory, small_llama):
    engine = tiny_engine_factory(max_model_len=64)
    assert engine.max_model_len == 64
    assert engine.encode_prompt("hé", None, None) == [256, 104, 0xC3, 0xA9]
    chat = engine.encode_prompt(None, None, [{"role": "user", "content": "hi"}])
    assert chat == [256, *b"<|user|>\nhi\n<|assistant|>\n"]
    assert engine.encode_prompt(None, [5, 6], None) == [5, 6]

    def code(fn, *args, **kw):
        with pytest.raises(EngineInputError) as info:
            fn(*args, **kw)
        return info.value.code, info.value.message

    assert code(engine.encode_prompt, None, None, None)[0] == "invalid_request"
    assert code(engine.encode_prompt, "a", [1], None)[0] == "invalid_request"
    assert code(engine.encode_prompt, None, [1, 264], None) == (
        "invalid_token_id", "prompt_token_ids[1] = 264 is outside the vocabulary (0..263)")
    assert code(engine.encode_prompt, "x" * 63, None, None)[0] == "prompt_too_long"
    assert code(engine.encode_prompt, None, None, [{"role": "user"}])[0] == "invalid_request"
    assert code(engine.add_request, "a", [1] * 64, SamplingParams())[0] == "prompt_too_long"
    assert code(engine.add_request, "a", [-1], SamplingParams())[0] == "invalid_token_id"
    engine.add_request("a", [1] * 63, SamplingParams())
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [1], SamplingParams())

    no_tokenizer = _engine(small_llama[0])
    assert no_tokenizer.tokenizer is None
    c, message = code(no_tokenizer.encode_prompt, "hello", None, None)
    assert c == "invalid_request" and "tokenizer" in message
    c, message = code(no_tokenizer.add_request, "s", [5], SamplingParams(stop=("x",)))
    assert c == "invalid_request" and message.startswith("stop:")


def test_stop_strings_and_stop_tokens(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = engine.encode_prompt("Once upon a time", None, None)
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full, _ = _run(engine, [prompt], base)
    tokens, text = full["r0"].output_token_ids, full["r0"].text
    assert len(tokens) == 40 and text == engine.tokenizer.decode(tokens)

    # A stop token: generation ends at its first occurrence and its text is left out.
    stop_token = tokens[12]
    first = tokens.index(stop_token)
    res, _ = _run(engine, [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=(stop_token,)), ids=["t"])
    assert res["t"].output_token_ids == tokens[: first + 1]
    assert res["t"].finish_reason == "stop"
    assert res["t"].text == engine.tokenizer.decode(tokens[:first])

    # A stop string: the text ends right before it, the deltas add up to the final text.
    stop = text[20:23]
    res, deltas = _run(engine, [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                       stop=("never-there", stop)), ids=["s"])
    out = res["s"]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert "".join(o.new_text for o in deltas["s"]) == out.text
    assert len(out.output_token_ids) < 40
    assert engine.scheduler.get_request("s") is None and not engine.has_unfinished()


def test_seeded_sampling_same_alone_and_in_a_batch(tiny_engine_factory):
    sampling = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = [256, *b"seeded"]
    alone, _ = _run(tiny_engine_factory(), [prompt], sampling, ids=["x"])
    others = [[256, *b"other prompt %d" % i] for i in range(6)]
    engine = tiny_engine_factory()
    mixed_sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=None)
    for i, p in enumerate(others[:3]):
        engine.add_request(f"o{i}", p, mixed_sampling)
    res, _ = _run(engine, [prompt, *others[3:]], sampling, ids=["x", "o3", "o4", "o5"])
    assert res["x"].output_token_ids == alone["x"].output_token_ids
    # Unseeded requests draw their seeds from the engine seed: reproducible per engine seed.
    runs = []
    for _ in range(2):
        res, _ = _run(tiny_engine_factory(seed=7), others[:2], mixed_sampling, ids=["u0", "u1"])
        runs.append([res["u0"].output_token_ids, res["u1"].output_token_ids])
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_cancel_expire_and_too_big(tiny_engine_factory):
    clock = FakeClock(1000.0)
    engine = LLMEngine(EngineConfig(num_threads=1, num_kv_blocks=4, block_size=16), clock=clock)
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", [256, 1, 2, 3], sampling)
    engine.add_request("cancel", [256, 4, 5], sampling)
    engine.add_request("expire", [256, 6], sampling, deadline=1000.5)
    engine.add_request("huge", [7] * 65, sampling)  # 65 tokens > 4 blocks of 16
    first = {o.request_id: o for o in engine.step().outputs}
    assert first["huge"].finished and first["huge"].finish_reason == "error"
    assert first["huge"].error_code == "kv_cache_too_small"
    assert first["huge"].text is None and first["huge"].output_token_ids == []
    assert not first["keep"].finished and len(first["keep"].new_token_ids) == 1
    assert first["keep"].first_token_time == 1000.0
    engine.cancel("cancel")
    engine.cancel("unknown-id")  # ignored
    clock.now = 1001.0
    second = {o.request_id: o for o in engine.step().outputs}
    assert second["cancel"].finished and second["cancel"].finish_reason == "cancelled"
    assert second["expire"].finished and second["expire"].finish_reason == "expired"
    assert second["keep"].output_token_ids == first["keep"].new_token_ids + second["keep"].new_token_ids
    while engine.has_unfinished():
        engine.step()
    assert engine.free_capacity() == engine.scheduler_config.max_num_seqs


def test_step_work_and_capacity(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=16, max_num_seqs=4)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("long", [256] + [65] * 29, sampling)  # 30 tokens: two chunks of 16 + 14
    assert engine.free_capacity() == 3
    r1 = engine.step()
    assert [(w.request_id, w.num_tokens, w.context_len, w.is_prefill, w.sampled) for w in r1.work] == [
        ("long", 16, 16, True, False)]
    assert r1.outputs == [] and r1.start <= r1.end
    r2 = engine.step()
    assert [(w.num_tokens, w.context_len, w.is_prefill, w.sampled) for w in r2.work] == [(14, 30, True, True)]
    assert len(r2.outputs) == 1 and len(r2.outputs[0].new_token_ids) == 1
    r3 = engine.step()
    assert [(w.num_tokens, w.context_len, w.is_prefill, w.sampled, w.num_recomputed_tokens)
            for w in r3.work] == [(1, 31, False, True, 0)]
    # Profiling counters: every step counted; the forward ran in each, sampling only in 2 and 3.
    assert engine.num_steps == 3
    phases = engine.phase_seconds
    assert set(phases) == {"schedule", "prepare", "forward", "sample", "postprocess"}
    assert all(v >= 0 for v in phases.values()) and phases["forward"] > 0 and phases["sample"] > 0
    assert sum(phases.values()) <= sum(r.end - r.start for r in (r1, r2, r3)) + 0.05


def test_cumulative_outputs_grow_in_place_and_stay_fixed_once_finished(tiny_engine_factory):
    """``output_token_ids`` and ``logprobs`` are the engine's live lists, not per-step copies:
    each step's output of a request holds the same two lists, whose entries before this step's
    new tokens are exactly what earlier steps delivered (the worker's stream index), and a
    finished request's lists no longer change while others run on."""
    engine = tiny_engine_factory()
    for rid, n in (("short", 3), ("long", 9)):
        engine.add_request(rid, [256, *rid.encode()],
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2))
    first, delivered, final = {}, {"short": [], "long": []}, {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            rid = out.request_id
            index = len(out.output_token_ids) - len(out.new_token_ids)
            assert index == len(delivered[rid]) and out.output_token_ids[index:] == out.new_token_ids
            assert [entry["token_id"] for entry in out.logprobs] == out.output_token_ids
            delivered[rid] += out.new_token_ids
            seen = first.setdefault(rid, out)
            assert out.output_token_ids is seen.output_token_ids and out.logprobs is seen.logprobs
            if out.finished:
                final[rid] = (out, list(out.output_token_ids), list(out.logprobs))
    out, tokens, logprobs = final["short"]
    assert len(tokens) == 3 and len(final["long"][1]) == 9
    assert out.output_token_ids == tokens == delivered["short"] and out.logprobs == logprobs
    assert final["long"][0].output_token_ids == delivered["long"]


def test_model_runner_returns_tokens_logprobs_and_phase_times(tiny_engine_factory):
    """``execute()`` returns everything the step produced, aligned with the scheduled requests:
    None for a prompt chunk that samples nothing, logprobs only where asked (None as a whole
    when no request asked), and its own phase times."""
    engine = tiny_engine_factory(max_num_batched_tokens=16, max_num_seqs=4)
    scheduler, runner = engine.scheduler, engine.runner
    engine.add_request("plain", [256, 66, 67], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request("chunked", [256] + [65] * 29,
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1))
    steps = []
    for _ in range(3):
        scheduler_output = scheduler.schedule()
        ran = runner.execute(scheduler_output)
        steps.append(([sr.num_new_tokens for sr in scheduler_output.scheduled], ran))
        scheduler.update_from_output(scheduler_output, ran.sampled_token_ids)
    assert [lens for lens, _ in steps] == [[3, 13], [1, 15], [1, 2]]
    for _, ran in steps[:2]:
        assert ran.sampled_token_ids[1] is None and isinstance(ran.sampled_token_ids[0], int)
        assert ran.logprobs is None
    ran = steps[2][1]
    assert ran.logprobs[0] is None and len(ran.logprobs[1]) == 1  # one entry per emitted token
    entry = ran.logprobs[1][0]
    assert entry.token_id == ran.sampled_token_ids[1]
    # Greedy: the sampled token is the top one, with the top logprob.
    assert entry.top_token_ids == [entry.token_id] and entry.top_logprobs == [entry.logprob] and entry.logprob < 0
    plain = scheduler.get_request("plain")
    assert plain.output_token_ids == [ran.sampled_token_ids[0] for _, ran in steps]
    for _, ran in steps:
        prepare, forward, sample = ran.phase_seconds
        assert prepare >= 0 and forward > 0 and sample > 0

def test_recomputed_tokens_are_reported_after_preemption(small_llama):
    engine = _engine(small_llama[0], num_kv_blocks=6, block_size=16, enable_prefix_caching=False)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    recomputed = {}
    for i in range(3):
        engine.add_request(f"p{i}", [5 + i] * 20, sampling)
    while engine.has_unfinished():
        for w in engine.step().work:
            recomputed[w.request_id] = recomputed.get(w.request_id, 0) + w.num_recomputed_tokens
    assert engine.scheduler.num_preemptions_total > 0
    assert sum(recomputed.values()) > 0


def test_engine_config_and_model_limits(tmp_path, make_hf_checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int4")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds"):
        LLMEngine(EngineConfig(num_threads=1, max_model_len=4096))
    # The default KV cache holds max_num_seqs full contexts when memory allows.
    engine = LLMEngine(EngineConfig(num_threads=1, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    assert engine.scheduler_config.num_kv_blocks * engine.scheduler_config.block_size >= 4 * 256
    assert engine.free_capacity() == 4

    make_hf_checkpoint("mistral", tmp_path, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=256,
                       sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window attention \\(64 tokens\\).*max_model_len <= 64"):
        _engine(str(tmp_path))
    engine = _engine(str(tmp_path), max_model_len=64)
    assert engine.info.architecture == "MistralForCausalLM" and engine.max_model_len == 64


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_generate_like_transformers(tmp_path, family, make_hf_checkpoint, hf_greedy_steps):
    extra = {"qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32}, "mistral": {"sliding_window": None}}
    hf_model = make_hf_checkpoint(family, tmp_path, seed=1, **extra[family])
    prompts = _prompts(300, seed=2, n=8)
    reference = [hf_greedy_steps(hf_model, p, NUM_NEW) for p in prompts]
    engine = _engine(str(tmp_path), max_num_batched_tokens=64, max_num_seqs=8)
    results, _ = _run(engine, prompts, GREEDY)
    _check_against_reference(results, prompts, reference)
