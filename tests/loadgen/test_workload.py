"""Workloads: seeded, in range, in the request format, with the promised shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.loadgen.workload import (
    FIXED_OUTPUT_LEN,
    FIXED_PROMPT_LEN,
    MIN_TOKEN_ID,
    WORKLOADS,
    fit_to_context,
    fixed_workload,
    lognormal_workload,
    make_workload,
    shared_prefix_workload,
    standard_workload,
    uniform_workload,
    workload_stats,
)
from mqinfer.schemas.request import request_from_obj


def test_standard_workload_is_seeded_and_in_range():
    a = standard_workload()
    assert a == standard_workload(vocab_size=32000, n=256, seed=0)
    assert a != standard_workload(seed=1)
    assert len(a) == 256 and len({r["id"] for r in a}) == 256
    p = [len(r["prompt_token_ids"]) for r in a]
    o = [r["max_tokens"] for r in a]
    assert min(p) >= 16 and max(p) <= 256
    assert min(o) >= 16 and max(o) <= 128
    # 256 uniform draws cover most of the range: a narrower generator would fail these.
    assert min(p) < 30 and max(p) > 240 and min(o) < 24 and max(o) > 120
    assert 120 < sum(p) / len(p) < 152 and 64 < sum(o) / len(o) < 80
    ids = [t for r in a for t in r["prompt_token_ids"]]
    assert min(ids) >= MIN_TOKEN_ID and max(ids) < 32000
    assert max(ids) > 31000  # the whole vocabulary is used
    for r in a:
        assert r["ignore_eos"] is True and r["temperature"] == 0
        assert set(r) == {"id", "prompt_token_ids", "max_tokens", "ignore_eos", "temperature"}


def test_requests_pass_the_request_schema():
    for name in WORKLOADS:
        for obj in make_workload(name, n=5, vocab_size=1000):
            req = request_from_obj(obj)
            assert req.ignore_eos and req.temperature == 0.0
            assert req.max_tokens == obj["max_tokens"]


def test_stats_add_up():
    reqs = standard_workload(n=10, seed=3)
    s = workload_stats(reqs)
    assert s.num_requests == 10
    assert s.prompt_tokens == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert s.output_tokens == sum(r["max_tokens"] for r in reqs)
    assert s.max_prompt_len == max(len(r["prompt_token_ids"]) for r in reqs)


def test_vocab_size_changes_tokens_not_lengths():
    a = standard_workload(vocab_size=32000, n=20)
    b = standard_workload(vocab_size=256, n=20)
    assert [len(r["prompt_token_ids"]) for r in a] == [len(r["prompt_token_ids"]) for r in b]
    assert [r["max_tokens"] for r in a] == [r["max_tokens"] for r in b]
    assert max(t for r in b for t in r["prompt_token_ids"]) < 256


def test_lognormal_is_long_tailed_and_clipped():
    reqs = lognormal_workload(2000, prompt_median=64, prompt_sigma=1.0, prompt_len=(8, 400), output_median=32,
                              output_sigma=0.5, output_len=(4, 200), seed=5)
    p = sorted(len(r["prompt_token_ids"]) for r in reqs)
    o = sorted(r["max_tokens"] for r in reqs)
    assert p[0] >= 8 and p[-1] <= 400 and o[0] >= 4 and o[-1] <= 200
    assert 55 <= p[len(p) // 2] <= 75 and 28 <= o[len(o) // 2] <= 37  # medians near the asked ones
    assert sum(p) / len(p) > p[len(p) // 2] * 1.3  # mean well above median: a right tail
    assert p.count(400) > 5  # sigma 1 puts a few percent past 400, clipped onto it


def test_shared_prefix_shares_exactly_the_prefixes():
    reqs = shared_prefix_workload(24, num_prefixes=4, prefix_len=32, suffix_len=(0, 10), output_len=(5, 6), seed=2)
    prefixes = {tuple(r["prompt_token_ids"][:32]) for r in reqs}
    assert len(prefixes) == 4
    for i, r in enumerate(reqs):
        assert r["prompt_token_ids"][:32] == reqs[i % 4]["prompt_token_ids"][:32]
        assert 32 <= len(r["prompt_token_ids"]) <= 42
        assert r["max_tokens"] in (5, 6)
    # Suffixes are random: no two requests are the same prompt.
    assert len({tuple(r["prompt_token_ids"]) for r in reqs if len(r["prompt_token_ids"]) > 33}) == len(
        [r for r in reqs if len(r["prompt_token_ids"]) > 33])


def test_named_workloads_take_length_overrides():
    u = make_workload("uniform", n=30, prompt_len=(5, 9), output_len=(2, 3), seed=4)
    assert all(5 <= len(r["prompt_token_ids"]) <= 9 and r["max_tokens"] in (2, 3) for r in u)
    ln = make_workload("lognormal", n=30, prompt_len=(40, 50), output_len=(7, 7))
    assert all(40 <= len(r["prompt_token_ids"]) <= 50 and r["max_tokens"] == 7 for r in ln)
    sp = make_workload("shared-prefix", n=8, output_len=(3, 3))
    assert all(r["max_tokens"] == 3 for r in sp)
    with pytest.raises(ValueError, match="fixed lengths"):
        make_workload("standard", output_len=(1, 2))
    with pytest.raises(ValueError, match="does not apply"):
        make_workload("shared-prefix", prompt_len=(1, 2))
    fitted = make_workload("standard", n=50, max_model_len=100)
    assert all(len(r["prompt_token_ids"]) + r["max_tokens"] <= 100 for r in fitted)


def test_fit_to_context_keeps_prompt_end_and_room_for_output():
    req = {"id": "x", "prompt_token_ids": list(range(3, 103)), "max_tokens": 30, "ignore_eos": True,
           "temperature": 0.0}
    assert fit_to_context(req, 1000) is req
    cut = fit_to_context(req, 64)
    assert cut["prompt_token_ids"] == list(range(69, 103)) and cut["max_tokens"] == 30
    tiny = fit_to_context(req, 16)
    assert tiny["max_tokens"] == 15 and tiny["prompt_token_ids"] == [102]


@pytest.mark.parametrize("call", [
    lambda: uniform_workload(0),
    lambda: uniform_workload(4, prompt_len=(10, 5)),
    lambda: uniform_workload(4, output_len=(0, 5)),
    lambda: uniform_workload(4, vocab_size=3),
    lambda: shared_prefix_workload(4, num_prefixes=0),
    lambda: lognormal_workload(4, prompt_median=0),
    lambda: make_workload("zipf"),
])
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), lo=st.integers(1, 50), span=st.integers(0, 50),
       vocab=st.integers(4, 70000))
def test_uniform_lengths_and_ids_always_in_range(n, seed, lo, span, vocab):
    reqs = uniform_workload(n, prompt_len=(lo, lo + span), output_len=(lo, lo + span), vocab_size=vocab, seed=seed)
    assert reqs == uniform_workload(n, prompt_len=(lo, lo + span), output_len=(lo, lo + span), vocab_size=vocab,
                                    seed=seed)
    for r in reqs:
        assert lo <= len(r["prompt_token_ids"]) <= lo + span
        assert lo <= r["max_tokens"] <= lo + span
        assert all(MIN_TOKEN_ID <= t < vocab for t in r["prompt_token_ids"])


def test_fixed_workload_has_exact_lengths_and_ids_above_the_special_ones():
    reqs = make_workload("fixed", n=12, prompt_len=16, output_len=8, vocab_size=49152, min_token_id=17, seed=7)
    assert [r["id"] for r in reqs] == [f"fixed-{i:06d}" for i in range(12)]
    assert all(len(r["prompt_token_ids"]) == 16 and r["max_tokens"] == 8 for r in reqs)
    assert all(r["ignore_eos"] is True and r["temperature"] == 0.0 for r in reqs)
    ids = [t for r in reqs for t in r["prompt_token_ids"]]
    assert min(ids) >= 17 and max(ids) < 49152
    assert min(ids) < 5000 and max(ids) > 44000  # drawn across the whole ordinary range
    assert len({tuple(r["prompt_token_ids"]) for r in reqs}) == 12  # no prompt shared (batched-bench's default)
    assert reqs == fixed_workload(12, prompt_len=16, output_len=8, vocab_size=49152, min_token_id=17, seed=7)
    assert reqs != fixed_workload(12, prompt_len=16, output_len=8, vocab_size=49152, min_token_id=17, seed=8)
    s = workload_stats(reqs)
    assert (s.prompt_tokens, s.output_tokens, s.max_prompt_len, s.max_output_len) == (192, 96, 16, 8)
    # Without lengths (as `mqinfer memory --workload fixed` asks), the defaults.
    default = make_workload("fixed", n=2)
    assert [len(r["prompt_token_ids"]) for r in default] == [FIXED_PROMPT_LEN] * 2
    assert [r["max_tokens"] for r in default] == [FIXED_OUTPUT_LEN] * 2


def test_fixed_workload_is_never_trimmed_and_takes_single_lengths_only():
    fits = make_workload("fixed", n=2, prompt_len=60, output_len=40, max_model_len=100)
    assert [len(r["prompt_token_ids"]) + r["max_tokens"] for r in fits] == [100, 100]
    with pytest.raises(ValueError, match=r"prompt \+ output \(101 tokens\) exceeds the model's context \(100\)"):
        make_workload("fixed", n=2, prompt_len=61, output_len=40, max_model_len=100)
    with pytest.raises(ValueError, match="one integer"):
        make_workload("fixed", n=2, prompt_len=(4, 8), output_len=4)
    with pytest.raises(ValueError, match="one integer"):
        fixed_workload(2, prompt_len=4, output_len=0)
    with pytest.raises(ValueError, match=r"ranges \(LO, HI\)"):
        make_workload("uniform", n=2, prompt_len=8)
    with pytest.raises(ValueError, match="vocab_size must be > 17"):
        fixed_workload(2, vocab_size=17, min_token_id=17)


def test_min_token_id_moves_the_low_end_for_every_workload():
    for name in WORKLOADS:
        reqs = make_workload(name, n=20, vocab_size=40, min_token_id=30, seed=1)
        ids = {t for r in reqs for t in r["prompt_token_ids"]}
        assert min(ids) >= 30 and max(ids) <= 39 and len(ids) == 10, name
