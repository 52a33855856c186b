"""Steps given up in their forward pass (``LLMEngine.step(interrupt=...)``): whatever layer a step
stops before, and however often, every request's greedy output stays token for token that of
transformers, with prefix sharing, chunked prefill and swap preemption; a step that moves an
interactive request along is given up at most twice in a row."""

from __future__ import annotations

import itertools
import random

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

NUM_NEW = 12
NUM_LAYERS = 3
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
BLOCK_BYTES = 2 * NUM_LAYERS * 2 * 16 * 4 * 4  # K and V, 3 layers, 2 KV heads, head dim 16, float32, 4 tokens


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_hf_checkpoint, hf_greedy):
    """A tiny random 3-layer Llama saved by transformers, prompts (some sharing a prefix), and
    transformers' greedy outputs."""
    folder = tmp_path_factory.mktemp("llama-interrupts")
    model = make_hf_checkpoint("llama", folder, seed=11, num_hidden_layers=NUM_LAYERS)
    rng = random.Random(7)
    shared = [rng.randrange(3, 300) for _ in range(33)]
    prompts = []
    for i in range(14):
        tail = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    reference = [hf_greedy(model, p, NUM_NEW)[0] for p in prompts]
    return str(folder), prompts, reference


def interrupts(step: int):
    """The interrupt of step ``step``: every third step runs to its end; the others stop before
    layer ``step % NUM_LAYERS`` (the first, a middle or the last one)."""
    if step % 3 == 2:
        return lambda: False
    calls = itertools.count()
    at = step % NUM_LAYERS
    return lambda: next(calls) == at


def run(engine: LLMEngine, prompts, interrupt_of=interrupts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    finished, steps, given_up = {}, 0, 0
    while engine.has_unfinished():
        result = engine.step(interrupt=interrupt_of(steps))
        steps += 1
        assert steps < 5000
        if result.interrupted:
            given_up += 1
            assert result.work, "only a step that ran the model is given up"
            assert all(not o.new_token_ids for o in result.outputs)
        for out in result.outputs:
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    return finished, given_up


@pytest.mark.parametrize(
    "settings",
    [{"enable_prefix_caching": False}, {}, {"max_num_batched_tokens": 24, "max_num_seqs": 5},
     {"num_kv_blocks": 30, "block_size": 4, "preemption_mode": "swap", "swap_space_gib": 256 * BLOCK_BYTES / 2**30},
     {"num_kv_blocks": 30, "block_size": 4}],
    ids=["no-prefix-cache", "prefix-cache", "chunked-prefill", "swap", "recompute"],
)
def test_interrupted_steps_change_no_output(llama, settings):
    folder, prompts, reference = llama
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, **{"num_kv_blocks": 512, **settings}))
    finished, given_up = run(engine, prompts)
    assert given_up > 0 and engine.num_interrupted == given_up
    for i, tokens in enumerate(reference):
        out = finished[f"r{i}"]
        assert out.finish_reason == "length"
        assert out.output_token_ids == tokens, f"prompt {i}"
    if "num_kv_blocks" in settings:
        assert engine.scheduler.num_preemptions_total > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks



def before_layer(k: int):
    """An interrupt that answers true when asked before layer ``k`` (it is asked before each)."""
    calls = itertools.count()
    return lambda: next(calls) == k


def test_a_step_that_moves_an_interactive_request_is_given_up_only_before_its_middle_layer(llama):
    folder, prompts, reference = llama
    middle = NUM_LAYERS // 2
    # Bulk requests only: given up before any layer, the middle one and the last one included.
    bulk = LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=512))
    for i, p in enumerate(prompts[1:], start=1):
        bulk.add_request(f"r{i}", p, GREEDY)
    for k in range(NUM_LAYERS):
        assert bulk.step(interrupt=before_layer(k)).interrupted
    # With an interactive request in the step: before the middle layer yes; from it on, no (the step
    # runs to its end).
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=512))
    engine.add_request("r0", prompts[0], GREEDY, slo_tpot_ms=60_000)
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(f"r{i}", p, GREEDY)
    for k in range(middle):
        result = engine.step(interrupt=before_layer(k))
        assert result.interrupted and "r0" in {w.request_id for w in result.work}
    for k in range(middle, NUM_LAYERS):
        result = engine.step(interrupt=before_layer(k))
        assert not result.interrupted and "r0" in {o.request_id for o in result.outputs}
    assert engine.num_interrupted == middle
    finished, _ = run(engine, [], interrupt_of=lambda step: None)
    for i, tokens in enumerate(reference):
        assert finished[f"r{i}"].output_token_ids == tokens, f"prompt {i}"


def test_a_step_that_moves_an_interactive_request_is_given_up_at_most_twice_in_a_row(llama):
    folder, prompts, reference = llama
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, num_kv_blocks=512))
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.add_request("r0", prompts[0], GREEDY, slo_tpot_ms=60_000)

    def always() -> bool:
        return True

    done, given_up = {}, []
    for _ in range(100):
        if "r0" in done:
            break
        result = engine.step(interrupt=always)
        given_up.append(result.interrupted)
        done.update({o.request_id: o for o in result.outputs if o.finished})
    # Asked before every step, two steps in three are given up: the interactive request still gets
    # a token at least every third step, and its output is transformers'.
    assert given_up[: 3 * NUM_NEW] == [True, True, False] * NUM_NEW
    assert done["r0"].output_token_ids == reference[0]
    assert engine.num_interrupted == 2 * NUM_NEW
    # With only bulk requests left, the same interrupt gives every step up, and they keep where they were.
    before = {r: engine.scheduler.get_request(r).num_computed_tokens for r in (f"r{i}" for i in range(1, len(prompts)))
              if engine.scheduler.get_request(r) is not None}
    for _ in range(3):
        assert engine.step(interrupt=always).interrupted
    assert engine.num_interrupted == 2 * NUM_NEW + 3
    for rid, n in before.items():
        assert engine.scheduler.get_request(rid).num_computed_tokens == n
    finished, _ = run(engine, [], interrupt_of=lambda step: None)
    for i in range(1, len(prompts)):
        out = done.get(f"r{i}") or finished[f"r{i}"]
        assert out.output_token_ids == reference[i], f"prompt {i}"
