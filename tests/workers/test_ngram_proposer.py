"""Prompt lookup: the longest suffix first, its most recent earlier occurrence, up to K tokens,
held to a plain-Python reference on random token strings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.workers.engine.ngram_proposer import NgramProposer, propose_ngram


def reference(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The rule as stated, by brute force."""
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # most recent first; end < len - 1
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_examples():
    # "a b c d" then "x b c" : the 2-gram "b c" matches; what followed it was "d x".
    assert propose_ngram(np.array([1, 2, 3, 4, 9, 2, 3]), 2, 4, 3) == [4, 9, 2]
    # The longest suffix wins over a more recent shorter one.
    assert propose_ngram(np.array([7, 2, 3, 5, 8, 2, 3, 6, 7, 2, 3]), 2, 3, 1) == [5]
    # Without the 3-gram, the most recent 2-gram.
    assert propose_ngram(np.array([7, 2, 3, 5, 8, 2, 3, 6, 9, 2, 3]), 2, 3, 1) == [6]
    # A repeating pattern proposes its continuation (the match overlaps the suffix).
    assert propose_ngram(np.array([1, 2, 1, 2, 1, 2]), 2, 4, 4) == [1, 2]
    # Too short, nothing found, K limits the proposal.
    assert propose_ngram(np.array([5, 5]), 2, 4, 4) == []
    assert propose_ngram(np.array([1, 2, 3, 4]), 2, 4, 4) == []
    assert propose_ngram(np.array([1, 2, 3, 4, 5, 1, 2]), 2, 4, 2) == [3, 4]
    assert propose_ngram(np.array([4, 1, 9, 9, 1]), 1, 1, 3) == [9, 9, 1]


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_matches_the_reference_on_random_tokens(n_min, n_max):
    rng = random.Random(n_min * 10 + n_max)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k = rng.randint(1, 6)
        assert propose_ngram(np.array(tokens, dtype=np.int64), n_min, n_max, k) == reference(tokens, n_min, n_max, k)


def test_the_proposer_follows_a_growing_request_and_forgets_it():
    proposer = NgramProposer(2, 3)
    request = EngineRequest("r", [1, 2, 3, 4, 1], SamplingParams())
    assert proposer.propose(request, 4) == []
    request.append_output_token(2)  # ... 1 2: what followed "1 2" was "3 4 1 2"
    assert proposer.propose(request, 4) == [3, 4, 1, 2]
    for t in [3, 4, 1, 2] * 20:  # outgrow the first buffer
        request.append_output_token(t)
    assert proposer.propose(request, 2) == reference(request.all_token_ids, 2, 3, 2) == [3, 4]
    proposer.forget("r")
    # A new request under the same id starts from its own tokens.
    other = EngineRequest("r", [5, 6, 7, 5, 6], SamplingParams())
    assert proposer.propose(other, 3) == [7, 5, 6]
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)
