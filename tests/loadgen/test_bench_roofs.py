"""The memory roof: bytes a workload must read, counted by hand on a toy shape, and the copy timer."""

from __future__ import annotations

import pytest

from mqinfer.loadgen.bench_roofs import (
    copy_array_bytes,
    measure_copy_bandwidth,
    weight_bytes,
    workload_bytes,
)
from mqinfer.loadgen.matrix_rate import ModelShape

TOY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}


def test_toy_workload_bytes_by_hand():
    shape = ModelShape.from_config(TOY)
    # per layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + mlp 3 x 8x16 = 576 weights; head 8 x 10
    assert weight_bytes(shape, "bfloat16") == 2 * (2 * 576 + 80)
    assert weight_bytes(shape, "float32", "w8a16") == 2 * 576 + 4 * 80
    assert weight_bytes(shape, "bfloat16", "w8a8") == 2 * 576 + 80
    requests = [{"prompt_token_ids": [3, 4, 5], "max_tokens": 2}, {"prompt_token_ids": [3], "max_tokens": 4}]
    need = workload_bytes(TOY, requests, dtype="bfloat16")
    # K and V of one token: 2 layers x 1 KV head x 4 values x 2 (K, V) x 2 bytes.
    assert need.kv_bytes_per_token == 32
    # The longest output sets the steps; KV read: first request 3 (prefill) + 4 (step 1); second
    # 1 + (2 + 3 + 4).
    assert need.steps == 4 and need.kv_bytes == (3 + 4 + 1 + 2 + 3 + 4) * 32
    assert need.total == 4 * weight_bytes(shape, "bfloat16") + need.kv_bytes
    # One request at a time: a wave each, the weights read for every step of each.
    alone = workload_bytes(TOY, requests, dtype="bfloat16", max_num_seqs=1)
    assert alone.steps == 6 and alone.kv_bytes == need.kv_bytes
    # An 8-bit cache: one byte per value plus a bfloat16 scale per (token, layer, KV head, K or V).
    assert workload_bytes(TOY, requests, dtype="bfloat16", kv_cache_dtype="int8").kv_bytes_per_token == 16 + 8
    with pytest.raises(ValueError):
        workload_bytes(TOY, requests, dtype="bfloat16", max_num_seqs=0)


def test_copy_arrays_outgrow_the_cache_and_the_timer_measures_a_rate():
    assert copy_array_bytes(None) == 1 << 30
    assert copy_array_bytes(32 << 20) == 256 << 20  # at least 256 MiB
    assert copy_array_bytes(200 << 20) == 800 << 20
    assert copy_array_bytes(4 << 30) == 1 << 30  # at most 1 GiB
    bw = measure_copy_bandwidth(16 << 20, best_of=2, repeats=2, threads=1)
    assert bw.array_bytes == 16 << 20 and bw.threads == 1
    # Anything with a memory moves more than 100 MB/s and less than 10 TB/s.
    assert 1e8 < bw.median_bytes_per_s <= bw.bytes_per_s < 1e13
    with pytest.raises(ValueError):
        measure_copy_bandwidth(16 << 20, best_of=0)
