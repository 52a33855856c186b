"""Speculative decoding end to end: with ``--speculative ngram`` the engine emits exactly the
tokens it emits without (greedy and seeded sampling, float32), alone, in mixed batches with
requests that opt out, after preemption and with prefix-cache hits; stop rules, logprobs,
streaming deltas and cancellation behave the same; the worker bills rejected tokens and counts
proposals in its metrics. Every comparison also checks that proposals were accepted, so none
can pass without speculation happening."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from tests.workers.harness import WorkerHarness, request, submit


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint("llama", folder, seed=0)
    return str(folder)


def _engine(model: str = "tiny", speculative: str = "none", **kw) -> LLMEngine:
    # fixed: every request proposes whenever it can, so that the checks below do not depend on timing.
    config = {"num_kv_blocks": 256, "dtype": "float32", "speculative_policy": "fixed", **kw}
    return LLMEngine(EngineConfig(model=model, num_threads=1, speculative=speculative, **config))


class Recording:
    """Wraps the engine's proposer and records which requests it was asked about."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine.scheduler.proposer
        self.asked: set[str] = set()
        engine.scheduler.proposer = self

    def propose(self, req, max_tokens):
        self.asked.add(req.request_id)
        return self.inner.propose(req, max_tokens)

    def forget(self, request_id):
        self.inner.forget(request_id)


def _run(engine, items, add_after: dict[int, list] | None = None, cancel: dict[int, str] | None = None):
    """Run (id, prompt, sampling, speculative) items to the end; ``add_after[step]`` items join
    later, ``cancel[step]`` is cancelled before that step. Returns final outputs and deltas."""
    for rid, prompt, sampling, spec in items:
        engine.add_request(rid, prompt, sampling, speculative=spec)
    finished, deltas = {}, {}
    step = 0
    while engine.has_unfinished() or (add_after and any(s >= step for s in add_after)):
        for rid, prompt, sampling, spec in (add_after or {}).get(step, []):
            engine.add_request(rid, prompt, sampling, speculative=spec)
        if cancel and step in cancel:
            engine.cancel(cancel[step])
        for out in engine.step().outputs:
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 5000
    return finished, deltas


def _copy_prompts(vocab: int, n: int, seed: int = 0, span: int = 24) -> list[list[int]]:
    """Prompts that repeat a span of themselves: prompt lookup has something to find."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = [rng.randrange(3, vocab) for _ in range(span)]
        out.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))] + s + s[: rng.randint(3, span)])
    return out


def _same(a: dict, b: dict, logprobs: bool = False) -> None:
    assert set(a) == set(b)
    for rid in a:
        x, y = a[rid], b[rid]
        assert (x.output_token_ids, x.finish_reason, x.text) == (y.output_token_ids, y.finish_reason, y.text), rid
        if logprobs:
            assert len(x.logprobs) == len(y.logprobs) == len(x.output_token_ids)
            for p, q in zip(x.logprobs, y.logprobs):
                assert p["token_id"] == q["token_id"] and p["top_token_ids"] == q["top_token_ids"]
                assert abs(p["logprob"] - q["logprob"]) < 1e-4


def _deltas_add_up(finished: dict, deltas: dict) -> None:
    for rid, out in finished.items():
        assert [t for d in deltas[rid] for t in d.new_token_ids] == out.output_token_ids
        if out.text is not None:
            assert "".join(d.new_text for d in deltas[rid]) == out.text


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_greedy_is_token_identical_alone_and_in_mixed_batches(model, llama_folder):
    path = "tiny" if model == "tiny" else llama_folder
    vocab = 256 if model == "tiny" else 300
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = _copy_prompts(vocab, 6) + [[random.Random(i).randrange(3, vocab) for _ in range(30)] for i in range(3)]
    items = [(f"r{i}", p, greedy, i not in (1, 4)) for i, p in enumerate(prompts)]

    plain, _ = _run(_engine(path), items)
    engine = _engine(path, "ngram")
    recording = Recording(engine)
    spec, deltas = _run(engine, items)
    _same(spec, plain, logprobs=True)
    _deltas_add_up(spec, deltas)
    stats = engine.spec_stats
    assert stats.accepted_tokens > 0 and stats.proposed_tokens >= stats.accepted_tokens
    assert stats.emitted_tokens == stats.accepted_tokens + stats.num_checks
    assert recording.asked and not recording.asked & {"r1", "r4"}
    assert sum(o.num_rejected_tokens for o in spec.values()) == stats.proposed_tokens - stats.accepted_tokens
    # More than one token in some steps: speculation really shortened the run.
    assert any(len(d.new_token_ids) > 1 for ds in deltas.values() for d in ds)

    # Each request alone in its batch.
    alone = _engine(path, "ngram")
    for item in items[:4]:
        one, _ = _run(alone, [item])
        _same(one, {item[0]: plain[item[0]]}, logprobs=True)
    assert alone.spec_stats.accepted_tokens > 0


def test_greedy_is_token_identical_after_preemption_and_with_prefix_hits():
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(32)]
    prompts = [shared + p for p in _copy_prompts(256, 8, seed=3, span=12)]
    first = [(f"a{i}", p, greedy, True) for i, p in enumerate(prompts[:5])]
    later = {12: [(f"b{i}", p, greedy, True) for i, p in enumerate(prompts[5:])]}
    # 14 blocks of 16 tokens: not enough for five requests of up to 100 tokens at once.
    plain, _ = _run(_engine(num_kv_blocks=14), first, later)
    engine = _engine(speculative="ngram", num_kv_blocks=14)
    spec, _ = _run(engine, first, later)
    _same(spec, plain)
    assert sum(o.num_preemptions for o in spec.values()) > 0
    assert sum(o.num_cached_tokens for o in spec.values()) > 0
    assert engine.spec_stats.accepted_tokens > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation():
    prompts = _copy_prompts(256, 6, seed=9)
    items = [(f"s{i}", p, SamplingParams(max_tokens=24, temperature=0.1, top_k=40, top_p=0.95, seed=100 + i,
                                         ignore_eos=True), i != 2) for i, p in enumerate(prompts)]
    plain, _ = _run(_engine(), items)
    engine = _engine(speculative="ngram")
    spec, _ = _run(engine, items)
    _same(spec, plain)
    assert engine.spec_stats.accepted_tokens > 0
    assert engine.spec_stats.proposed_tokens > engine.spec_stats.accepted_tokens  # some were rejected
    # And in another batch: alone.
    alone = _engine(speculative="ngram")
    one, _ = _run(alone, items[3:4])
    assert one["s3"].output_token_ids == plain["s3"].output_token_ids


def test_stop_tokens_stop_strings_and_max_tokens_inside_an_accepted_run():
    rng = random.Random(2)
    span = [rng.randrange(97, 123) for _ in range(20)]
    prompt = [256] + [rng.randrange(97, 123) for _ in range(5)] + span + span[:6]
    base = dict(temperature=0.0, ignore_eos=True, logprobs=1)
    plain_engine, spec_engine = _engine(), _engine(speculative="ngram")
    full, _ = _run(plain_engine, [("full", prompt, SamplingParams(max_tokens=40, **base), True)])
    tokens, text = full["full"].output_token_ids, full["full"].text
    crossed = {"token": 0, "string": 0, "length": 0}
    cases = []
    for m in range(4, 36, 4):
        cases.append(("token", m, SamplingParams(max_tokens=40, stop_token_ids=(tokens[m],), **base)))
    for m in range(2, 40, 2):
        cases.append(("length", m, SamplingParams(max_tokens=m, **base)))
    stops = sorted({text[k : k + n] for n in (1, 2, 3) for k in range(len(text) - n + 1)
                    if "\ufffd" not in text[k : k + n]})
    for k, stop in enumerate(stops):
        cases.append(("string", k, SamplingParams(max_tokens=40, stop=(stop,), **base)))
    for kind, m, sampling in cases:
        rid = f"{kind}{m}"
        want, _ = _run(plain_engine, [(rid, prompt, sampling, True)])
        stats = spec_engine.spec_stats
        before = (stats.emitted_tokens, stats.accepted_tokens, stats.num_checks)
        got, deltas = _run(spec_engine, [(rid, prompt, sampling, True)])
        _same(got, want, logprobs=True)
        _deltas_add_up(got, deltas)
        assert got[rid].finish_reason == ("length" if kind == "length" else "stop"), rid
        # The step that ended the request emitted several tokens, or a stop rule cut its run short
        # (it emitted fewer than its accepted proposals plus one).
        cut = stats.emitted_tokens - before[0] < stats.accepted_tokens - before[1] + stats.num_checks - before[2]
        crossed[kind] += len(deltas[rid][-1].new_token_ids) > 1 or cut
    assert all(crossed.values()), crossed


def test_eos_inside_an_accepted_run(tmp_path, make_hf_checkpoint, llama_folder):
    prompt = _copy_prompts(300, 1, seed=2)[0]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full, _ = _run(_engine(llama_folder), [("r", prompt, greedy, True)])
    tokens = full["r"].output_token_ids
    eos = tokens[20]
    # The same weights with that token as EOS.
    make_hf_checkpoint("llama", tmp_path, seed=0, eos_token_id=eos)
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    plain, _ = _run(_engine(str(tmp_path)), [("r", prompt, sampling, True)])
    assert plain["r"].output_token_ids == tokens[: tokens.index(eos) + 1]
    engine = _engine(str(tmp_path), "ngram")
    spec, deltas = _run(engine, [("r", prompt, sampling, True)])
    _same(spec, plain)
    assert spec["r"].finish_reason == "stop" and engine.spec_stats.accepted_tokens > 0


def test_cancel_while_speculating_frees_everything():
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = _copy_prompts(256, 3, seed=6)
    engine = _engine(speculative="ngram")
    items = [(f"c{i}", p, greedy, True) for i, p in enumerate(prompts)]
    finished, deltas = _run(engine, items, cancel={4: "c1"})
    assert finished["c1"].finish_reason == "cancelled" and len(finished["c1"].output_token_ids) < 60
    assert finished["c0"].finish_reason == "length" and len(finished["c0"].output_token_ids) == 60
    _deltas_add_up(finished, deltas)
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and engine.spec_stats.accepted_tokens > 0


def test_speculation_turns_off_above_the_threshold():
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    items = [(f"t{i}", p, greedy, True) for i, p in enumerate(_copy_prompts(256, 8, seed=7))]
    # Eight decodes already exceed a threshold of 6 tokens: nothing is ever proposed.
    engine = _engine(speculative="ngram", speculative_max_batched_tokens=6)
    _run(engine, items)
    assert engine.spec_stats.proposed_tokens == 0


def test_options_check_the_proposers_settings():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(speculative="ngram", ngram_min=3, ngram_max=2)


def test_worker_bills_rejected_tokens_and_counts_proposals(redis_url, redis_client, tmp_path):
    h = WorkerHarness(redis_url, tmp_path / "out",
                      engine=EngineConfig(num_threads=1, speculative="ngram", dtype="float32",
                                          speculative_policy="fixed")).start()
    try:
        prompts = _copy_prompts(256, 3, seed=11)
        for i, p in enumerate(prompts):
            submit(redis_client, request(f"q{i}", max_tokens=24, prompt_token_ids=p,
                                         **({"speculative": False} if i == 2 else {})))
        h.until(lambda: len(h.results()) == 3, advance_s=1.0, what="three result rows")
    finally:
        h.stop()
    costs = {c["id"]: c for c in h.costs() if c["kind"] == "request"}
    stats = h.worker.engine.spec_stats
    assert stats.accepted_tokens > 0
    assert sum(c["rejected_tokens"] for c in costs.values()) == stats.proposed_tokens - stats.accepted_tokens
    assert costs["q2"]["rejected_tokens"] == 0
    text = generate_latest(h.metrics.registry).decode()
    assert f'mqinfer_spec_accepted_tokens_total{{proposer="ngram"}} {float(stats.accepted_tokens)}' in text
    assert f'mqinfer_spec_proposed_tokens_total{{proposer="ngram"}} {float(stats.proposed_tokens)}' in text
