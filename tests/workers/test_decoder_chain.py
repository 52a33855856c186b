"""The decoder layers in one native call (workers/engine/models/decoder_chain.py) against the Python
layer loop it replaces: a bfloat16 engine gives the same greedy tokens and the same logprobs, bit for
bit, with the chain and with ``MQINFER_CPU_LAYERS=torch``, over prompt chunks, decodes and steps that
mix them, with prefix sharing, with steps given up between layers; and the model's output and KV
cache of one mixed step are the same bits. Llama and Qwen2 (biases on q/k/v). Needs a CPU with AMX
(the chain's only kernels)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mqinfer.kernels import linear_amx
from mqinfer.kernels.attention import build_attention_metadata
from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

pytestmark = pytest.mark.skipif(not linear_amx.available(), reason="needs a CPU with AMX tiles")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llama(request, tmp_path_factory, make_hf_checkpoint):
    """A tiny random checkpoint of a family the chain takes (Qwen2: biases on q/k/v), and prompts."""
    folder = tmp_path_factory.mktemp(f"{request.param}-chain")
    make_hf_checkpoint(request.param, folder, seed=21, num_hidden_layers=3)
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [(shared if i % 4 == 0 else []) + [rng.randrange(3, 300) for _ in range(rng.randint(1, 60))]
               for i in range(12)]
    return str(folder), prompts


def generate(folder, prompts, interrupt_every: int = 0, **settings):
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, dtype="bfloat16", num_kv_blocks=256, **settings))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    finished, steps = {}, 0
    while engine.has_unfinished():
        interrupt = None
        if interrupt_every and steps % interrupt_every == 0:
            calls = itertools.count()
            at = steps % 3
            interrupt = lambda: next(calls) == at  # noqa: E731 - stops before layer `at`
        for out in engine.step(interrupt=interrupt).outputs:
            if out.finished:
                finished[out.request_id] = (out.output_token_ids, out.logprobs)
        steps += 1
        assert steps < 3000
    return finished, engine


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 32, "max_num_seqs": 5}],
                         ids=["whole-prompts", "chunked"])
def test_the_chain_gives_the_python_loops_tokens_and_logprobs(llama, settings, monkeypatch):
    folder, prompts = llama
    chained, engine = generate(folder, prompts, **settings)
    assert engine.runner.model.chain._arrays is not None  # the chain ran
    monkeypatch.setenv("MQINFER_CPU_LAYERS", "torch")
    looped, engine = generate(folder, prompts, **settings)
    assert engine.runner.model.chain._arrays is None  # the Python loop ran
    assert chained == looped


def test_steps_given_up_in_the_chain_change_nothing(llama):
    folder, prompts = llama
    plain, _ = generate(folder, prompts)
    interrupted, engine = generate(folder, prompts, interrupt_every=2)
    assert engine.num_interrupted > 0
    assert interrupted == plain


def test_one_mixed_step_writes_the_same_bits(llama, monkeypatch):
    """Prompt chunks and decodes in one step: the final norm's output and every layer's KV cache."""
    folder, _ = llama
    engine = LLMEngine(EngineConfig(model=folder, num_threads=1, dtype="bfloat16", num_kv_blocks=64))
    model, runner = engine.runner.model, engine.runner
    torch.manual_seed(0)
    query_lens, seq_lens = [17, 1, 1, 40], [17, 30, 9, 52]
    tables = [[0, 1], [2, 3], [4], [5, 6, 7, 8]]
    metadata = build_attention_metadata(query_lens, seq_lens, tables, runner.block_size, runner.num_queries_per_kv,
                                        device="cpu", workspace=runner.workspace)
    for kv in runner.kv_caches:  # earlier tokens' KV, for the decodes and the chunk after a prefix
        kv[0].normal_()
        kv[1].normal_()
    caches = [(kv[0].clone(), kv[1].clone()) for kv in runner.kv_caches]
    h = torch.randn(sum(query_lens), model.config.hidden_size).to(torch.bfloat16)

    def run():
        for kv, (k, v) in zip(runner.kv_caches, caches):
            kv[0].copy_(k)
            kv[1].copy_(v)
        with torch.inference_mode():
            out = model.run_layers(h.clone(), metadata.positions, runner.kv_caches, metadata)
        return out, [(kv[0].clone(), kv[1].clone()) for kv in runner.kv_caches]

    out, kv = run()
    assert model.chain._arrays is not None
    monkeypatch.setenv("MQINFER_CPU_LAYERS", "torch")
    ref_out, ref_kv = run()
    assert torch.equal(out, ref_out)
    for (k, v), (rk, rv) in zip(kv, ref_kv):
        assert torch.equal(k, rk) and torch.equal(v, rv)
