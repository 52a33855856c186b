"""Speculative decoding with a draft model (``--speculative draft --draft-model M``) end to end, in
float32 on small random Llama checkpoints.

The target is a 3-layer checkpoint whose last layer barely changes the residual stream; the
draft is mostly its first two layers saved as a checkpoint of their own (a different, smaller
model with the same vocabulary, which is often right), sometimes an unrelated random model of
another shape (almost always wrong) or the target itself (always right). Two kinds of check:

- every proposal equals the greedy continuation that the draft model alone generates from the
  request's tokens at that step, so the draft's own KV cache held the right K/V for every
  position it did not recompute (catch-up, accepted and rejected proposals, preemption,
  prefix-cache hits, catch-up split over several forwards);
- the engine emits exactly the tokens it emits without speculation (greedy and seeded
  sampling), alone, in mixed batches with requests that opt out, after preemption (recompute
  and swap) and with prefix-cache hits, and proposals were accepted (and some rejected).
"""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import generate_latest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.engine import startup as engine_startup
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.loader import load_model
from tests.workers.harness import WorkerHarness, request, submit
from tests.workers.spec_helpers import LAYERS, VOCAB
from tests.workers.spec_helpers import prompts as _prompts
from tests.workers.spec_helpers import random_checkpoint as _checkpoint
from tests.workers.spec_helpers import run as _run
from tests.workers.spec_helpers import same as _same


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("target"), damp_last=0.1)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    """The target's first two layers, as a checkpoint of their own."""
    return _checkpoint(tmp_path_factory.mktemp("small"), damp_last=0.1, keep_layers=LAYERS - 1)


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory) -> str:
    """Another random model with the same vocabulary and a different shape (1 layer, 1 KV head of 16)."""
    return _checkpoint(tmp_path_factory.mktemp("unrelated"), seed=7, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _engine(model: str, draft: str | None = None, **kw) -> LLMEngine:
    # fixed: every request proposes whenever it can, so that the checks below do not depend on timing.
    config = {"num_kv_blocks": 128, "dtype": "float32", "num_speculative_tokens": 3, "speculative_policy": "fixed",
              **kw}
    if draft is not None:
        config.update(speculative="draft", draft_model=draft)
    return LLMEngine(EngineConfig(model=model, num_threads=1, **config))


class Reference:
    """The draft model alone: its greedy continuation of a context, each token from a fresh
    forward over the whole sequence (no KV cache carried between tokens)."""

    def __init__(self, draft: str) -> None:
        self.engine = _engine(draft, num_kv_blocks=32)

    def greedy(self, context: list[int], n: int) -> list[int]:
        runner, tokens = self.engine.runner, list(context)
        with torch.inference_mode():
            for _ in range(n):
                hidden = runner.forward_sequence(tokens)
                tokens.append(int(runner.model.compute_logits(hidden[-1:]).argmax()))
        return tokens[len(context):]


def _record_proposals(engine: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its proposals) for every proposal the engine makes from now on."""
    proposals = []
    execute = engine.runner.execute

    def recording(output):
        contexts = [list(sr.request.all_token_ids) for sr in output.scheduled]
        ran = execute(output)
        proposals.extend((ctx, list(sr.spec_token_ids)) for ctx, sr in zip(contexts, output.scheduled)
                         if sr.spec_token_ids)
        return ran

    engine.runner.execute = recording
    return proposals


def _check_proposals(proposals, reference: Reference, limit: int | None = None) -> None:
    assert proposals
    for n, (context, proposal) in enumerate(proposals[:limit]):
        assert proposal == reference.greedy(context, len(proposal)), n


def _check_stats(engine: LLMEngine, finished: dict, all_accepted: bool = False) -> None:
    stats = engine.spec_stats
    assert stats.proposer == "draft"
    if all_accepted:
        assert 0 < stats.accepted_tokens == stats.proposed_tokens
    else:
        # Speculation happened and was right sometimes and wrong sometimes (rollback exercised).
        assert 0 < stats.accepted_tokens < stats.proposed_tokens
    assert stats.emitted_tokens == stats.accepted_tokens + stats.num_checks
    assert sum(o.num_rejected_tokens for o in finished.values()) == stats.proposed_tokens - stats.accepted_tokens
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_proposals_are_what_the_draft_model_alone_generates(target, small, unrelated):
    """Mostly-right and mostly-wrong drafts: each proposal is the draft model's own greedy
    continuation, so the draft resumed after accepted proposals and ran rejected ones again."""
    for draft in (small, unrelated):
        engine = _engine(target, draft)
        proposals = _record_proposals(engine)
        finished, _ = _run(engine, [(f"r{i}", p, GREEDY, True) for i, p in enumerate(_prompts(3, seed=4))])
        assert sum(len(p) == 3 for _, p in proposals) >= 5
        _check_proposals(proposals, Reference(draft))
        stats = engine.spec_stats
        assert stats.proposed_tokens > stats.accepted_tokens
        if draft == small:
            assert stats.accepted_tokens > stats.proposed_tokens / 2


def test_steps_without_speculation_are_caught_up(target, small, unrelated):
    """A request that skips speculation in some steps (here its proposer gives nothing when its
    token count is a multiple of 3): the draft's next run covers the tokens of those steps, and
    a proposal it ran that was rejected is not trusted even after the request has moved past it
    (the unrelated draft is rejected almost always)."""
    for draft in (small, unrelated):
        engine = _engine(target, draft)
        propose = engine.scheduler.proposer.propose
        engine.scheduler.proposer.propose = lambda req, k: [] if req.num_tokens % 3 == 0 else propose(req, k)
        proposals = _record_proposals(engine)
        _run(engine, [(f"r{i}", p, GREEDY, True) for i, p in enumerate(_prompts(3, seed=4))])
        _check_proposals(proposals, Reference(draft))
        assert engine.spec_stats.proposed_tokens > engine.spec_stats.accepted_tokens


def test_a_draft_equal_to_the_model_has_every_proposal_accepted(target):
    items = [(f"r{i}", p, GREEDY, True) for i, p in enumerate(_prompts(3, seed=2))]
    plain, _ = _run(_engine(target), items)
    engine = _engine(target, target)
    spec, _ = _run(engine, items)
    _same(spec, plain)
    _check_stats(engine, spec, all_accepted=True)
    # The prompts (33 tokens) fill the first step past the threshold; every output token after
    # each request's first comes from a check of 3 proposals, 4 tokens at a time (3 at the end).
    assert engine.spec_stats.num_checks == sum(-(-(20 - 1) // 4) for _ in items)
    # The first check ran the prompt and the first sampled token; each later one only the last
    # proposal of the check before and the token sampled after it.
    assert sum(len(p) for _, p, _, _ in items) == 33
    assert engine.runner.draft.num_catch_up_tokens == 33 + len(items) + 2 * (engine.spec_stats.num_checks - len(items))


def test_greedy_is_token_identical_alone_and_in_mixed_batches(target, small):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    items = [(f"r{i}", p, greedy, i not in (1, 4)) for i, p in enumerate(_prompts(6, seed=1))]
    plain, _ = _run(_engine(target), items)
    engine = _engine(target, small)
    spec, deltas = _run(engine, items)
    _same(spec, plain)
    for rid, out in spec.items():
        assert [e["token_id"] for e in out.logprobs] == out.output_token_ids
        assert [t for d in deltas[rid] for t in d] == out.output_token_ids
    _check_stats(engine, spec)
    assert spec["r1"].num_rejected_tokens == spec["r4"].num_rejected_tokens == 0
    assert any(len(d) > 1 for ds in deltas.values() for d in ds)
    # The draft keeps nothing for requests that ended.
    assert not engine.runner.draft._progress

    # Each of two requests alone in its batch.
    alone = _engine(target, small)
    for item in items[2:4]:
        one, _ = _run(alone, [item])
        _same(one, {item[0]: plain[item[0]]})
    assert alone.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_is_token_identical_after_preemption_and_with_prefix_hits(target, small, preemption):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    shared = [t for p in _prompts(4, seed=5, length=8) for t in p][:32]
    prompts = [shared + p for p in _prompts(6, seed=3, length=16)]
    first = [(f"a{i}", p, greedy, True) for i, p in enumerate(prompts[:4])]
    later = {8: [(f"b{i}", p, greedy, True) for i, p in enumerate(prompts[4:])]}
    # 10 blocks of 16 tokens: not enough for four requests of up to 88 tokens at once.
    kw = {"num_kv_blocks": 10, "preemption_mode": preemption}
    plain, _ = _run(_engine(target, **kw), first, later)
    engine = _engine(target, small, **kw)
    proposals = _record_proposals(engine)
    spec, _ = _run(engine, first, later)
    _same(spec, plain)
    assert sum(o.num_preemptions for o in spec.values()) > 0
    if preemption == "swap":
        assert sum(o.num_swaps for o in spec.values()) > 0
    assert sum(o.num_cached_tokens for o in spec.values()) > 0
    _check_stats(engine, spec)
    # After each preemption the draft ran the request's tokens again into its new blocks.
    _check_proposals(proposals, Reference(small))


def test_prefix_hits_on_blocks_the_draft_never_wrote(target, small):
    """The shared prefix was computed by a request that did not speculate, so the draft's cache
    holds nothing there: requests that hit it must run the draft over it themselves."""
    shared = [t for p in _prompts(4, seed=6, length=12) for t in p][:40]
    engine = _engine(target, small)
    _run(engine, [("p", shared + [9], SamplingParams(max_tokens=2, temperature=0.0), False)])
    proposals = _record_proposals(engine)
    items = [(f"h{i}", shared + p, GREEDY, True) for i, p in enumerate(_prompts(2, seed=9, length=6))]
    spec, _ = _run(engine, items)
    assert all(o.num_cached_tokens == 32 for o in spec.values())
    _check_proposals(proposals, Reference(small))
    plain, _ = _run(_engine(target), items)
    _same(spec, plain)


def test_a_long_catch_up_runs_in_several_forwards(target, small):
    """A prompt longer than a step's token budget: its last chunk's step speculates, and the
    draft's catch-up over the whole prompt goes in forwards of at most that budget."""
    engine = _engine(target, small, max_num_batched_tokens=16, max_num_seqs=4)
    forwards = []
    forward = engine.runner.draft._forward
    engine.runner.draft._forward = lambda ids, *a: forwards.append(len(ids)) or forward(ids, *a)
    proposals = _record_proposals(engine)
    prompts = _prompts(3, seed=12, length=40)
    items = [(f"l{i}", p, GREEDY, True) for i, p in enumerate(prompts)]
    spec, _ = _run(engine, items)
    assert max(forwards) == 16 and sum(1 for n in forwards if n > 3) >= 3
    _check_proposals(proposals, Reference(small), limit=12)
    plain, _ = _run(_engine(target, max_num_batched_tokens=16, max_num_seqs=4), items)
    _same(spec, plain)


def test_seeded_sampling_gives_the_same_tokens_with_a_draft_model(target, small):
    items = [(f"s{i}", p, SamplingParams(max_tokens=16, temperature=0.3, top_k=20, seed=50 + i, ignore_eos=True),
              True) for i, p in enumerate(_prompts(3, seed=8))]
    plain, _ = _run(_engine(target), items)
    engine = _engine(target, small)
    spec, _ = _run(engine, items)
    _same(spec, plain)
    _check_stats(engine, spec)


def test_the_draft_model_is_checked(target, tmp_path):
    with pytest.raises(ValueError, match="--speculative draft needs --draft-model"):
        EngineConfig(speculative="draft")
    other = _checkpoint(tmp_path / "vocab", vocab_size=VOCAB - 44, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"--draft-model vocab has a vocabulary of 256 tokens but the model "
                                         r"target\d* has 300"):
        _engine(target, other)
    engine = _engine(target, target)
    assert engine.runner.draft.info.dtype == "float32" and engine.runner.draft.model is not engine.model


def test_the_automatic_kv_size_holds_the_draft_cache_too(target, small, monkeypatch, caplog):
    info = load_model(target, "cpu", "float32")[1]
    small_info = load_model(small, "cpu", "float32")[1]
    per_block = info.kv_bytes_per_token * 16
    draft_per_block = small_info.kv_bytes_per_token * 16
    assert draft_per_block == per_block * 2 // 3
    config = EngineConfig(model=target, max_num_seqs=256, max_model_len=512)
    monkeypatch.setattr(engine_startup, "physical_memory", lambda: 64 << 20)
    alone, _ = engine_startup.default_num_kv_blocks(info, torch.device("cpu"), config, 512)
    both, why = engine_startup.default_num_kv_blocks(info, torch.device("cpu"), config, 512, draft_per_block)
    assert alone == (16 << 20) // per_block and both == (16 << 20) // (per_block + draft_per_block)
    assert "the draft's KV caches together" in why
    with caplog.at_level(logging.INFO, logger="mqinfer.workers.engine.startup"):
        engine = LLMEngine(EngineConfig(model=target, num_threads=1, dtype="float32", max_num_seqs=256,
                                        max_model_len=512, speculative="draft", draft_model=small))
    assert engine.scheduler_config.num_kv_blocks == both
    assert engine.runner.kv_cache_bytes == both * per_block
    assert engine.runner.draft.kv_cache_bytes == both * draft_per_block
    assert any("speculative decoding: draft model small" in r.getMessage() for r in caplog.records)


def test_worker_bills_rejected_tokens_and_counts_proposals(redis_url, redis_client, tmp_path, target, small):
    engine = EngineConfig(model=target, num_threads=1, dtype="float32", num_kv_blocks=64, speculative="draft",
                          draft_model=small, speculative_policy="fixed")
    h = WorkerHarness(redis_url, tmp_path / "out", engine=engine).start()
    try:
        for i, p in enumerate(_prompts(3, seed=11)):
            submit(redis_client, request(f"q{i}", max_tokens=16, prompt_token_ids=p,
                                         **({"speculative": False} if i == 2 else {})))
        h.until(lambda: len(h.results()) == 3, advance_s=1.0, what="three result rows")
    finally:
        h.stop()
    costs = {c["id"]: c for c in h.costs() if c["kind"] == "request"}
    stats = h.worker.engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    assert sum(c["rejected_tokens"] for c in costs.values()) == stats.proposed_tokens - stats.accepted_tokens
    assert costs["q2"]["rejected_tokens"] == 0
    text = generate_latest(h.metrics.registry).decode()
    assert f'mqinfer_spec_accepted_tokens_total{{proposer="draft"}} {float(stats.accepted_tokens)}' in text
    assert f'mqinfer_spec_proposed_tokens_total{{proposer="draft"}} {float(stats.proposed_tokens)}' in text


def test_an_8bit_kv_cache_holds_the_draft_too(target, small):
    items = [(f"q{i}", p, GREEDY, True) for i, p in enumerate(_prompts(2, seed=13))]
    plain, _ = _run(_engine(target, kv_cache_dtype="int8"), items)
    engine = _engine(target, small, kv_cache_dtype="int8")
    assert all(cache[0].dtype == torch.int8 and cache[2] is not None for cache in engine.runner.draft.kv_caches)
    spec, _ = _run(engine, items)
    _same(spec, plain)
    assert engine.spec_stats.accepted_tokens > engine.spec_stats.proposed_tokens / 2
