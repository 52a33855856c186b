"""Prompt runs by AMX tiles (kernels/csrc/attention_amx.c): held to the reference and to the
per-token kernel, and a token's result independent of its batch, its packing and the threads."""

from __future__ import annotations

import random

import pytest
import torch

from mqinfer.kernels import native
from mqinfer.kernels.attention import (
    build_attention_metadata,
    native_attention_available,
    paged_attention,
    reference_paged_attention,
)
from tests.helpers import on_one_thread


def _amx_switch():
    if not native_attention_available():
        return None
    lib = native.load()
    fn = lib.mqinfer_attention_use_amx  # typed by the loader
    return fn if fn(-1) >= 0 else None


use_amx = _amx_switch()
pytestmark = pytest.mark.skipif(use_amx is None, reason="no AMX tiles on this CPU (or no C compiler)")


@pytest.fixture(autouse=True)
def _restore():
    before = use_amx(-1)
    yield
    use_amx(before)


def _case(query_lens, seq_lens, head_dim, num_kv_heads, g, block_size=16, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-s // block_size) + 1 for s in seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    md = build_attention_metadata(query_lens, seq_lens, tables, block_size, g)
    q = torch.randn(sum(query_lens), num_kv_heads * g, head_dim, dtype=torch.bfloat16)
    return q, k, v, md, tables


@pytest.mark.parametrize("head_dim,num_kv_heads,g,block_size", [(64, 3, 3, 16), (128, 2, 7, 16), (64, 2, 6, 32),
                                                                 (128, 4, 4, 32)])
def test_prompt_runs_agree_with_the_reference_and_the_per_token_kernel(head_dim, num_kv_heads, g, block_size):
    # Prompts of every length around the tile and run sizes, a chunk after a cached prefix, decodes.
    query_lens = [160, 1, 40, 16, 15, 3, 33, 1]
    seq_lens = [160, 90, 300, 16, 15, 50, 33, 7]
    q, k, v, md, tables = _case(query_lens, seq_lens, head_dim, num_kv_heads, g, block_size)
    scale = head_dim ** -0.5
    use_amx(1)
    tiles = paged_attention(q, k, v, md, scale)
    use_amx(0)
    per_token = paged_attention(q, k, v, md, scale)
    ref = on_one_thread(reference_paged_attention, q.float(), k.float(), v.float(), query_lens, seq_lens, tables, scale)
    torch.testing.assert_close(tiles.float(), ref, rtol=0.02, atol=0.02)
    # Within one bfloat16 step of the per-token kernel (the sums' order differs).
    assert (tiles.float() - per_token.float()).abs().max() <= 2 * (per_token.float() - ref).abs().max() + 1e-3
    # Tokens of runs shorter than a tile are the per-token kernel's, bit for bit.
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    for start, n in zip(starts, query_lens):
        if n < 16:
            assert torch.equal(tiles[start:start + n], per_token[start:start + n])


def test_a_tokens_result_does_not_depend_on_its_batch_or_the_threads():
    use_amx(1)
    q, k, v, md, tables = _case([40], [40], 64, 3, 3)
    alone = paged_attention(q, k, v, md, 0.125)
    # The same prompt after another sequence's tokens, so tiles and threads' shares fall elsewhere.
    before = torch.randn(23, 9, 64, dtype=torch.bfloat16)
    md2 = build_attention_metadata([23, 40], [23, 40], [tables[0][:2], tables[0]], 16, 3)
    before_threads = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            packed = paged_attention(torch.cat([before, q]), k, v, md2, 0.125)
            assert torch.equal(packed[23:], alone), threads
    finally:
        torch.set_num_threads(before_threads)
