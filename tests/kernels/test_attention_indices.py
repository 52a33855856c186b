"""The native attention kernel reads every index it is given without checking it; the Python
side checks them once per step. A bad sequence id, position or block id is a ValueError
naming what is wrong, never a read outside the tables or the cache (under the sanitizer build,
.ci/native-checks, such a read would stop the run)."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels.attention import (
    AttentionMetadata,
    build_attention_metadata,
    native_attention_available,
    paged_attention,
    reference_paged_attention,
)
from tests.helpers import on_one_thread

pytestmark = pytest.mark.skipif(
    not native_attention_available(), reason="no C compiler for the native CPU attention kernel"
)

BLOCK = 16
NUM_BLOCKS = 4
G = 2


def _metadata(tables, seq_of_token, positions, max_seq_len=0) -> AttentionMetadata:
    """Metadata assembled by hand, as a caller that skips build_attention_metadata would;
    ``max_seq_len`` 0 leaves the kernel to derive it from the positions."""
    tables = torch.tensor(tables, dtype=torch.int64)
    seq_of_token = torch.tensor(seq_of_token, dtype=torch.int64)
    positions = torch.tensor(positions, dtype=torch.int64)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, len(positions)]), seq_lens=positions[-1:] + 1,
        block_tables=tables, slot_mapping=torch.zeros_like(positions), positions=positions,
        block_size=BLOCK, num_queries_per_kv=G, seq_of_token=seq_of_token,
    )
    md.max_seq_len = max_seq_len
    return md


def _attend(md: AttentionMetadata) -> torch.Tensor:
    torch.manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 1, 64)
    q = torch.randn(md.num_tokens, G, 64)
    return paged_attention(q, cache, cache.clone(), md, 0.125, backend="native")


def test_hand_built_metadata_with_derived_max_seq_len_matches_the_reference():
    md = _metadata([[3, 1]], [0, 0], [18, 19])
    torch.manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 1, 64)
    q = torch.randn(2, G, 64)
    out = paged_attention(q, cache, cache, md, 0.125, backend="native")
    assert md.max_seq_len == 20  # derived from the positions once they passed the table check
    ref = on_one_thread(reference_paged_attention, q, cache, cache, [2], [20], [[3, 1]], 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tables, seq_of_token, positions, max_seq_len, message",
    [
        pytest.param([[2]], [1], [3], 0, "seq_of_token names sequences outside", id="sequence-past-the-tables"),
        pytest.param([[2]], [-1], [3], 0, "seq_of_token names sequences outside", id="negative-sequence"),
        pytest.param([[2]], [0], [-1], 0, "token positions must lie in 0..15", id="negative-position"),
        # max_seq_len derived from the positions: only the table's width can catch this one.
        pytest.param([[2]], [0], [16], 0, "token positions must lie in 0..15", id="position-past-the-table"),
        pytest.param([[2, 1], [0, 3]], [0, 1], [5, 40], 0, r"0\.\.31", id="one-token-past-the-table"),
        pytest.param([[2, 1]], [0], [20], 8, r"max_seq_len - 1 \(7\)", id="position-past-max-seq-len"),
        pytest.param([[2, 9]], [0], [20], 0, r"outside the cache \(0\.\.3\)", id="block-past-the-cache"),
        pytest.param([[-1]], [0], [3], 0, r"outside the cache \(0\.\.3\)", id="negative-block"),
    ],
)
def test_a_bad_index_is_refused_before_the_kernel_reads_it(tables, seq_of_token, positions, max_seq_len,
                                                           message):
    with pytest.raises(ValueError, match=message):
        _attend(_metadata(tables, seq_of_token, positions, max_seq_len))


def test_a_table_entry_past_the_cache_is_refused_even_where_no_token_reads_it():
    # Padding is block 0; any other entry must name a real block too (the check is per table,
    # one reduction, not per token).
    md = build_attention_metadata([1], [5], [[2, 7]], BLOCK, G)
    with pytest.raises(ValueError, match="outside the cache"):
        _attend(md)


@pytest.mark.parametrize(
    "field, value, message",
    [
        pytest.param("positions", torch.tensor([3], dtype=torch.int32), "positions must be an int64", id="int32-positions"),
        pytest.param("positions", torch.tensor([3, 4]), r"positions must be an int64 CPU tensor \[1\]", id="positions-too-long"),
        pytest.param("seq_of_token", torch.tensor([], dtype=torch.int64), r"seq_of_token must be .*\[1\]", id="seq-ids-too-short"),
        pytest.param("block_tables", torch.tensor([[2]], dtype=torch.int32), "block tables must be an int64", id="int32-tables"),
        pytest.param("block_tables", torch.tensor([2]), r"\[B, max_blocks\]", id="flat-tables"),
    ],
)
def test_index_tensors_of_the_wrong_type_or_length_are_refused(field, value, message):
    md = _metadata([[2]], [0], [3])
    setattr(md, field, value)
    with pytest.raises(ValueError, match=message):
        _attend(md)


def test_a_step_checked_against_one_cache_is_checked_again_against_another():
    md = _metadata([[3]], [0], [4])
    _attend(md)
    # The same metadata against a smaller cache: block 3 does not exist there.
    cache = torch.zeros(2, BLOCK, 1, 64)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_attention(torch.zeros(1, G, 64), cache, cache.clone(), md, 0.125, backend="native")
