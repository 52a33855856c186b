"""Prompt lookup, the ``ngram`` proposer of speculative decoding: guess that a request goes on the
way it went after the last time its latest tokens appeared.

For n from ``ngram_max`` down to ``ngram_min``, find the most recent earlier place where the
request's last n tokens (prompt and output so far) occur, and propose up to K of the tokens
that followed it. Outputs that copy spans of their prompt (extraction, summaries, code edits)
get long runs of accepted proposals; elsewhere there is usually no match, and nothing is proposed.

The search is vectorised over the whole context: one comparison of every token with the last
one, then each further step of the match narrows the surviving candidates. Each request's tokens
are kept in a numpy buffer that only has its new tokens appended per step.
"""

from __future__ import annotations

import numpy as np

from mqinfer.scheduler.request import EngineRequest

# Forget every buffer when this many are held: a safety net for callers that never call forget().
_MAX_BUFFERS = 4096


def propose_ngram(tokens: np.ndarray, ngram_min: int, ngram_max: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (n tokens, ``ngram_max >= n >= ngram_min``) found earlier; [] when none is.

    An occurrence may overlap the suffix itself (a repeating pattern proposes its continuation).
    """
    length = len(tokens)
    if length < ngram_min + 1 or max_tokens < 1:
        return []
    # End positions of candidate occurrences: every earlier place holding the last token.
    alive = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best = int(alive[-1]) if ngram_min <= 1 and alive.size else -1
    for n in range(2, min(ngram_max, length - 1) + 1):
        d = n - 1
        alive = alive[alive >= d]
        alive = alive[tokens[alive - d] == tokens[length - 1 - d]]
        if not alive.size:
            break
        if n >= ngram_min:
            best = int(alive[-1])
    if best < 0:
        return []
    return tokens[best + 1 : best + 1 + max_tokens].tolist()


class NgramProposer:
    """``Proposer`` for the scheduler (scheduler/scheduler.py): prompt lookup over each request's
    own tokens. Call ``forget`` when a request ends."""

    name = "ngram"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        # request id -> (the request, its tokens so far in a buffer with spare room, how many)
        self._buffers: dict[str, tuple[EngineRequest, np.ndarray, int]] = {}

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        return propose_ngram(self._tokens(request), self.ngram_min, self.ngram_max, max_tokens)

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def _tokens(self, request: EngineRequest) -> np.ndarray:
        """The request's tokens as int64, appending only what arrived since the last call."""
        tokens = request.all_token_ids
        n = len(tokens)
        entry = self._buffers.get(request.request_id)
        if entry is not None and entry[0] is request and entry[2] <= n:
            _, buffer, have = entry
        else:
            if len(self._buffers) >= _MAX_BUFFERS:
                self._buffers.clear()
            buffer, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        if n > len(buffer):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buffer[:have]
            buffer = grown
        if n > have:
            buffer[have:n] = tokens[have:n]
        self._buffers[request.request_id] = (request, buffer, n)
        return buffer[:n]


__all__ = ["NgramProposer", "propose_ngram"]
