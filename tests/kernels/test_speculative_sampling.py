"""Speculative sampling's acceptance rule on synthetic distributions: the tokens emitted with
proposals follow exactly the target distribution (chi-squared over many seeded draws, with
fixed seeds, so the test is deterministic)."""

from __future__ import annotations

import math

import torch

from mqinfer.kernels.sampling import SamplingTensors, accept_proposals, apply_top_k_top_p, sample

V = 8
N = 20_000


def _chi2_z(observed: list[int], expected: list[float]) -> float:
    """The chi-squared statistic of ``observed`` against ``expected`` counts as a standard normal
    score (Wilson-Hilferty), cells with an expected count under 5 merged into one."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            rest_o, rest_e = rest_o + o, rest_e + e
        else:
            obs.append(o)
            exp.append(e)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    assert len(obs) >= 2
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    k = len(obs) - 1
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def _target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution the sampler must draw from after the request's processing."""
    scaled = logits[None, :] / temperature
    masked = apply_top_k_top_p(scaled, torch.tensor([top_k]) if top_k else None,
                               torch.tensor([top_p]) if top_p < 1 else None)
    return torch.softmax(masked, dim=-1)[0].tolist()


def _rows(logits_per_position: list[torch.Tensor], seeds: range, first_position: int, temperature: float,
          top_k: int, top_p: float) -> list[list[int]]:
    """Tokens sampled at each position for every seed: ``out[j][n]`` at position first + j."""
    n = len(seeds)
    out = []
    for j, logits in enumerate(logits_per_position):
        params = SamplingTensors.from_lists(
            temperature=[temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n,
            seeds=list(seeds), positions=[first_position + j] * n,
        )
        out.append(sample(logits.expand(n, V).contiguous(), params).tolist())
    return out


SETTINGS = [(1.0, 0, 1.0), (0.7, 6, 0.9)]


def test_one_proposal_is_accepted_with_its_probability_and_the_rest_follow_the_residual():
    torch.manual_seed(0)
    logits = torch.randn(V) * 1.5
    for temperature, top_k, top_p in SETTINGS:
        p = _target(logits, temperature, top_k, top_p)
        proposal = max(range(V), key=lambda t: p[t])  # a likely proposal: both outcomes are common
        tokens = _rows([logits, logits], range(N), 100, temperature, top_k, top_p)
        emitted_first = []
        accepted = 0
        after_reject = [0] * V
        for n in range(N):
            a = accept_proposals([proposal], [tokens[0][n], tokens[1][n]])
            emitted_first.append(proposal if a else tokens[0][n])
            accepted += a
            if not a:
                after_reject[tokens[0][n]] += 1
        # Accepted with probability p(t): a binomial count within 4 standard deviations.
        mean, sd = N * p[proposal], math.sqrt(N * p[proposal] * (1 - p[proposal]))
        assert abs(accepted - mean) < 4 * sd, (accepted, mean)
        # The first emitted token follows p.
        counts = [emitted_first.count(t) for t in range(V)]
        assert _chi2_z(counts, [N * q for q in p]) < 3.5
        # After a rejection: p with the proposal removed, renormalised.
        assert after_reject[proposal] == 0
        rest = 1 - p[proposal]
        residual = [0.0 if t == proposal else q / rest for t, q in enumerate(p)]
        rejected = N - accepted
        assert _chi2_z([c for t, c in enumerate(after_reject) if t != proposal],
                       [rejected * q for t, q in enumerate(residual) if t != proposal]) < 3.5


def test_runs_of_proposals_emit_the_target_sequence_distribution():
    """Two proposals over three positions whose distributions differ: every emitted sequence
    (rejected at the first, at the second, or both accepted plus a third token) has its
    autoregressive probability."""
    torch.manual_seed(1)
    logits = [torch.randn(V) * 1.2 for _ in range(3)]
    temperature, top_k, top_p = 0.9, 0, 0.95
    ps = [_target(x, temperature, top_k, top_p) for x in logits]
    proposals = [max(range(V), key=lambda t: ps[0][t]), max(range(V), key=lambda t: ps[1][t])]
    tokens = _rows(logits, range(N), 40, temperature, top_k, top_p)
    outcomes: dict[tuple[int, ...], int] = {}
    for n in range(N):
        sampled = [tokens[0][n], tokens[1][n], tokens[2][n]]
        a = accept_proposals(proposals, sampled)
        emitted = tuple(proposals[:a]) + (sampled[a],)
        outcomes[emitted] = outcomes.get(emitted, 0) + 1
    t0, t1 = proposals
    expected: dict[tuple[int, ...], float] = {}
    for x in range(V):
        if x != t0:
            expected[(x,)] = ps[0][x]
        if x != t1:
            expected[(t0, x)] = ps[0][t0] * ps[1][x]
        expected[(t0, t1, x)] = ps[0][t0] * ps[1][t1] * ps[2][x]
    assert set(outcomes) <= set(expected)
    keys = sorted(expected)
    assert _chi2_z([outcomes.get(k, 0) for k in keys], [N * expected[k] for k in keys]) < 3.5
    # Both outcomes of each proposal happen often enough for the test to mean something.
    assert outcomes.get((t0, t1, t0), 0) + sum(v for k, v in outcomes.items() if len(k) == 3) > N // 20
    assert sum(v for k, v in outcomes.items() if len(k) == 1) > N // 20


def test_accept_proposals_keeps_the_longest_matching_prefix():
    assert accept_proposals([], [5]) == 0
    assert accept_proposals([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_proposals([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accept_proposals([1, 2, 3], [0, 2, 3, 4]) == 0
