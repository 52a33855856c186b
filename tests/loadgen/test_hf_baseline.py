"""The transformers baselines on a small real checkpoint: right tokens, right counts, right clocks."""

from __future__ import annotations

import pytest
import torch

from mqinfer.loadgen import hf_baseline
from mqinfer.loadgen.checkpoint import make_llama_checkpoint
from mqinfer.loadgen.workload import uniform_workload

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("hf") / "ck", **SMALL)
    # float32, so that padding and batching cannot flip a greedy choice and outputs compare exactly.
    return hf_baseline.load_hf_model(folder, dtype="float32")


@pytest.fixture(scope="module")
def requests():
    return uniform_workload(6, prompt_len=(4, 12), output_len=(2, 6), vocab_size=300, seed=1)


def greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_static_batching_generates_greedy_tokens_and_counts_only_asked_tokens(model, requests):
    res = hf_baseline.run_static(model, requests, 4, progress=None)
    asked = sum(r["max_tokens"] for r in requests)
    assert res.system == "hf-static" and res.batch_size == 4 and res.label == "hf-static@4"
    assert res.requested_tokens == asked == res.summary.requested_tokens
    # Two batches, each run to its longest request.
    assert res.computed_tokens == 4 * max(r["max_tokens"] for r in requests[:4]) + 2 * max(
        r["max_tokens"] for r in requests[4:])
    for r in requests:
        assert res.outputs[r["id"]] == greedy(model, r["prompt_token_ids"], r["max_tokens"])
    t = {x.id: x for x in res.timings}
    first, last = t[requests[0]["id"]], t[requests[-1]["id"]]
    assert first.finished_at <= last.started_at  # batches run one after the other
    assert first.started_at < first.first_token_at <= first.finished_at
    assert res.summary.span_s == pytest.approx(last.finished_at - first.started_at)
    assert res.throughput == pytest.approx(asked / res.summary.span_s)
    # Batch size does not change what greedy decoding produces.
    assert hf_baseline.run_static(model, requests, 1, progress=None).outputs == res.outputs


def test_best_static_picks_the_fastest(model, requests):
    best, every = hf_baseline.best_static(model, requests, (2, 6), progress=None)
    assert [r.batch_size for r in every] == [2, 6]
    assert best.throughput == max(r.throughput for r in every)


def test_continuous_batching_honours_each_max_tokens(model, requests):
    assert hf_baseline.continuous_batching_available(model) is None
    res = hf_baseline.run_continuous(model, requests, max_batch_tokens=64, progress=None)
    assert res.system == "hf-continuous" and res.label == "hf-continuous"
    asked = sum(r["max_tokens"] for r in requests)
    assert res.computed_tokens == res.requested_tokens == asked  # no padding, no overshoot
    for r in requests:
        assert res.outputs[r["id"]] == greedy(model, r["prompt_token_ids"], r["max_tokens"])
    for x in res.timings:
        assert x.enqueued_at <= x.started_at <= x.first_token_at <= x.finished_at
    assert res.summary.num_errors == 0 and res.throughput > 0


def test_bad_arguments(model, requests):
    with pytest.raises(ValueError):
        hf_baseline.run_static(model, requests, 0, progress=None)
    with pytest.raises(ValueError):
        hf_baseline.run_continuous(model, requests + requests[:1], progress=None)
