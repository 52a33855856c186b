"""Token sampling and log-probabilities for a batch of logits rows, fully vectorised.

Owns greedy / temperature / top-k / top-p sampling (``sample``) and the log-probabilities
reported back to users (``compute_logprobs``).

Seeded sampling is batch-independent: the randomness of row ``b`` is a pure function of that
request's seed, the position of the token being sampled and the vocabulary index, computed
with a counter-based hash (splitmix64 on int64 tensors, ``kernels/draws.py``). Gumbel-max over
those uniforms picks the token, so the same seed gives the same tokens whether the request runs
alone, in any batch, at any batch index, or after a preemption that recomputes it.

On CPU the Gumbel-max draw is a native kernel (``cpu_ops.gumbel_argmax``) that picks the same
tokens as the PyTorch expression without building the ``[B, V]`` uniforms and noise: on
``[192, 49152]`` logits it takes a few milliseconds where PyTorch takes ~400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mqinfer.kernels.cpu_ops import gumbel_argmax, greedy_argmax
from mqinfer.kernels.draws import draw_bits, mix64, row_keys, uniforms_of_draws


def random_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), ``[B, vocab_size]`` float32, a pure function of (seed, position, index).

    23 random bits per draw so that ``(k + 0.5) / 2**23`` is exact in float32 and never 0 or 1.
    """
    return uniforms_of_draws(draw_bits(row_keys(seeds, positions), vocab_size))


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index`` of a request seeded with ``seed`` (``n`` > 1): choice 0
    keeps the seed itself (so ``n`` = 1 samples as it always did), choice i > 0 a splitmix64 mix of
    (seed, i). A non-negative 63-bit int; the same for the same (seed, index), whatever the batch."""
    if index == 0:
        return seed & ((1 << 63) - 1)
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (built once per step by the model runner).

    ``temperature`` 0 means greedy. ``top_k`` 0 means off. ``positions`` is the position of
    the token being sampled (the request's current length), which keys the randomness.
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> "SamplingTensors":
        n = len(temperature)
        if not (len(top_k) == len(top_p) == len(seeds) == len(positions) == n):
            raise ValueError("sampling parameter lists must all have one entry per row")
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            all_greedy=all(t == 0.0 for t in temperature),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )


# Rows whose k is at most this take their candidates with ``torch.topk``; the others sort their
# values in full. A multiple of 64, so that a softmax over a candidate prefix padded with -inf sums
# in the same vector lanes as one over the whole sorted row (see ``apply_top_k_top_p``).
TOPK_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and then outside its top-p nucleus.

    Top-k keeps exactly k tokens (ties broken by index order). Top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches p (always at least one token), on
    the distribution left after top-k. Rows with k = 0 and p = 1 are unchanged (p = 1 is off: the
    tail tokens whose preceding mass rounds to 1.0 in float32 stay), as in
    ``reference_apply_top_k_top_p`` (the definition).

    The result equals the reference's bit for bit without its stable sort of every row with
    indices. Both steps keep the first n tokens of the stable descending order, for a count n per
    row; that set is every logit above the n-th largest value t plus the lowest-index logits equal
    to t, so it needs only sorted *values*, and equal values are interchangeable there. Rows with
    k <= ``TOPK_CANDIDATES`` take their k largest values with ``torch.topk`` (padded to a multiple
    of 64 with -inf); the others sort their values with NumPy (no indices, far faster than
    ``torch.sort``). Top-p runs the reference's own softmax and cumsum on those values: on the
    full sorted row they are the reference's values; on a top-k prefix, whose row in the reference
    is -inf past k, the softmax sums the same lanes (the padding adds exact zeros) and the cumsum
    is a sequential prefix scan, so they are too (the tests check both). Rows the count does not
    settle (NaN logits, a kept set that is not a prefix, none kept) and inputs other than CPU
    float32 ``[B, V]`` go to the reference.
    """
    if top_k is None and top_p is None:
        return logits
    if logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return reference_apply_top_k_top_p(logits, top_k, top_p)
    rows, vocab = logits.shape
    if top_k is None:
        k = torch.full((rows,), vocab, dtype=torch.int64)
    else:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    # Rows left as they are (top-k alone with k = V) keep the threshold -inf.
    counts = torch.full((rows,), vocab, dtype=torch.int64)
    thresholds = torch.full((rows,), float("-inf"))
    complete = torch.ones(rows, dtype=torch.bool)  # every logit equal to the threshold is known
    settled = torch.ones(rows, dtype=torch.bool)
    active = k < vocab if top_p is None else (k < vocab) | (top_p < 1.0)
    short = k <= TOPK_CANDIDATES
    for group in (torch.nonzero(active & short).squeeze(1), torch.nonzero(active & ~short).squeeze(1)):
        if group.numel() == 0:
            continue
        every = group.numel() == rows
        sub = logits if every else logits.index_select(0, group)
        group_k = k if every else k.index_select(0, group)
        group_p = None if top_p is None else (top_p if every else top_p.index_select(0, group))
        width = int(group_k.max())
        if width < vocab and width <= TOPK_CANDIDATES:
            width = min(vocab, -(-width // 64) * 64)
            values = torch.topk(sub, width, dim=-1, sorted=True).values
        else:
            width = vocab
            values = torch.from_numpy(np.sort(sub.numpy(), axis=-1)).flip(-1)
        n, ok = _kept_counts(values, group_k, group_p)
        t = values.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
        # Outside the values every logit is <= the smallest one: only then can one equal t.
        whole = (t > values[:, -1]) | (width == vocab)
        counts.index_copy_(0, group, n)
        thresholds.index_copy_(0, group, t)
        complete.index_copy_(0, group, whole & (_count(values >= t[:, None]) == n))
        settled.index_copy_(0, group, ok)
    out = logits.masked_fill(logits < thresholds[:, None], float("-inf"))
    # Rows where more logits equal t than the count leaves room for: the lowest indices win.
    ties = torch.nonzero(settled & ~complete).squeeze(1)
    if ties.numel():
        sub, t, n = logits.index_select(0, ties), thresholds[ties, None], counts[ties, None]
        equal = sub == t
        room = n - (sub > t).sum(-1, keepdim=True)
        drop = equal & (torch.cumsum(equal, dim=-1) > room)
        out.index_copy_(0, ties, out.index_select(0, ties).masked_fill(drop, float("-inf")))
    rest = torch.nonzero(~settled).squeeze(1)
    if rest.numel():
        pick = lambda v: None if v is None else v.index_select(0, rest)  # noqa: E731
        out.index_copy_(0, rest, reference_apply_top_k_top_p(logits.index_select(0, rest), pick(top_k), pick(top_p)))
    return out


def _kept_counts(
    values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many leading tokens of each row's stable sorted order stay, from the row's largest
    values sorted descending (``[R, W]``: all of them, or at least its k), and whether that count
    is the reference's answer: the row has no NaN and its kept positions are a non-empty prefix."""
    width = values.shape[-1]
    # Rows with k >= the width lose nothing to top-k: then no rank mask is built (the same values).
    remove = torch.arange(width)[None, :] >= k[:, None] if bool((k < width).any()) else None
    if top_p is not None:
        probs = torch.softmax(values if remove is None else values.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1).sub_(probs)
        by_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        remove = by_p if remove is None else remove | by_p
    elif remove is None:
        remove = torch.zeros_like(values, dtype=torch.bool)
    n = width - _count(remove)
    first_removed = torch.where(remove.any(-1), remove.view(torch.uint8).argmax(-1), width)
    ok = (n == first_removed) & (n > 0) & ~torch.isnan(values[:, 0])
    return n, ok


def _count(mask: torch.Tensor) -> torch.Tensor:
    """The True entries of each row of a bool ``[R, W]`` mask, int64 (summed as bytes into int32,
    which skips ``sum``'s int64 copy of the mask)."""
    return mask.view(torch.uint8).sum(-1, dtype=torch.int32).long()


def sort_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of ``logits`` in descending order, ties in index order (a stable sort), and the
    indices: the order ``reference_apply_top_k_top_p`` works in."""
    return torch.sort(logits, dim=-1, descending=True, stable=True)


def reference_apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, *,
    sorted_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``apply_top_k_top_p`` by a full stable sort of every row: the definition the fast path
    reproduces bit for bit, and its fallback for the rows and inputs it does not take.

    Top-k keeps exactly k tokens (ties broken by index order). Top-p keeps the tokens of the
    sorted distribution (after top-k) whose preceding mass, ``cumsum(probs) - probs`` in float32,
    is below p: the smallest prefix whose mass reaches p, always at least one token. p = 1 is off
    (the tail tokens whose preceding mass rounds to 1.0 stay).

    ``sorted_rows`` is ``sort_rows(logits)`` where the caller has it already: several settings
    of k and p over the same logits then sort them once (the sort is most of the cost).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = sort_rows(logits) if sorted_rows is None else sorted_rows
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        remove = ranks >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # The first token has mass_before 0 < p, so every row keeps at least one token; p = 1 is off.
        remove = remove | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    masked = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, masked)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first one on ties), ``[B]`` int64.

    On CPU a native one-pass kernel that reads bfloat16 rows as they are (about 6x faster
    than ``max(dim).indices`` on ``[256, 32000]``); elsewhere ``max(dim).indices``, which, unlike
    ``argmax``, reads bfloat16 rows without converting them and picks the same index (the
    first maximal value).
    """
    return greedy_argmax(logits)


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """One token id per row of ``logits`` (``[B, V]``, float32 or the model's dtype; the
    sampling arithmetic runs in float32): ``[B]`` int64."""
    if params.all_greedy:
        return greedy(logits)
    is_greedy = params.temperature == 0.0
    rows = torch.nonzero(~is_greedy).squeeze(1)
    if rows.numel() == logits.shape[0]:
        rows = None  # every row samples: skip the gathers
    sub = (logits if rows is None else logits.index_select(0, rows)).float()

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    scaled = sub / pick(params.temperature)[:, None]
    scaled = apply_top_k_top_p(
        scaled,
        pick(params.top_k) if params.any_top_k else None,
        pick(params.top_p) if params.any_top_p else None,
    )
    # Gumbel-max: argmax(logit/T + G) with G = -log(-log U) samples softmax(logit/T) exactly.
    sampled = gumbel_argmax(scaled, row_keys(pick(params.seeds), pick(params.positions)))
    if rows is None:
        return sampled
    return greedy(logits).index_copy(0, rows, sampled)


def accept_proposals(proposed: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading proposed tokens to keep: those equal to the token sampled before them.

    ``sampled[j]`` is the token sampled at the position of ``proposed[j]`` (after the known tokens
    and ``proposed[:j]``), from the request's own distribution with its temperature, top-k and
    top-p, and ``sampled`` has one more entry, the token after the last proposal. The request then
    emits ``proposed[:a] + [sampled[a]]`` for the returned ``a``.

    This is speculative decoding's exact acceptance rule for a proposal that is a single token
    (probability 1): keep ``t`` with probability ``p(t)``, else draw from ``p`` with ``t`` removed,
    renormalised. Gumbel-max picks ``t`` with probability ``p(t)``, and when it picks another token
    that token follows exactly that residual distribution. Greedy rows (argmax) give the usual
    longest matching prefix. Because each position's randomness depends only on (seed,
    position), a request emits the same tokens with or without proposals.
    """
    a = 0
    for t, s in zip(proposed, sampled):
        if t != s:
            break
        a += 1
    return a


@dataclass
class Logprobs:
    """``sampled`` ``[B]``: log-probability of each row's sampled token; ``top_ids`` /
    ``top_logprobs`` ``[B, k]``: the k most likely tokens, most likely first."""

    sampled: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> Logprobs:
    """Log-probabilities under the model's raw distribution (log_softmax of the logits, before
    temperature, top-k or top-p)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, sampled.view(-1, 1).to(torch.int64)).squeeze(1)
    top_logprobs, top_ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return Logprobs(sampled=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


__all__ = [
    "Logprobs",
    "SamplingTensors",
    "accept_proposals",
    "apply_top_k_top_p",
    "choice_seed",
    "compute_logprobs",
    "greedy",
    "mix64",
    "random_uniforms",
    "reference_apply_top_k_top_p",
    "sample",
    "sort_rows",
]
