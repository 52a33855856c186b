"""Logits processing before sampling: the repetition, frequency and presence penalties, logit bias,
and stop tokens held back until a request's ``min_tokens``.

Plain PyTorch, vectorised over the rows handed in (only the rows of requests that ask for it: the
caller gathers them). Every function changes ``logits`` in place and returns it; they run in
float32. In the order the sampler applies them (vLLM's and Hugging Face's order: a bias before the
multiplicative penalty)::

    logits[t] += bias[t]                                   # logit_bias
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r   for t in prompt or output
    logits[t] -= frequency * count[t] + presence * (count[t] > 0)    # count: in the output so far
    logits[t] = -inf                                       # stop tokens, while output < min_tokens

``repetition`` 1, ``frequency`` and ``presence`` 0 leave a row as it was: a batch mixing
penalised and plain rows gives each row what it would get alone.
"""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     biases: torch.Tensor) -> torch.Tensor:
    """``logits[rows[k], token_ids[k]] += biases[k]`` for every k (pairs of a row are distinct)."""
    if rows.numel():
        logits.index_put_((rows, token_ids), biases.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor | None, output_counts: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> torch.Tensor:
    """The penalties of ``[b, V]`` logits rows.

    ``seen`` ``[b, V]`` bool: the token is in the row's prompt or output (the repetition penalty's
    set); ``output_counts`` ``[b, V]``: how often it is in the output so far (the frequency and
    presence penalties'); ``repetition``, ``frequency``, ``presence`` ``[b]``. A None penalty (and
    its tensor) is skipped: the caller passes None when no row of the batch uses it.
    """
    if repetition is not None:
        r = repetition.to(logits.dtype)[:, None]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalised, logits))
    if frequency is not None or presence is not None:
        counts = output_counts.to(logits.dtype)
        if frequency is not None:
            logits.sub_(frequency.to(logits.dtype)[:, None] * counts)
        if presence is not None:
            logits.sub_(presence.to(logits.dtype)[:, None] * (counts > 0).to(logits.dtype))
    return logits


def hold_back_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``logits[rows[k], token_ids[k]] = -inf``: tokens that may not come yet (a request's EOS and
    stop tokens before its ``min_tokens``)."""
    if rows.numel():
        logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


__all__ = ["apply_logit_bias", "apply_penalties", "hold_back_tokens"]
