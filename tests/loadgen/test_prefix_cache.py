"""The ideal prefix-cache hits a job's prompts allow, and the report read from real cost rows."""

from __future__ import annotations

import pytest

from mqinfer.loadgen.prefix_cache import ideal_hit_tokens


def test_each_distinct_block_is_computed_once_and_never_the_last_token():
    a = list(range(100, 140))            # 40 tokens: blocks [0:8] .. [24:32] cacheable, 4 of 5 (last token)
    b = a[:16] + list(range(500, 524))   # shares a's first two blocks, then its own
    c = list(a)                          # the same prompt again: all 4 cacheable blocks hit
    assert ideal_hit_tokens([a], 8) == 0
    assert ideal_hit_tokens([a, b], 8) == 16
    assert ideal_hit_tokens([a, b, c], 8) == 16 + 32
    # A block is its whole chain: the same tokens after a different start are another block.
    d = list(range(900, 908)) + a[8:16] + [1] * 9
    assert ideal_hit_tokens([a, d], 8) == 0
    # 16 tokens = 2 blocks, but the last token must be computed: only the first block can hit.
    assert ideal_hit_tokens([a[:16], a[:16]], 8) == 8
    with pytest.raises(ValueError):
        ideal_hit_tokens([a], 0)
