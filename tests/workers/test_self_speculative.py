"""Layer-skip self-speculation (``--speculative self``) end to end, in float32 on small random
Llama checkpoints: the draft proposes exactly what the model cut to its first L layers would
generate (so its K/V writes into the target's cache are right), and the engine emits exactly
the tokens it emits without speculation, alone, in mixed batches with requests that opt out,
after preemption (recompute and swap) and with prefix-cache hits. The equivalence tests use a
checkpoint whose last layer barely changes the residual stream, so that the draft of the other
layers is often right, and each checks that proposals were accepted (and some rejected)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine import LLMEngine
from mqinfer.workers.loader import make_random_checkpoint

LAYERS = 3
VOCAB = 300


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _checkpoint(folder: Path, damp_last: float = 1.0, keep_layers: int | None = None) -> str:
    """A random 3-layer Llama checkpoint (the same weights every time); the last layer's output
    projections scaled by ``damp_last``; with ``keep_layers`` only the first that many layers."""
    make_random_checkpoint(folder, dtype="float32", seed=0, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=VOCAB, max_position_embeddings=512)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{LAYERS - 1}."
    for name in (last + "self_attn.o_proj.weight", last + "mlp.down_proj.weight"):
        tensors[name] = tensors[name] * damp_last
    if keep_layers is not None:
        tensors = {k: v for k, v in tensors.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep_layers}
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] = keep_layers
        (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def damped(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("damped"), damp_last=0.1)


def _engine(model: str, speculative: str = "none", **kw) -> LLMEngine:
    # fixed: every request proposes whenever it can, so that the checks below do not depend on timing.
    config = {"num_kv_blocks": 128, "dtype": "float32", "num_speculative_tokens": 3, "speculative_policy": "fixed",
              **kw}
    return LLMEngine(EngineConfig(model=model, num_threads=1, speculative=speculative, **config))


def _run(engine, items, add_after: dict[int, list] | None = None):
    """Run (id, prompt, sampling, speculative) items to the end; ``add_after[step]`` join later.
    After every step, each running request holds only the blocks its tokens need (the blocks of
    rejected proposals went back)."""
    ids = [item[0] for item in items]
    for rid, prompt, sampling, spec in items:
        engine.add_request(rid, prompt, sampling, speculative=spec)
    finished, deltas = {}, {}
    step = 0
    kv = engine.scheduler.kv_cache_manager
    while engine.has_unfinished() or (add_after and any(s >= step for s in add_after)):
        for rid, prompt, sampling, spec in (add_after or {}).get(step, []):
            engine.add_request(rid, prompt, sampling, speculative=spec)
            ids.append(rid)
        for out in engine.step().outputs:
            deltas.setdefault(out.request_id, []).append(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
        for rid in ids:
            request = engine.scheduler.get_request(rid)
            if request is not None:
                assert len(request.block_ids) <= kv.num_blocks_for(request.num_tokens), rid
        step += 1
        assert step < 2000
    return finished, deltas


def _prompts(n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(length // 2, length))] for _ in range(n)]


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for rid in a:
        assert (a[rid].output_token_ids, a[rid].finish_reason) == (b[rid].output_token_ids, b[rid].finish_reason), rid


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
