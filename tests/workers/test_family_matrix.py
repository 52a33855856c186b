"""Greedy equivalence with transformers for every model family after preemption (recompute and
swap) and with prefix-cache hits.

Each family is a tiny random float32 checkpoint built once per module, with the trait that sets
it apart switched on: Qwen2 attention biases and tied embeddings, Qwen3 q/k norms and a head
dimension that is not hidden_size / num_heads, Mistral a sliding_window in its config (the engine
runs it only with max_model_len inside the window, where attention sees the whole context). The
same prompts and transformers' outputs serve all three cases of a family.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
from safetensors import safe_open

from mqinfer.scheduler.request import RequestStatus, SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

transformers = pytest.importorskip("transformers")

NUM_NEW = 20
SHARED_PREFIX_LEN = 48  # three 16-token blocks
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)

# Per family: config overrides for the checkpoint and settings the engine needs for it.
FAMILIES = {
    "llama": ({}, {}),
    "qwen2": ({"tie_word_embeddings": True}, {}),
    "qwen3": ({"head_dim": 32}, {}),
    "mistral": ({"sliding_window": 128}, {"max_model_len": 128}),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _prompts(vocab: int) -> list[list[int]]:
    """Eight prompts; 0, 2, 4 and 6 start with the same 48 tokens. Prompt 0 is 65 tokens, so that
    a repeat of it finds all but its last token in the cache."""
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(SHARED_PREFIX_LEN)]
    prompts = []
    for i in range(8):
        if i % 2 == 0:
            tail_len = 17 if i == 0 else rng.randint(1, 14)
            prompts.append(shared + [rng.randrange(3, vocab) for _ in range(tail_len)])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(8, 60))])
    return prompts


class Family(NamedTuple):
    name: str
    folder: str
    engine_settings: dict
    prompts: list[list[int]]
    # Per prompt: transformers' greedy tokens and their logprobs.
    reference: list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, make_hf_checkpoint, hf_greedy) -> Family:
    name = request.param
    overrides, engine_settings = FAMILIES[name]
    folder = tmp_path_factory.mktemp(name)
    model = make_hf_checkpoint(name, folder, seed=7, **overrides)
    prompts = _prompts(model.config.vocab_size)
    reference = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    return Family(name, str(folder), engine_settings, prompts, reference)


def _engine(family: Family, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=family.folder, dtype="float32", num_threads=1,
                                  **family.engine_settings, **settings))


def _run(engine: LLMEngine, requests: dict[str, list[int]]):
    """Run requests to the end: their final outputs, the tokens recomputed after a preemption,
    and the ids of requests preempted once they had generated tokens (mid-decode)."""
    live = {}
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, GREEDY)
        live[rid] = engine.scheduler.get_request(rid)
    seen = {rid: (0, 0) for rid in requests}  # (preemptions, output tokens) after the last step
    finished, recomputed, mid_decode, steps = {}, 0, set(), 0
    while engine.has_unfinished():
        result = engine.step()
        steps += 1
        assert steps < 5000
        recomputed += sum(w.num_recomputed_tokens for w in result.work)
        for out in result.outputs:
            if out.finished:
                finished[out.request_id] = out
        for rid, req in live.items():
            preemptions, tokens_before = seen[rid]
            if req.num_preemptions > preemptions and tokens_before > 0:
                mid_decode.add(rid)
            seen[rid] = (req.num_preemptions, req.num_output_tokens)
    assert set(finished) == set(requests)
    assert all(req.status is RequestStatus.FINISHED_LENGTH for req in live.values())
    return finished, recomputed, mid_decode


def _check(family: Family, finished, prompt_index: dict[str, int]):
    name = family.name
    for rid, i in prompt_index.items():
        out = finished[rid]
        tokens, logprobs = family.reference[i]
        assert out.finish_reason == "length"
        assert out.num_prompt_tokens == len(family.prompts[i])
        assert out.output_token_ids == tokens, f"{name} {rid} (prompt {i})"
        got = [entry["logprob"] for entry in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4, f"{name} {rid} (prompt {i})"


def _all(family: Family) -> dict[str, int]:
    return {f"r{i}": i for i in range(len(family.prompts))}


def test_each_checkpoint_has_its_family_trait(family):
    name = family.name
    engine = _engine(family, num_kv_blocks=8)
    info, model = engine.info, engine.model
    assert info.architecture == ARCHITECTURES[name]
    with safe_open(f"{family.folder}/model.safetensors", "pt") as f:
        tensors = set(f.keys())
    biases = {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"}
    qk_norms = {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}
    assert (biases <= tensors) == (name == "qwen2")
    assert (qk_norms <= tensors) == (name == "qwen3")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "qwen2")
    assert info.head_dim == (32 if name == "qwen3" else 16)
    assert info.sliding_window == (128 if name == "mistral" else None)


def test_recompute_preemption_matches_transformers(family):
    # 24 blocks of 4 tokens for eight requests of up to 85 tokens; no prefix cache, so a
    # preempted request's KV is computed again in full.
    engine = _engine(family, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    index = _all(family)
    finished, recomputed, mid_decode = _run(engine, {rid: family.prompts[i] for rid, i in index.items()})
    _check(family, finished, index)
    preemptions = engine.scheduler.num_preemptions_total
    assert preemptions > 0 and sum(o.num_preemptions for o in finished.values()) == preemptions
    assert engine.scheduler.num_swaps_total == 0
    assert mid_decode and recomputed > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_swap_preemption_matches_transformers(family):
    # The same tiny device cache, with host swap space for far more blocks than it holds.
    engine = _engine(family, num_kv_blocks=24, block_size=4, preemption_mode="swap", swap_space_gib=0.01)
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_swap_blocks > kv.num_blocks
    index = _all(family)
    finished, recomputed, mid_decode = _run(engine, {rid: family.prompts[i] for rid, i in index.items()})
    _check(family, finished, index)
    swaps = engine.scheduler.num_swaps_total
    # The host pool never filled up: every preemption kept its KV and nothing was recomputed.
    assert swaps > 0 and swaps == engine.scheduler.num_preemptions_total
    assert sum(o.num_swaps for o in finished.values()) == swaps
    assert mid_decode and recomputed == 0
    assert kv.num_free_swap_blocks == kv.num_swap_blocks and kv.num_free_blocks == kv.num_blocks


def test_prefix_cache_hits_match_transformers(family):
    prompts = family.prompts
    engine = _engine(family, num_kv_blocks=64, block_size=16)
    first, _, _ = _run(engine, {"r0": prompts[0]})
    _check(family, first, {"r0": 0})
    assert first["r0"].num_cached_tokens == 0
    # After r0 finished: the other prompts, and prompt 0 again, in one batch.
    index = {f"r{i}": i for i in range(1, len(prompts))} | {"again": 0}
    finished, _, _ = _run(engine, {rid: prompts[i] for rid, i in index.items()})
    _check(family, finished, index)
    cached = {rid: out.num_cached_tokens for rid, out in finished.items()}
    # The shared prefix is three full blocks; the repeat finds all of prompt 0's four full blocks
    # (64 of its 65 tokens) and computes only the last token.
    assert cached == {"r1": 0, "r2": 48, "r3": 0, "r4": 48, "r5": 0, "r6": 48, "r7": 0, "again": 64}
