"""Sampling: greedy, temperature, top-k/top-p masks, batch-independent seeded randomness."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.kernels.sampling import (
    SamplingTensors,
    apply_top_k_top_p,
    compute_logprobs,
    greedy,
    mix64,
    TOPK_CANDIDATES,
    random_uniforms,
    reference_apply_top_k_top_p,
    sample,
    sort_rows,
)


def _params(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    def per_row(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * n

    return SamplingTensors.from_lists(
        temperature=per_row(temperature), top_k=per_row(top_k), top_p=per_row(top_p),
        seeds=per_row(seeds if seeds is not None else list(range(n))),
        positions=per_row(positions if positions is not None else 0),
    )


def _splitmix64_py(z: int) -> int:
    mask = (1 << 64) - 1
    z &= mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_mix64_matches_unsigned_reference():
    values = [0, 1, 12345, -1, -(1 << 63), (1 << 63) - 1, 0x0123456789ABCDEF]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    expected = [_splitmix64_py(v) for v in values]
    assert [g & ((1 << 64) - 1) for g in got] == expected


def test_uniforms_in_open_interval_and_roughly_uniform():
    u = random_uniforms(torch.arange(64), torch.arange(64) * 7, 4096)
    assert u.shape == (64, 4096)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    # Different seeds and positions give different streams.
    assert not torch.equal(u[0], u[1])


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.5]
    out = sample(logits, _params(6, temperature=temps))
    for i, t in enumerate(temps):
        if t == 0.0:
            assert out[i] == logits[i].argmax()
    all_greedy = sample(logits, _params(6, temperature=0.0))
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_greedy_on_bfloat16_picks_the_first_maximum_like_argmax_on_float32():
    # bfloat16 logits tie often; greedy must pick what argmax over the float32 values picks (the
    # first maximal index), with or without sampled rows beside it.
    torch.manual_seed(1)
    logits = torch.randint(0, 4, (64, 3000)).to(torch.bfloat16)
    expected = logits.float().argmax(-1)
    assert torch.equal(greedy(logits), expected)
    assert torch.equal(sample(logits, _params(64, temperature=0.0)), expected)
    temps = [0.0 if i % 2 else 0.8 for i in range(64)]
    mixed = sample(logits, _params(64, temperature=temps))
    assert torch.equal(mixed[1::2], expected[1::2])
    # Sampled rows are drawn from the float32 values: the same draw as from float32 logits.
    assert torch.equal(mixed, sample(logits.float(), _params(64, temperature=temps)))


def test_top_k_keeps_exactly_the_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    ks = torch.tensor([1, 5, 0, 30])
    masked = apply_top_k_top_p(logits, ks, None)
    for row, k in enumerate(ks.tolist()):
        kept = torch.isfinite(masked[row]).nonzero().squeeze(1)
        expected = logits[row].topk(k or 30).indices
        assert sorted(kept.tolist()) == sorted(expected.tolist())
        torch.testing.assert_close(masked[row][kept], logits[row][kept])


def _naive_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1)
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += float(probs[i])
        if mass >= p:
            break
    return kept


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.floats(0.05, 1.0), vocab=st.integers(2, 40))
def test_top_p_keeps_the_smallest_prefix_reaching_p(seed, p, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=gen) * 3
    masked = apply_top_k_top_p(logits, None, torch.tensor([p]))
    kept = set(torch.isfinite(masked[0]).nonzero().squeeze(1).tolist())
    expected = _naive_top_p(logits[0], p)
    # Floating-point sums may disagree on the exact boundary token; allow that one only.
    assert kept == expected or len(kept ^ expected) == 1


def test_top_k_then_top_p_on_the_remaining_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # After top-k 2 the distribution is (4/7, 3/7): p 0.5 keeps only the first.
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False]
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.8]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False]


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    torch.manual_seed(2)
    row = torch.randn(1, 100)
    n = 500
    logits = row.expand(n, 100).contiguous()
    out = sample(logits, _params(n, top_k=3, seeds=list(range(n))))
    assert set(out.tolist()) <= set(row[0].topk(3).indices.tolist())
    assert len(set(out.tolist())) == 3
    out = sample(logits, _params(n, top_p=0.3, seeds=list(range(n))))
    assert set(out.tolist()) <= _naive_top_p(row[0], 0.3)


def test_seeded_sampling_is_batch_independent():
    torch.manual_seed(3)
    vocab = 64
    target = torch.randn(vocab)
    alone = sample(target[None], _params(1, temperature=0.9, top_k=20, top_p=0.95, seeds=[42], positions=[17]))
    for batch_size, index in ((5, 0), (5, 3), (9, 8)):
        logits = torch.randn(batch_size, vocab)
        logits[index] = target
        temps = [1.3] * batch_size
        temps[1 if index != 1 else 0] = 0.0  # a greedy neighbour too
        seeds = list(range(100, 100 + batch_size))
        positions = list(range(batch_size))
        ks, ps = [0] * batch_size, [1.0] * batch_size
        temps[index], seeds[index], positions[index], ks[index], ps[index] = 0.9, 42, 17, 20, 0.95
        out = sample(logits, _params(batch_size, temperature=temps, top_k=ks, top_p=ps, seeds=seeds,
                                     positions=positions))
        assert out[index] == alone[0]


def test_seed_and_position_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: any change in randomness shows
    draws = {int(sample(logits, _params(1, seeds=[s], positions=[p]))[0]) for s in range(5) for p in range(5)}
    assert len(draws) > 20
    again = {int(sample(logits, _params(1, seeds=[s], positions=[p]))[0]) for s in range(5) for p in range(5)}
    assert again == draws


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 8000
    logits = torch.log(probs).expand(n, 4).contiguous()
    out = sample(logits, _params(n, seeds=list(range(n)), positions=[3] * n))
    freq = torch.bincount(out, minlength=4).double() / n
    # 4 standard deviations of a binomial proportion: deterministic (fixed seeds) and loose.
    tol = 4 * torch.sqrt(probs.double() * (1 - probs.double()) / n)
    assert torch.all((freq - probs.double()).abs() < tol), freq


def test_temperature_sharpens_and_flattens():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000
    logits = torch.log(probs).expand(n, 3).contiguous()
    seeds = list(range(n))
    cold = torch.bincount(sample(logits, _params(n, temperature=0.25, seeds=seeds)), minlength=3) / n
    hot = torch.bincount(sample(logits, _params(n, temperature=4.0, seeds=seeds)), minlength=3) / n
    # At T the probabilities are p^(1/T) normalised.
    for t, freq in ((0.25, cold), (4.0, hot)):
        expected = probs ** (1 / t)
        expected = expected / expected.sum()
        assert torch.all((freq - expected).abs() < 0.03), (t, freq, expected)


def test_compute_logprobs_uses_raw_distribution():
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    sampled = torch.tensor([5, 0, 19])
    lp = compute_logprobs(logits, sampled, 4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp.sampled, ref[torch.arange(3), sampled])
    top = ref.topk(4)
    assert torch.equal(lp.top_ids, top.indices)
    torch.testing.assert_close(lp.top_logprobs, top.values)
    assert math.isclose(float(torch.logsumexp(ref[0], 0)), 0.0, abs_tol=1e-5)
    with pytest.raises(ValueError):
        compute_logprobs(logits, sampled, -1)


def _torch_draw(logits, params):
    """The PyTorch draw as sample() made it before its native kernel: Gumbel-max over the
    scaled, masked float32 logits with -log(-log(random_uniforms))."""
    scaled = logits.float() / params.temperature[:, None]
    scaled = apply_top_k_top_p(scaled, params.top_k if params.any_top_k else None,
                               params.top_p if params.any_top_p else None)
    uniforms = random_uniforms(params.seeds, params.positions, logits.shape[-1])
    return torch.argmax(scaled + -torch.log(-torch.log(uniforms)), dim=-1)


@pytest.mark.parametrize("vocab", [1, 7, 4097, 32003])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (40, 1.0), (0, 0.9), (50, 0.8)])
def test_sample_native_and_torch_paths_give_the_torch_draw(monkeypatch, vocab, temperature, top_k, top_p):
    torch.manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab) * torch.tensor([0.0, 0.1, 1.0, 4.0, 20.0, 60.0]).repeat(4)[:, None]
    params = _params(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                     seeds=[s * 7919 + vocab for s in range(rows)], positions=list(range(100, 100 + rows)))
    expected = _torch_draw(logits, params)
    assert torch.equal(sample(logits, params), expected)
    assert torch.equal(sample(logits.to(torch.bfloat16), params), _torch_draw(logits.to(torch.bfloat16), params))
    monkeypatch.setenv("MQINFER_CPU_OPS", "torch")
    assert torch.equal(sample(logits, params), expected)


def test_sample_takes_the_native_draw_unless_switched_to_torch(monkeypatch):
    from mqinfer.kernels import cpu_ops

    if not cpu_ops.cpu_ops_available():
        pytest.skip("no C compiler for the native CPU ops")
    calls = []
    real = cpu_ops.reference_gumbel_argmax
    monkeypatch.setattr(cpu_ops, "reference_gumbel_argmax", lambda *a: calls.append(1) or real(*a))
    logits, params = torch.randn(4, 100), _params(4)
    native = sample(logits, params)
    assert calls == []
    monkeypatch.setenv("MQINFER_CPU_OPS", "torch")
    assert torch.equal(sample(logits, params), native) and calls == [1]


def test_sample_native_draw_on_one_large_batch_and_single_token_rows():
    torch.manual_seed(5)
    rows, vocab = 256, 49152
    logits = torch.randn(rows, vocab) * 3
    logits[::16] = float("-inf")
    logits[::16, 777] = 0.0  # every token masked but one: that one
    temps = [0.0 if i % 5 == 4 else (0.3, 1.0, 2.0)[i % 3] for i in range(rows)]
    params = _params(rows, temperature=temps, seeds=list(range(1000, 1000 + rows)), positions=list(range(rows)))
    got = sample(logits, params)
    sampled = params.temperature > 0
    assert torch.equal(got[sampled], _torch_draw(logits[sampled], _params(
        int(sampled.sum()), temperature=[t for t in temps if t > 0],
        seeds=[s for s, t in zip(range(1000, 1000 + rows), temps) if t > 0],
        positions=[p for p, t in zip(range(rows), temps) if t > 0])))
    assert bool((got[::16] == 777).all())


def _logits_of_kind(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "peaked":
        x = x * 10
    elif kind == "equal":
        x = torch.full((rows, vocab), 0.25)
    elif kind == "bf16":  # few distinct values: many ties, at every rank
        x = (x * 3).to(torch.bfloat16).float()
    elif kind == "neg_inf":
        x = x.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.5, float("-inf"))
    elif kind == "one_finite":
        x = torch.full((rows, vocab), float("-inf"))
        x[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = 1.5
    return x


def _row_params(rows: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ks = torch.tensor([0, 1, 5, 50, vocab, vocab + 3])
    ps = torch.tensor([1.0, 0.95, 0.5, 1e-6])
    return (ks[torch.randint(0, len(ks), (rows,), generator=gen)],
            ps[torch.randint(0, len(ps), (rows,), generator=gen)])


def _assert_same_as_reference(logits, top_k, top_p, sorted_rows=None):
    fast = apply_top_k_top_p(logits, top_k, top_p)
    expected = reference_apply_top_k_top_p(logits, top_k, top_p, sorted_rows=sorted_rows)
    nan = torch.isnan(expected)  # NaN logits stay NaN, and NaN equals nothing
    assert torch.equal(torch.isnan(fast), nan)
    assert torch.equal(fast.masked_fill(nan, 0.0), expected.masked_fill(nan, 0.0))


@pytest.mark.parametrize("vocab", [1, 7, 100, 4097, 49152])
@pytest.mark.parametrize("kind", ["randn", "peaked", "equal", "bf16", "neg_inf", "one_finite"])
def test_top_k_top_p_equals_the_full_sort_reference(vocab, kind):
    gen = torch.Generator().manual_seed(vocab * 7 + len(kind))
    for rows in (1, 6 if vocab == 49152 else 24):
        logits = _logits_of_kind(kind, rows, vocab, gen)
        ks, ps = _row_params(rows, vocab, gen)
        _assert_same_as_reference(logits, ks, ps)
        _assert_same_as_reference(logits, ks, None)
        _assert_same_as_reference(logits, None, ps)


@pytest.mark.parametrize("kind", ["peaked", "bf16"])
def test_top_k_top_p_equals_the_reference_on_a_full_step(kind):
    gen = torch.Generator().manual_seed(5)
    logits = _logits_of_kind(kind, 192, 49152, gen)
    ks, ps = _row_params(192, 49152, gen)
    rows = sort_rows(logits)  # the reference's sort, once for the four settings
    _assert_same_as_reference(logits, ks, ps, rows)
    for k, p in ((50, 1.0), (40, 0.9), (0, 0.95)):
        _assert_same_as_reference(logits, torch.full((192,), k), torch.full((192,), p), rows)


def test_top_k_top_p_on_flat_rows_and_large_k():
    # Nearly flat rows: the nucleus holds thousands of tokens, beyond the top-k candidates.
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 49152, generator=gen) * 0.01
    ps = torch.tensor([0.95, 0.5, 0.9, 1.0])
    masked = apply_top_k_top_p(logits, None, ps)
    assert int(torch.isfinite(masked[0]).sum()) > TOPK_CANDIDATES
    assert torch.equal(masked, reference_apply_top_k_top_p(logits, None, ps))
    ks = torch.tensor([TOPK_CANDIDATES + 1, 2000, 1, 0])
    _assert_same_as_reference(logits, ks, ps)
    _assert_same_as_reference(logits, ks, None)


def test_top_k_top_p_rows_the_count_cannot_settle_take_the_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen)
    logits[1, 17] = float("nan")
    logits[2, 5] = float("inf")
    ks, ps = torch.tensor([0, 50, 0, 10]), torch.tensor([0.9, 0.9, 0.5, 0.0])
    _assert_same_as_reference(logits, ks, ps)
    _assert_same_as_reference(logits, ks, None)
    # Not CPU float32 [B, V]: the reference itself.
    _assert_same_as_reference(logits.double(), ks, ps)


def test_top_p_of_one_is_off_even_where_the_tail_mass_rounds_to_one():
    # Peaked rows: past the first few tokens the running mass is 1.0 in float32, yet p = 1 keeps
    # every token, beside a row with p < 1 in the same batch.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 4097, generator=gen) * 10
    ps = torch.ones(8)
    ps[3] = 0.9
    for fn in (apply_top_k_top_p, reference_apply_top_k_top_p):
        out = fn(logits, None, ps)
        keep = torch.ones(8, dtype=torch.bool)
        keep[3] = False
        assert torch.equal(out[keep], logits[keep])
        assert bool(torch.isinf(out[3]).any()) and bool(torch.isfinite(out[3]).any())
    _assert_same_as_reference(logits, None, ps)
    _assert_same_as_reference(logits, torch.full((8,), 50), ps)


@pytest.mark.parametrize("vocab", [64, 100, 4097, 49152])
def test_softmax_and_cumsum_of_a_padded_prefix_match_the_whole_sorted_row(vocab):
    # What the top-k path rests on: after top-k the reference's sorted row is -inf past k; the
    # same values cut to a multiple of 64 give the same probabilities and running sums.
    gen = torch.Generator().manual_seed(vocab)
    values = torch.sort(torch.randn(16, vocab, generator=gen) * 4, dim=-1, descending=True).values
    for k in (1, 5, 50, 64, 1000):
        if k > vocab:
            continue
        width = min(vocab, -(-k // 64) * 64)
        whole = torch.softmax(values.masked_fill(torch.arange(vocab) >= k, float("-inf")), dim=-1)
        prefix = torch.softmax(values[:, :width].masked_fill(torch.arange(width) >= k, float("-inf")), dim=-1)
        assert torch.equal(whole[:, :width], prefix)
        assert torch.equal(torch.cumsum(whole, dim=-1)[:, :width], torch.cumsum(prefix, dim=-1))
