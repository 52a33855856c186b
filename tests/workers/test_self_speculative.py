"""Layer-skip self-speculation (``--speculative self``) end to end, in float32 on small random
Llama checkpoints: the draft proposes exactly what the model cut to its first L layers would
generate (so its K/V writes into the target's cache are right), and the engine emits exactly
the tokens it emits without speculation, alone, in mixed batches with requests that opt out,
after preemption (recompute and swap) and with prefix-cache hits. The equivalence tests use a
checkpoint whose last layer barely changes the residual stream, so that the draft of the other
layers is often right, and each checks that proposals were accepted (and some rejected)."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from tests.workers.spec_helpers import LAYERS, VOCAB
from tests.workers.spec_helpers import prompts as _prompts
from tests.workers.spec_helpers import random_checkpoint as _checkpoint
from tests.workers.spec_helpers import run as _run
from tests.workers.spec_helpers import same as _same


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def damped(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("damped"), damp_last=0.1)


def _engine(model: str, speculative: str = "none", **kw) -> LLMEngine:
    # fixed: every request proposes whenever it can, so that the checks below do not depend on timing.
    config = {"num_kv_blocks": 128, "dtype": "float32", "num_speculative_tokens": 3, "speculative_policy": "fixed",
              **kw}
    return LLMEngine(EngineConfig(model=model, num_threads=1, speculative=speculative, **config))


def _check_stats(engine: LLMEngine, finished: dict) -> None:
    stats = engine.spec_stats
    assert stats.proposer == "self"
    # Speculation happened and was right sometimes and wrong sometimes (rollback exercised).
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    assert stats.emitted_tokens == stats.accepted_tokens + stats.num_checks
    assert sum(o.num_rejected_tokens for o in finished.values()) == stats.proposed_tokens - stats.accepted_tokens
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_draft_proposes_what_the_first_layers_alone_generate(tmp_path):
    """Each proposal equals the greedy continuation of the model cut to its first L layers, from
    the request's tokens at that step: the draft's attention reads the right K/V for every
    earlier position (the target's, and its own writes for the positions it runs)."""
    full = _checkpoint(tmp_path / "full")
    cut = _engine(_checkpoint(tmp_path / "cut", keep_layers=2))
    engine = _engine(full, "self", draft_layers=2)
    proposals = []
    execute = engine.runner.execute

    def recording(output):
        contexts = [list(sr.request.all_token_ids) for sr in output.scheduled]
        ran = execute(output)
        proposals.extend((ctx, list(sr.spec_token_ids)) for ctx, sr in zip(contexts, output.scheduled)
                         if sr.spec_token_ids)
        return ran

    engine.runner.execute = recording
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    _run(engine, [(f"r{i}", p, greedy, True) for i, p in enumerate(_prompts(3, seed=4))])
    assert len(proposals) >= 10 and sum(len(p) == 3 for _, p in proposals) >= 5
    for n, (context, proposal) in enumerate(proposals[:12]):
        sampling = SamplingParams(max_tokens=len(proposal), temperature=0.0, ignore_eos=True)
        want, _ = _run(cut, [(f"c{n}", context, sampling, False)])
        assert proposal == want[f"c{n}"].output_token_ids, n


def test_greedy_is_token_identical_alone_and_in_mixed_batches(damped):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    items = [(f"r{i}", p, greedy, i not in (1, 4)) for i, p in enumerate(_prompts(6, seed=1))]
    plain, _ = _run(_engine(damped), items)
    engine = _engine(damped, "self", draft_layers=LAYERS - 1)
    asked = set()
    propose = engine.scheduler.proposer.propose

    def recording(request, max_tokens):
        asked.add(request.request_id)
        return propose(request, max_tokens)

    engine.scheduler.proposer.propose = recording
    spec, deltas = _run(engine, items)
    _same(spec, plain)
    for rid, out in spec.items():
        assert [e["token_id"] for e in out.logprobs] == out.output_token_ids
        assert [t for d in deltas[rid] for t in d] == out.output_token_ids
    _check_stats(engine, spec)
    assert asked and not asked & {"r1", "r4"}
    assert any(len(d) > 1 for ds in deltas.values() for d in ds)

    # Each of two requests alone in its batch.
    alone = _engine(damped, "self", draft_layers=LAYERS - 1)
    for item in items[2:4]:
        one, _ = _run(alone, [item])
        _same(one, {item[0]: plain[item[0]]})
    assert alone.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_is_token_identical_after_preemption_and_with_prefix_hits(damped, preemption):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    shared = [t for p in _prompts(4, seed=5, length=8) for t in p][:32]
    prompts = [shared + p for p in _prompts(6, seed=3, length=16)]
    first = [(f"a{i}", p, greedy, True) for i, p in enumerate(prompts[:4])]
    later = {8: [(f"b{i}", p, greedy, True) for i, p in enumerate(prompts[4:])]}
    # 10 blocks of 16 tokens: not enough for four requests of up to 88 tokens at once.
    kw = {"num_kv_blocks": 10, "preemption_mode": preemption}
    plain, _ = _run(_engine(damped, **kw), first, later)
    engine = _engine(damped, "self", draft_layers=LAYERS - 1, **kw)
    spec, _ = _run(engine, first, later)
    _same(spec, plain)
    assert sum(o.num_preemptions for o in spec.values()) > 0
    if preemption == "swap":
        assert sum(o.num_swaps for o in spec.values()) > 0
    assert sum(o.num_cached_tokens for o in spec.values()) > 0
    _check_stats(engine, spec)


def test_seeded_sampling_gives_the_same_tokens_with_self_speculation(damped):
    items = [(f"s{i}", p, SamplingParams(max_tokens=16, temperature=0.3, top_k=20, seed=50 + i, ignore_eos=True),
              True) for i, p in enumerate(_prompts(3, seed=8))]
    plain, _ = _run(_engine(damped), items)
    engine = _engine(damped, "self", draft_layers=LAYERS - 1)
    spec, _ = _run(engine, items)
    _same(spec, plain)
    _check_stats(engine, spec)


def test_draft_layers_are_checked(damped):
    with pytest.raises(ValueError, match="draft_layers must be at least 1"):
        EngineConfig(speculative="self", draft_layers=0)
    with pytest.raises(ValueError, match=r"--draft-layers must be between 1 and 2 .*\(3 layers\), got 3"):
        _engine(damped, "self", draft_layers=LAYERS)
    assert _engine(damped, "self").runner.draft.num_layers == 1  # half of 3, rounded down
    assert _engine(damped).runner.draft is None
