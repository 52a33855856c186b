"""Logits processing (kernels/penalties.py through workers/engine/logits_processors.py): presence,
frequency and repetition penalties, logit bias and min_tokens, held to a plain per-token PyTorch
reference and to transformers' logits processors, for rows alone and mixed in a batch."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from mqinfer.kernels.sampling import choice_seed
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.workers.engine.logits_processors import LogitsProcessors

VOCAB = 97
EOS = 2


def _request(rid: str, prompt: list[int], output: list[int], **sampling) -> EngineRequest:
    request = EngineRequest(rid, list(prompt), SamplingParams(max_tokens=64, **sampling),
                            eos_token_ids=frozenset({EOS}))
    for t in output:
        request.append_output_token(t)
    return request


def _apply(processors: LogitsProcessors, logits, requests, positions, keep_raw):
    """As the model runner calls it: with the rows of the requests the processors hold."""
    rows = [j for j, r in enumerate(requests) if r.request_id in processors.request_ids]
    return processors.apply(logits, rows, requests, positions, keep_raw)


def _reference_row(logits: torch.Tensor, request: EngineRequest) -> torch.Tensor:
    """One row, token by token, in plain Python arithmetic on float32 values."""
    sp = request.sampling
    out = logits.clone().float()
    for token, bias in sp.logit_bias:
        out[token] += bias
    seen = set(request.prompt_token_ids) | set(request.output_token_ids)
    for t in range(out.shape[0]):
        value = out[t]
        if t in seen and sp.repetition_penalty != 1.0:
            value = value / sp.repetition_penalty if value > 0 else value * sp.repetition_penalty
        count = request.output_token_ids.count(t)
        value = value - sp.frequency_penalty * count - sp.presence_penalty * (1.0 if count else 0.0)
        out[t] = value
    if request.num_output_tokens < sp.min_tokens:
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(request.eos_token_ids))
        for t in stops:
            out[t] = float("-inf")
    return out


def _random_requests(rng: random.Random, n: int) -> list[EngineRequest]:
    requests = []
    for i in range(n):
        kind = i % 6
        sampling = {}
        if kind in (0, 5):
            sampling["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
        if kind in (1, 5):
            sampling["frequency_penalty"] = rng.uniform(-2, 2)
            sampling["presence_penalty"] = rng.uniform(-2, 2)
        if kind in (2, 5):
            tokens = rng.sample(range(VOCAB), 5)
            sampling["logit_bias"] = tuple(sorted((t, rng.uniform(-100, 100)) for t in tokens))
        if kind in (3, 5):
            sampling["min_tokens"] = rng.randint(1, 8)
            sampling["stop_token_ids"] = (rng.randrange(VOCAB),)
        # kind 4: nothing: the row must come out unchanged
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
        requests.append(_request(f"r{i}", prompt, output, **sampling))
    return requests


@pytest.mark.parametrize("keep_raw", [False, True])
def test_a_mixed_batch_matches_the_reference_row_by_row(keep_raw):
    rng = random.Random(0)
    requests = _random_requests(rng, 36)
    processors = LogitsProcessors(VOCAB)
    for r in requests:
        processors.add(r)
    assert len(processors) == sum(r.sampling.processes_logits for r in requests)
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    raw = logits.clone()
    out = _apply(processors, logits, requests, [r.num_tokens for r in requests], keep_raw)
    for j, r in enumerate(requests):
        torch.testing.assert_close(out[j], _reference_row(raw[j], r), rtol=1e-6, atol=1e-5)
    if keep_raw:
        assert torch.equal(logits, raw)  # logprobs read the raw logits
    else:
        assert out is logits  # float32 logits and no logprobs: processed in place


def test_counts_follow_the_output_step_by_step_and_rows_alone_equal_rows_in_a_batch():
    rng = random.Random(3)
    requests = _random_requests(rng, 12)
    processors = LogitsProcessors(VOCAB)
    for r in requests:
        processors.add(r)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):  # each step: new output tokens, incremental counts
        for r in requests:
            for _ in range(rng.randint(0, 2)):
                r.append_output_token(rng.randrange(VOCAB))
        logits = torch.randn(len(requests), VOCAB, generator=gen) * 3
        batch = _apply(processors, logits.clone(), requests, [r.num_tokens for r in requests], False)
        for j, r in enumerate(requests):
            alone = _apply(processors, logits[j : j + 1].clone(), [r], [r.num_tokens], False)
            assert torch.equal(alone[0], batch[j])
            torch.testing.assert_close(batch[j], _reference_row(logits[j], r), rtol=1e-6, atol=1e-5)


def test_bfloat16_logits_are_processed_in_float32_in_a_copy():
    r = _request("a", [1, 2, 3], [3, 3], repetition_penalty=1.7, frequency_penalty=0.3)
    processors = LogitsProcessors(VOCAB)
    processors.add(r)
    logits = (torch.randn(1, VOCAB) * 5).to(torch.bfloat16)
    out = _apply(processors, logits, [r], [r.num_tokens], False)
    assert out.dtype == torch.float32 and out is not logits
    torch.testing.assert_close(out[0], _reference_row(logits[0].float(), r), rtol=1e-6, atol=1e-5)


def test_unprocessed_requests_are_not_held_and_a_step_without_work_returns_the_logits():
    """A request without processing is never held; one with only min_tokens is let go once past it."""
    plain = _request("p", [1, 2], [5])
    done = _request("m", [1, 2], [5, 6, 7], min_tokens=2)  # min_tokens reached: nothing left to do
    processors = LogitsProcessors(VOCAB)
    processors.add(plain)
    processors.add(done)
    assert "p" not in processors and "m" in processors
    logits = torch.randn(2, VOCAB)
    assert _apply(processors, logits, [plain, done], [plain.num_tokens, done.num_tokens], True) is logits
    assert len(processors) == 0  # a request past its min_tokens is let go


def test_min_tokens_follows_each_rows_position():
    """With proposals a request has several rows: each holds its stop tokens back by its own position."""
    r = _request("s", [1, 2, 3], [7], min_tokens=3, stop_token_ids=(9,))
    processors = LogitsProcessors(VOCAB)
    processors.add(r)
    logits = torch.zeros(3, VOCAB)
    # Rows sample output tokens 1, 2 and 3 (0-based): only the first two are before min_tokens.
    out = _apply(processors, logits, [r, r, r], [4, 5, 6], False)
    assert out[0, EOS] == out[0, 9] == out[1, EOS] == out[1, 9] == float("-inf")
    assert out[2, EOS] == out[2, 9] == 0.0
    ignore = _request("i", [1], [], min_tokens=2, ignore_eos=True)
    processors.add(ignore)
    out = _apply(processors, torch.zeros(1, VOCAB), [ignore], [1], False)
    assert out[0, EOS] == 0.0  # EOS does not stop a request with ignore_eos: nothing to hold back


@pytest.mark.parametrize("penalty", [0.6, 1.0, 1.5])
def test_against_transformers_logits_processors(penalty):
    """transformers applies sequence bias, then the repetition penalty over the whole input (prompt and
    output), then min_new_tokens; so do we, row by row."""
    rng = random.Random(int(penalty * 10))
    gen = torch.Generator().manual_seed(int(penalty * 10))
    processors = LogitsProcessors(VOCAB)
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 15))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))]
        bias = tuple(sorted((t, rng.uniform(-50, 50)) for t in rng.sample(range(VOCAB), 4)))
        min_tokens = rng.randint(0, 12)
        r = _request(f"h{i}", prompt, output, repetition_penalty=penalty, logit_bias=bias, min_tokens=min_tokens)
        processors.add(r)
        scores = torch.randn(1, VOCAB, generator=gen) * 4
        hf = LogitsProcessorList([
            SequenceBiasLogitsProcessor({(t,): b for t, b in bias}),
            RepetitionPenaltyLogitsProcessor(penalty),
            MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, EOS),
        ])
        input_ids = torch.tensor([prompt + output])
        expected = hf(input_ids, scores.clone())
        ours = _apply(processors, scores.clone(), [r], [r.num_tokens], False)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)


def test_choice_seeds_are_fixed_distinct_and_keep_choice_zero():
    seeds = [choice_seed(-7, i) for i in range(128)]
    assert seeds[0] == -7 & ((1 << 63) - 1)
    assert len(set(seeds)) == 128 and all(0 <= s < 1 << 63 for s in seeds)
    assert seeds == [choice_seed(-7, i) for i in range(128)]
    assert choice_seed(8, 1) != choice_seed(9, 1)
