"""Swap preemption end to end: a KV cache too small for the batch, preempted requests' KV copied
to the host pool and back, and greedy outputs still token for token equal to transformers."""

from __future__ import annotations

import random

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

NUM_NEW = 20
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32, 4 tokens
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_hf_checkpoint, hf_greedy):
    """A tiny random Llama saved by transformers, prompts, and transformers' greedy outputs."""
    folder = tmp_path_factory.mktemp("llama-swap")
    model = make_hf_checkpoint("llama", folder, seed=3)
    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(35)]
    prompts = []
    for i in range(16):
        tail = [rng.randrange(3, 300) for _ in range(rng.randint(1, 45))]
        prompts.append(shared + tail if i % 4 == 0 else tail)
    reference = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    return str(folder), prompts, reference


def run(engine: LLMEngine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    finished, recomputed, steps = {}, 0, 0
    while engine.has_unfinished():
        result = engine.step()
        steps += 1
        assert steps < 5000
        recomputed += sum(w.num_recomputed_tokens for w in result.work)
        for out in result.outputs:
            if out.finished:
                finished[out.request_id] = out
    return finished, recomputed


def check(finished, reference):
    for i, (tokens, logprobs) in enumerate(reference):
        out = finished[f"r{i}"]
        assert out.finish_reason == "length"
        assert out.output_token_ids == tokens, f"prompt {i}"
        got = [entry["logprob"] for entry in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4, f"prompt {i}"


def swap_engine(folder, swap_blocks: int, **kw) -> LLMEngine:
    # 30 blocks of 4 tokens (120 slots) for 16 requests of up to 95 tokens: preemptions.
    return LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=30, block_size=4,
                                  preemption_mode="swap", swap_space_gib=swap_blocks * BLOCK_BYTES / 2**30, **kw))


@pytest.mark.parametrize(
    "settings",
    [{"enable_prefix_caching": False}, {}, {"max_num_batched_tokens": 24, "max_num_seqs": 6}],
    ids=["no-prefix-cache", "prefix-cache", "chunked-prefill"],
)
def test_swapped_requests_generate_like_transformers(llama, settings):
    folder, prompts, reference = llama
    engine = swap_engine(folder, 256, **settings)
    assert engine.scheduler.kv_cache_manager.num_swap_blocks == 256
    assert engine.runner.host_cache is not None and engine.runner.host_cache.num_blocks == 256
    finished, recomputed = run(engine, prompts)
    check(finished, reference)
    swaps = sum(o.num_swaps for o in finished.values())
    # The host pool never filled up: every preemption kept its KV, nothing was recomputed.
    assert swaps > 0 and swaps == engine.scheduler.num_swaps_total == engine.scheduler.num_preemptions_total
    assert sum(o.num_preemptions for o in finished.values()) == swaps
    assert recomputed == 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_swap_blocks == 256 and kv.num_free_blocks == kv.num_blocks


def test_a_small_host_pool_mixes_swap_and_recompute(llama):
    folder, prompts, reference = llama
    engine = swap_engine(folder, 8, enable_prefix_caching=False)
    finished, recomputed = run(engine, prompts)
    check(finished, reference)
    swaps = engine.scheduler.num_swaps_total
    assert 0 < swaps < engine.scheduler.num_preemptions_total
    assert recomputed > 0


def test_swap_settings_are_checked(llama):
    folder, _, _ = llama
    with pytest.raises(ValueError, match="preemption_mode must be recompute or swap"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space_gib must be a finite number >= 0"):
        EngineConfig(swap_space_gib=-1.0)
    with pytest.raises(ValueError, match=r"swap_space_gib 0.0 holds no KV block \(8192 bytes for 16 tokens"):
        LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=10, preemption_mode="swap",
                               swap_space_gib=0.0))
    # Recompute mode allocates no host pool, whatever swap_space_gib says.
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=10))
    assert engine.runner.host_cache is None and engine.scheduler.kv_cache_manager.num_swap_blocks == 0
