"""Shared by the tensor- and pipeline-parallel tests: their tiny Llama and Qwen2 checkpoints, the
engine settings they run, random prompts, an engine run over them, the comparison of several
ranks' outputs with one rank's, and a record of the tensors a loader reads."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, NamedTuple

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine

CASES = {
    # chunked prefill (a 24-token budget), prefix hits, and preemption by recompute in a small cache
    "chunked-recompute": {"max_num_batched_tokens": 24, "max_num_seqs": 6, "num_kv_blocks": 14, "block_size": 8},
    # preemption by swapping KV blocks to host memory and back
    "swap": {"max_num_seqs": 8, "num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap",
             "swap_space_gib": 0.01},
}
CASES["int8-kv"] = {**CASES["chunked-recompute"], "kv_cache_dtype": "int8"}


def llama_checkpoint(make_hf_checkpoint, folder: Path, **config) -> Path:
    """A Llama with grouped-query attention (two KV heads), saved by transformers into ``folder``."""
    make_hf_checkpoint("llama", folder, seed=1, intermediate_size=192, **config)
    return folder


def qwen2_checkpoint(make_hf_checkpoint, folder: Path, **config) -> Path:
    """A Qwen2 (q/k/v biases, tied embeddings, one KV head, an odd vocabulary of 301), saved by
    transformers into ``folder``."""
    make_hf_checkpoint("qwen2", folder, seed=2, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=301,
                       **config)
    return folder


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts, every third one behind a shared 40-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    found = []
    for i in range(n):
        if i % 3 == 0:  # a shared 40-token prefix: prefix-cache hits for the later ones
            found.append(shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))])
        else:
            found.append([rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))])
    return found


def generate(engine: LLMEngine, prompts: list[list[int]], num_new: int) -> dict[str, object]:
    """Each prompt's ``num_new`` tokens, by request id: greedy with two logprobs, every fourth
    request seeded sampling instead."""
    greedy = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=num_new, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
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


class Outcome(NamedTuple):
    results: dict[str, object]
    kv_cache_bytes: int  # rank 0's
    preemptions: int


# One rank's outcomes (the reference every several-rank run is held to), computed once per run.
_ONE_RANK: dict[tuple, Outcome] = {}


def run_engine(folder: Path, settings: dict, *, num_new: int, num_prompts: int, tp: int = 1, pp: int = 1,
               inspect: Callable[[LLMEngine], None] | None = None) -> Outcome:
    """A CPU engine of ``tp x pp`` one-thread ranks over ``folder`` with ``settings``, run over
    ``num_prompts`` prompts; ``inspect`` sees the engine before it closes. One rank's outcome
    without ``inspect`` is computed once and then reused."""
    key = (str(folder), tuple(sorted(settings.items())), num_new, num_prompts)
    reuse = (tp, pp) == (1, 1) and inspect is None
    if reuse and key in _ONE_RANK:
        return _ONE_RANK[key]
    config = EngineConfig(model=str(folder), device="cpu", num_threads=1, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp, **settings)
    engine = LLMEngine(config)
    try:
        results = generate(engine, prompts(engine.info.vocab_size, num_prompts), num_new)
        outcome = Outcome(results, engine.runner.kv_cache_bytes, engine.scheduler.num_preemptions_total)
        if inspect is not None:
            inspect(engine)
    finally:
        engine.close()
    if reuse:
        _ONE_RANK[key] = outcome
    return outcome


def assert_generates_what_one_rank_does(one: Outcome, many: Outcome, logprob_tol: float = 1e-4) -> None:
    """Several ranks' run ``many`` against one rank's ``one``: as many preemptions (some), prefix
    hits (some), and per request the same tokens, cached tokens and top logprob tokens, the
    logprobs within ``logprob_tol``."""
    assert one.preemptions > 0 and many.preemptions == one.preemptions
    assert sum(o.num_cached_tokens for o in one.results.values()) > 0  # prefix hits happened
    for rid, out in one.results.items():
        theirs = many.results[rid]
        assert theirs.output_token_ids == out.output_token_ids, rid
        assert theirs.num_cached_tokens == out.num_cached_tokens
        if out.logprobs:
            assert [e["token_id"] for e in theirs.logprobs] == [e["token_id"] for e in out.logprobs]
            assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(theirs.logprobs, out.logprobs)) < logprob_tol


def record_safetensors_reads(monkeypatch) -> list[tuple[str, int]]:
    """Patch ``safetensors.safe_open`` so that every tensor read from a file, whole or through a
    slice, is recorded as (name, elements read) in the list returned."""
    import safetensors

    real = safetensors.safe_open
    reads: list[tuple[str, int]] = []

    class Recording:
        def __init__(self, *args, **kwargs):
            self._fh = real(*args, **kwargs)

        def __enter__(self):
            self._inner = self._fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            tensor = self._inner.get_tensor(name)
            reads.append((name, tensor.numel()))
            return tensor

        def get_slice(self, name):
            part = self._inner.get_slice(name)

            class Slice:
                def __getitem__(self, index):
                    tensor = part[index]
                    reads.append((name, tensor.numel()))
                    return tensor

                def __getattr__(self, attr):
                    return getattr(part, attr)

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return reads
