"""Tensor parallelism on CPU: two gloo ranks (one thread each) against one rank.

Greedy float32 output must be token for token the same as one rank's, on a Llama (grouped-query
attention, 2 KV heads: one per rank) and a Qwen2 (q/k/v biases, tied embeddings, one KV head:
replicated on both ranks), with chunked prefill, preemption (recompute and swap) and prefix-cache
hits; seeded sampling must draw the same tokens. Each rank reads only its slices of the weights,
and its KV cache holds only its KV heads.
"""

from __future__ import annotations

import random

import pytest
import torch

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine import LLMEngine
from mqinfer.workers.loader import load_model
from mqinfer.workers.models.config import ModelConfig, ModelLoadError
from mqinfer.workers.parallel import Shard, read_safetensors_shard

NUM_NEW = 10


def _prompts(vocab: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(n):
        if i % 3 == 0:  # a shared 40-token prefix: prefix-cache hits for the later ones
            prompts.append(shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))])
    return prompts


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, object]:
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=NUM_NEW, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampled if i % 4 == 3 else greedy)
    finished = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out
    assert len(finished) == len(prompts)
    return finished


def _run(folder, tp: int, **settings):
    config = EngineConfig(model=str(folder), device="cpu", num_threads=1, tensor_parallel_size=tp,
                          **{"num_kv_blocks": 256, **settings})
    engine = LLMEngine(config)
    try:
        results = _generate(engine, _prompts(engine.info.vocab_size))
        kv_bytes = engine.runner.kv_cache_bytes
        preemptions = engine.scheduler.num_preemptions_total
    finally:
        engine.close()
    return results, kv_bytes, preemptions


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("tp-llama")
    make_hf_checkpoint("llama", folder, seed=1, intermediate_size=192)
    return folder


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("tp-qwen2")
    make_hf_checkpoint("qwen2", folder, seed=2, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=301)
    return folder


CASES = {
    # chunked prefill (a 24-token budget), prefix hits, and preemption by recompute in a small cache
    "chunked-recompute": {"max_num_batched_tokens": 24, "max_num_seqs": 6, "num_kv_blocks": 14, "block_size": 8},
    # preemption by swapping KV blocks to host memory and back
    "swap": {"max_num_seqs": 8, "num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap",
             "swap_space_gib": 0.01},
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("tp-qwen3")
    make_hf_checkpoint("qwen3", folder, seed=3, head_dim=16)
    return folder


CASES["int8-kv"] = {**CASES["chunked-recompute"], "kv_cache_dtype": "int8"}


@pytest.mark.parametrize("family,case", [
    ("llama", "chunked-recompute"),
    ("qwen2", "swap"),
    pytest.param("qwen3", "int8-kv", marks=pytest.mark.slow),  # q/k norms, an 8-bit KV cache with its scales
])
def test_two_ranks_generate_what_one_rank_does(request, family, case):
    folder = request.getfixturevalue(family)
    one, kv_one, preempted_one = _run(folder, 1, **CASES[case])
    two, kv_two, preempted_two = _run(folder, 2, **CASES[case])
    assert preempted_one > 0 and preempted_two == preempted_one
    assert sum(o.num_cached_tokens for o in one.values()) > 0  # prefix hits happened
    for rid, out in one.items():
        assert two[rid].output_token_ids == out.output_token_ids, rid
        assert two[rid].num_cached_tokens == out.num_cached_tokens
        if out.logprobs:
            assert [e["token_id"] for e in two[rid].logprobs] == [e["token_id"] for e in out.logprobs]
            assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(two[rid].logprobs, out.logprobs)) < 1e-4
    # Two KV heads: one per rank, half the cache each. Qwen2's one KV head: replicated.
    assert kv_two == (kv_one if family == "qwen2" else kv_one // 2)


def test_the_split_of_heads_kv_heads_mlp_and_vocabulary():
    def config(heads, kv_heads, inter=256, vocab=300):
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=inter,
                           num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                           max_position_embeddings=64)

    # KV heads at least T: each rank its own 1/T of them.
    shards = [Shard.of(config(8, 4), r, 2) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 4)]
    assert [s.intermediate for s in shards] == [(0, 128), (128, 256)]
    assert [s.vocab for s in shards] == [(0, 150), (150, 300)]
    # Fewer KV heads than ranks: each rank holds the one KV head its query heads read.
    shards = [Shard.of(config(8, 2, vocab=301), r, 4) for r in range(4)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.vocab for s in shards] == [(0, 76), (76, 152), (152, 228), (228, 301)]
    for heads, kv_heads, inter, t, problem in [(6, 2, 256, 4, "divide the 6 attention heads"),
                                               (12, 4, 256, 6, "multiple of the 4 KV heads"),
                                               (12, 6, 256, 4, "divide the 6 KV heads"),
                                               (8, 8, 100, 8, "MLP width 100")]:
        with pytest.raises(ModelLoadError, match=problem):
            Shard.of(config(heads, kv_heads, inter), 0, t)


def test_each_rank_reads_only_its_slices(llama, monkeypatch):
    from safetensors import safe_open

    path = str(llama / "model.safetensors")
    with safe_open(path, framework="pt", device="cpu") as fh:
        whole = {name: fh.get_tensor(name) for name in fh.keys()}
    # Every byte read through a slice is counted: a rank must read half of each split tensor.
    read: list[int] = []
    real_safe_open = safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._fh = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            t = self._inner.get_tensor(name)
            read.append(t.numel())
            return t

        def get_slice(self, name):
            part = self._inner.get_slice(name)

            class Slice:
                def __getitem__(self, index):
                    t = part[index]
                    read.append(t.numel())
                    return t

                def __getattr__(self, attr):
                    return getattr(part, attr)

            return Slice()

    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    config = load_model(str(llama))[0].config
    parts = []
    for rank in range(2):
        read.clear()
        parts.append(dict(read_safetensors_shard(path, Shard.of(config, rank, 2))))
        split = [n for n in whole if not n.endswith(("norm.weight", "embed_tokens.weight"))]
        replicated = sum(whole[n].numel() for n in whole if n not in split)
        assert sum(read) == replicated + sum(whole[n].numel() for n in split) // 2
    for name, tensor in whole.items():
        a, b = parts[0][name], parts[1][name]
        if "q_proj" in name or "k_proj" in name or "v_proj" in name or "gate_proj" in name or "up_proj" in name \
                or name == "lm_head.weight":
            assert a.shape[0] == tensor.shape[0] // 2 and torch.equal(torch.cat([a, b]), tensor)
        elif "o_proj" in name or "down_proj" in name:
            assert a.shape[1] == tensor.shape[1] // 2 and torch.equal(torch.cat([a, b], dim=1), tensor)
        else:
            assert torch.equal(a, tensor) and torch.equal(b, tensor)
    # A model loaded as rank 1 of 2 holds its half of each projection.
    model, info = load_model(str(llama), shard=(1, 2))
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert model.lm_head.weight.shape[0] == info.vocab_size // 2
    assert info.num_heads == 4 and info.num_params == sum(t.numel() for t in whole.values())


def test_a_rank_that_dies_while_starting_fails_the_start_at_once():
    import time

    from mqinfer.workers.parallel import Leader, RankFailure

    # Rank 1 is sent to a CUDA device no machine has: it exits before it joins.
    began = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with code 1"):
        Leader(["cpu", "cuda:999"])
    assert time.monotonic() - began < 300  # well before the rendezvous timeout (900 s)


def test_two_ranks_check_speculative_proposals_as_one_rank_generates(llama):
    # Proposals ride in the step plan like any other query tokens; only rank 0 accepts them.
    one, _, _ = _run(llama, 1, **CASES["chunked-recompute"])
    config = EngineConfig(model=str(llama), device="cpu", num_threads=1, tensor_parallel_size=2,
                          speculative="ngram", ngram_min=1, speculative_policy="fixed", **CASES["chunked-recompute"])
    engine = LLMEngine(config)
    try:
        two = _generate(engine, _prompts(engine.info.vocab_size))
        stats = engine.spec_stats
    finally:
        engine.close()
    assert stats.accepted_tokens > 0, stats  # proposals were checked and some kept
    for rid, out in one.items():
        assert two[rid].output_token_ids == out.output_token_ids, rid


def test_a_layer_skip_draft_or_a_draft_model_is_refused_over_several_ranks():
    # The draft's forwards run on rank 0 alone, whose collectives the other ranks would not join.
    with pytest.raises(ValueError, match="--speculative self does not combine with --tensor-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="self")
    with pytest.raises(ValueError, match="--speculative draft does not combine with --tensor-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="draft", draft_model="tiny")
    EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="ngram")
