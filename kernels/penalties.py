"""Logits processing before sampling: the repetition, frequency and presence penalties, logit bias,
and stop tokens held back until a request's ``min_tokens``.

Plain PyTorch over (row, token) pairs: a request's penalties touch only the tokens it has seen, a
few hundred of a vocabulary of tens of thousands, so they are gathered, changed and scattered
back rather than applied to whole rows. Every function changes ``logits`` (float32) in place and
returns it; within one call a (row, token) pair appears at most once. In the order the sampler
applies them (vLLM's and Hugging Face's order: a bias before the multiplicative penalty)::

    logits[t] += bias[t]                                   # logit_bias
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r   for t in prompt or output
    logits[t] -= frequency * count[t] + presence * (count[t] > 0)    # count: in the output so far
    logits[t] = -inf                                       # stop tokens, while output < min_tokens

Rows not named are left as they were: a batch mixing processed and plain rows gives each row what
it would get alone.
"""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     biases: torch.Tensor) -> torch.Tensor:
    """``logits[rows[k], token_ids[k]] += biases[k]`` for every k."""
    if rows.numel():
        logits.index_put_((rows, token_ids), biases.to(logits.dtype), accumulate=True)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                             penalties: torch.Tensor) -> torch.Tensor:
    """For every k, the logit at (``rows[k]``, ``token_ids[k]``) divided by ``penalties[k]`` when
    positive, multiplied by it otherwise (the pairs: each row's tokens in its prompt or output)."""
    if rows.numel():
        values = logits[rows, token_ids]
        r = penalties.to(logits.dtype)
        logits[rows, token_ids] = torch.where(values > 0, values / r, values * r)
    return logits


def apply_frequency_presence(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                             counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """For every k, ``frequency[k] * counts[k] + presence[k]`` subtracted from the logit at
    (``rows[k]``, ``token_ids[k]``) (the pairs: each row's tokens in its output, ``counts[k]`` >= 1
    times)."""
    if rows.numel():
        penalty = frequency.to(logits.dtype) * counts.to(logits.dtype) + presence.to(logits.dtype)
        logits.index_put_((rows, token_ids), -penalty, accumulate=True)
    return logits


def hold_back_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``logits[rows[k], token_ids[k]] = -inf``: tokens that may not come yet (a request's EOS and
    stop tokens before its ``min_tokens``)."""
    if rows.numel():
        logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


__all__ = ["apply_frequency_presence", "apply_logit_bias", "apply_repetition_penalty", "hold_back_tokens"]
