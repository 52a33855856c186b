"""Tensor parallelism on CPU: two gloo ranks (one thread each) against one rank.

Greedy float32 output must be token for token the same as one rank's, on a Llama (grouped-query
attention, 2 KV heads: one per rank) and a Qwen2 (q/k/v biases, tied embeddings, one KV head:
replicated on both ranks), with chunked prefill, preemption (recompute and swap) and prefix-cache
hits; seeded sampling must draw the same tokens. Each rank reads only its slices of the weights,
and its KV cache holds only its KV heads.
"""

from __future__ import annotations

import pytest
import torch

from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.loader import load_model
from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError
from mqinfer.workers.engine.parallel import Shard, read_safetensors_shard
from tests.workers.parallel_helpers import (
    CASES, Outcome, assert_generates_what_one_rank_does, llama_checkpoint, qwen2_checkpoint, record_safetensors_reads,
    run_engine,
)

NUM_NEW = 10
NUM_PROMPTS = 12


def _run(folder, tp: int, settings: dict, inspect=None) -> Outcome:
    return run_engine(folder, settings, num_new=NUM_NEW, num_prompts=NUM_PROMPTS, tp=tp, inspect=inspect)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_hf_checkpoint):
    return llama_checkpoint(make_hf_checkpoint, tmp_path_factory.mktemp("tp-llama"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, make_hf_checkpoint):
    return qwen2_checkpoint(make_hf_checkpoint, tmp_path_factory.mktemp("tp-qwen2"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("tp-qwen3")
    make_hf_checkpoint("qwen3", folder, seed=3, head_dim=16)
    return folder


@pytest.mark.parametrize("family,case", [
    ("llama", "chunked-recompute"),
    ("qwen2", "swap"),
    pytest.param("qwen3", "int8-kv", marks=pytest.mark.slow),  # q/k norms, an 8-bit KV cache with its scales
])
def test_two_ranks_generate_what_one_rank_does(request, family, case):
    folder = request.getfixturevalue(family)
    one, two = _run(folder, 1, CASES[case]), _run(folder, 2, CASES[case])
    # Two ranks add the attention and MLP outputs in another order (the all-reduce), so K and V
    # differ from one rank's in the last float32 bits; in an 8-bit cache such a difference can
    # move a value across a rounding boundary, one quantization step (1/127 of its row's largest
    # value), which moves later logprobs by up to about 1e-3. Tokens must still be identical.
    tol = 2e-3 if CASES[case].get("kv_cache_dtype", "auto") != "auto" else 1e-4
    assert_generates_what_one_rank_does(one, two, logprob_tol=tol)
    # Two KV heads: one per rank, half the cache each. Qwen2's one KV head: replicated.
    assert two.kv_cache_bytes == (one.kv_cache_bytes if family == "qwen2" else one.kv_cache_bytes // 2)


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
    # Every element read, whole or through a slice, is counted: a rank must read half of each split tensor.
    reads = record_safetensors_reads(monkeypatch)
    config = load_model(str(llama))[0].config
    parts = []
    for rank in range(2):
        reads.clear()
        parts.append(dict(read_safetensors_shard(path, Shard.of(config, rank, 2))))
        split = [n for n in whole if not n.endswith(("norm.weight", "embed_tokens.weight"))]
        replicated = sum(whole[n].numel() for n in whole if n not in split)
        assert sum(n for _, n in reads) == replicated + sum(whole[n].numel() for n in split) // 2
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

    from mqinfer.workers.engine.parallel import RankFailure
    from mqinfer.workers.engine.ranks import Leader

    # Rank 1 is sent to a CUDA device no machine has: it exits before it joins.
    began = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with code 1"):
        Leader(["cpu", "cuda:999"])
    assert time.monotonic() - began < 300  # well before the rendezvous timeout (900 s)


def test_two_ranks_check_speculative_proposals_as_one_rank_generates(llama):
    # Proposals ride in the step plan like any other query tokens; only rank 0 accepts them.
    one = _run(llama, 1, CASES["chunked-recompute"]).results
    speculative = {"speculative": "ngram", "ngram_min": 1, "speculative_policy": "fixed"}
    stats = []
    two = _run(llama, 2, {**CASES["chunked-recompute"], **speculative},
               inspect=lambda engine: stats.append(engine.spec_stats)).results
    assert stats[0].accepted_tokens > 0, stats  # proposals were checked and some kept
    for rid, out in one.items():
        assert two[rid].output_token_ids == out.output_token_ids, rid


def test_a_layer_skip_draft_or_a_draft_model_is_refused_over_several_ranks():
    # The draft's forwards run on rank 0 alone, whose collectives the other ranks would not join.
    with pytest.raises(ValueError, match="--speculative self does not combine with --tensor-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="self")
    with pytest.raises(ValueError, match="--speculative draft does not combine with --tensor-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="draft", draft_model="tiny")
    EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2, speculative="ngram")
