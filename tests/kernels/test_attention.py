"""Paged attention and the KV cache write, held to the naive reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.kernels.attention import (
    build_attention_metadata,
    native_attention_available,
    native_softmax_selftest,
    paged_attention,
    reference_paged_attention,
    store_kv,
)
from tests.helpers import on_one_thread

HEAD_DIM = 16
NUM_KV_HEADS = 2


def _random_tables(seq_lens, block_size, num_blocks, rng):
    """Disjoint, shuffled block tables covering each sequence (sometimes one spare block)."""
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size) + rng.randint(0, 1)
        tables.append([ids.pop() for _ in range(n)])
    return tables


needs_native = pytest.mark.skipif(
    not native_attention_available(), reason="no C compiler for the native CPU attention kernel"
)


def _run_case(query_lens, seq_lens, block_size, g, seed, dtype=torch.float32, backend="torch", head_dim=HEAD_DIM,
              **budget):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-s // block_size) + 1 for s in seq_lens) + 3
    tables = _random_tables(seq_lens, block_size, num_blocks, rng)
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype)
    md = build_attention_metadata(query_lens, seq_lens, tables, block_size, g, **budget)
    num_tokens = sum(query_lens)
    # This step's K/V go in through store_kv, exactly as the model does it.
    k_new = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype)
    v_new = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, dtype=dtype)
    store_kv(k_new, v_new, k_cache, v_cache, md.slot_mapping)
    q = torch.randn(num_tokens, NUM_KV_HEADS * g, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, md, scale, backend=backend)
    ref = on_one_thread(reference_paged_attention, q.float(), k_cache.float(), v_cache.float(), query_lens, seq_lens,
                        tables, scale)
    return out, ref, md, tables, k_new, k_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("g", [1, 4])
def test_mixed_prefill_and_decode_match_reference(block_size, g):
    # Decodes and prefill chunks together; contexts ending mid-block, on a boundary, and a
    # chunk continuing an earlier prefill (query shorter than context).
    query_lens = [1, 7, 1, 33, 1, 16, 5]
    seq_lens = [1, 7, 40, 33, block_size * 2, 50, 5 + block_size]
    out, ref, md, *_ = _run_case(query_lens, seq_lens, block_size, g, seed=block_size + g)
    assert len(md.groups) == 2  # one decode call, one prefill call
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", [1, 4])
def test_small_budget_splits_into_several_groups(g):
    query_lens = [1, 1, 1, 9, 20, 3]
    seq_lens = [17, 90, 3, 9, 60, 64]
    out, ref, md, *_ = _run_case(query_lens, seq_lens, 16, g, seed=7, max_gather_tokens=96,
                                 max_score_elements=4096)
    assert len(md.groups) >= 4
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_pure_decode_step_uses_identity_group_and_matches():
    query_lens = [1] * 6
    seq_lens = [5, 16, 17, 31, 64, 2]
    out, ref, md, *_ = _run_case(query_lens, seq_lens, 16, 4, seed=3)
    assert len(md.groups) == 1 and md.groups[0].identity
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_reference():
    out, ref, *_ = _run_case([1, 12, 1], [30, 12, 47], 16, 4, seed=11, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)


def test_store_kv_writes_exactly_the_mapped_slots():
    torch.manual_seed(0)
    k_cache = torch.zeros(6, 16, 2, 8)
    v_cache = torch.zeros(6, 16, 2, 8)
    # Sequence 0 in blocks [4, 1]: positions 14..17 cross a block boundary.
    md = build_attention_metadata([4, 1], [18, 3], [[4, 1], [2]], 16, 1)
    assert md.positions.tolist() == [14, 15, 16, 17, 2]
    assert md.slot_mapping.tolist() == [4 * 16 + 14, 4 * 16 + 15, 1 * 16 + 0, 1 * 16 + 1, 2 * 16 + 2]
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    torch.testing.assert_close(k_cache[4, 14], k[0])
    torch.testing.assert_close(k_cache[1, 1], k[3])
    torch.testing.assert_close(v_cache[2, 2], v[4])
    written = torch.zeros(6 * 16, dtype=torch.bool)
    written[md.slot_mapping] = True
    assert k_cache.view(-1, 2, 8)[~written].abs().sum() == 0
    assert v_cache.view(-1, 2, 8)[written].abs().sum() > 0


def test_metadata_rejects_tables_too_short():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [17], [[0]], 16, 1)
    with pytest.raises(ValueError, match="query_len"):
        build_attention_metadata([5], [4], [[0]], 16, 1)


@pytest.mark.parametrize("backend", ["torch", pytest.param("native", marks=needs_native)])
@settings(max_examples=25, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 70), st.integers(0, 40)).map(lambda t: (min(t[0], t[0] + t[1]), t[0] + t[1])),
        min_size=1, max_size=6,
    ),
    block_size=st.sampled_from([16, 32]),
    g=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_random_batches_match_reference(backend, data, block_size, g, seed):
    # Mostly prefill chunks of random length over random contexts; a third become decodes.
    query_lens = [1 if (i + seed) % 3 == 0 else q for i, (q, _) in enumerate(data)]
    seq_lens = [s for _, s in data]
    out, ref, *_ = _run_case(query_lens, seq_lens, block_size, g, seed, backend=backend, max_gather_tokens=256)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# The native CPU kernel: the generic C loops (head sizes other than 64 / 128, or more than 8
# query heads per KV head) and the vectorised versions (64 or 128 x 1..8 query heads per KV head:
# AVX-512 where the CPU has it, else AVX2), each against the reference.
@needs_native
@pytest.mark.parametrize("head_dim,g", [(16, 1), (16, 4), (32, 2), (64, 12), (64, 1), (64, 3), (64, 4), (64, 7),
                                        (128, 2), (128, 3), (128, 4), (128, 5), (128, 8)])
def test_native_kernel_matches_reference(head_dim, g):
    query_lens = [1, 7, 1, 33, 1, 16, 5, 1]
    seq_lens = [1, 7, 40, 33, 32, 50, 21, 300]
    out, ref, *_ = _run_case(query_lens, seq_lens, 16, g, seed=head_dim + g, backend="native", head_dim=head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("head_dim,g", [(16, 4), (64, 4), (64, 3), (64, 7), (128, 6)])
def test_native_kernel_bfloat16_close_to_reference(head_dim, g):
    out, ref, *_ = _run_case([1, 12, 1, 40], [30, 12, 47, 90], 16, g, seed=5, dtype=torch.bfloat16,
                             backend="native", head_dim=head_dim)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)


@needs_native
@pytest.mark.parametrize("block_size", [8, 12, 16, 24, 48])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 4, 6, 7, 8])
def test_native_vectorised_kernels_any_block_size(block_size, head_dim, g):
    # The AVX-512 versions score keys 16 at a time within a block and one at a time for the
    # rest, the AVX2 versions 8 at a time: blocks of 8, 12 (8 + 4), 24 (16 + 8) and 48, with
    # partial last blocks.
    query_lens = [1, 1, 9, 1, 30]
    seq_lens = [1, 17, 40, 95, 130]
    out, ref, *_ = _run_case(query_lens, seq_lens, block_size, g, seed=block_size, backend="native",
                             head_dim=head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_vectorised_softmax_pieces_match_the_scalar_ones():
    # The AVX-512 (AVX2) kernels take exponentials 16 (8) at a time and sum 16 (8) score vectors
    # across lanes at once; both must give exactly the bits of the one-at-a-time code (so a
    # score or weight does not depend on where its key falls in a block).
    torch.manual_seed(0)
    edges = torch.tensor([0.0, -0.0, -87.0, -87.00001, -86.99999, -87.5, -1e-30, -1e-45, -200.0,
                          float("-inf"), float("nan"), -0.5, -1.0, -2.0, -40.0, -86.0] * 16)
    x = torch.cat([-torch.rand(4096) * 100, -torch.rand(4096) * 1e-3, edges, torch.randn(2048) * 50])
    pieces = native_softmax_selftest(x)
    if pieces is None:
        pytest.skip("the native kernel has no vectorised version on this machine")
    exp_one, exp_vec, sum_one, sum_vec = pieces
    assert sum_one.numel() in (x.numel() // 16, x.numel() // 8)
    assert torch.equal(exp_one.view(torch.int32), exp_vec.view(torch.int32))
    assert torch.equal(sum_one.view(torch.int32), sum_vec.view(torch.int32))
    # The one-at-a-time sums are the vectors' sums (the comparison means something).
    width = x.numel() // sum_one.numel()
    finite = x.view(-1, width).isfinite().all(1)
    torch.testing.assert_close(sum_one[finite].double(), x.view(-1, width)[finite].double().sum(1),
                               rtol=1e-5, atol=1e-3)


@needs_native
def test_native_kernel_splits_work_across_threads_without_changing_results():
    query_lens = [1] * 9 + [60]
    seq_lens = [5, 16, 17, 31, 64, 2, 200, 90, 33, 60]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, ref, *_ = _run_case(query_lens, seq_lens, 16, 4, seed=9, backend="native", head_dim=64)
        torch.set_num_threads(3)
        three, *_ = _run_case(query_lens, seq_lens, 16, 4, seed=9, backend="native", head_dim=64)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)  # each token's result is computed by one thread, the same way
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_kernel_reads_a_strided_query_view():
    # The model hands over q as a slice of the fused q/k projection: not contiguous.
    torch.manual_seed(2)
    k_cache = torch.randn(8, 16, 2, 64)
    v_cache = torch.randn(8, 16, 2, 64)
    tables = [[3, 5], [1]]
    md = build_attention_metadata([3, 1], [20, 9], tables, 16, 4)
    qk = torch.randn(4, 10, 64)
    q = qk[:, :8]
    assert not q.is_contiguous()
    out = paged_attention(q, k_cache, v_cache, md, 0.125, backend="native")
    ref = on_one_thread(reference_paged_attention, q, k_cache, v_cache, [3, 1], [20, 9], tables, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_auto_backend_agrees_with_torch_backend():
    query_lens = [1, 5, 1]
    seq_lens = [40, 5, 70]
    out_torch, ref, *_ = _run_case(query_lens, seq_lens, 16, 4, seed=4, backend="torch", head_dim=64)
    out_auto, *_ = _run_case(query_lens, seq_lens, 16, 4, seed=4, backend="auto", head_dim=64)
    torch.testing.assert_close(out_auto, out_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_auto, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_kernel_rejects_mismatched_shapes():
    k_cache = torch.zeros(4, 16, 2, 64)
    md = build_attention_metadata([1], [5], [[2]], 16, 4)
    with pytest.raises(ValueError, match="does not match"):
        paged_attention(torch.zeros(1, 6, 64), k_cache, k_cache.clone(), md, 0.125, backend="native")
    with pytest.raises(ValueError, match="does not match"):
        paged_attention(torch.zeros(1, 8, 32), k_cache, k_cache.clone(), md, 0.125, backend="native")
    bad = build_attention_metadata([1], [5], [[9]], 16, 4)  # block 9 of a 4-block cache
    with pytest.raises(ValueError, match="outside the cache"):
        paged_attention(torch.zeros(1, 8, 64), k_cache, k_cache.clone(), bad, 0.125, backend="native")
