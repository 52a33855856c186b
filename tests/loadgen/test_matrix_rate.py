"""FLOP counting by hand on a toy shape, the standard model's size, and the matmul timer."""

from __future__ import annotations

import pytest

from mqinfer.loadgen.checkpoint import STANDARD_CONFIG
from mqinfer.loadgen.matrix_rate import ModelShape, compute_ceiling, measure_matmul_rate, workload_flops
from mqinfer.loadgen.workload import standard_workload

TOY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}


def test_toy_workload_flops_by_hand():
    f = workload_flops(TOY, [{"prompt_token_ids": [3, 4, 5], "max_tokens": 2}])
    # per layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + mlp 3 x 8x16 = 576; two layers 1152
    assert f.layers == 2 * 1152 * (3 + 2)
    assert f.head == 2 * (8 * 10) * 2  # generated tokens only
    # (query, key) pairs: prompt 1+2+3, generated 4+5; 4 * heads * head_dim * layers FLOPs each
    assert f.attention == (6 + 9) * 4 * 2 * 4 * 2
    assert f.total == 11520 + 320 + 960
    assert f.params_convention == f.total + 2 * 10 * 8 * 5
    assert (f.prompt_tokens, f.output_tokens) == (3, 2)


def test_standard_model_size_and_workload():
    shape = ModelShape.from_config(STANDARD_CONFIG)
    norms = 8 * 2 * 512 + 512
    embed = 32000 * 512
    assert shape.layer_params + shape.head_params + embed + norms == 55_321_088  # transformers' count
    reqs = standard_workload()
    f = workload_flops(STANDARD_CONFIG, reqs)
    p = sum(len(r["prompt_token_ids"]) for r in reqs)
    o = sum(r["max_tokens"] for r in reqs)
    assert f.layers == 2 * 22_544_384 * (p + o) and f.head == 2 * 16_384_000 * o
    assert 3.0e12 < f.total < 3.5e12
    assert compute_ceiling(f, 1e12) == pytest.approx(o * 1e12 / f.total)


def test_ceiling_refuses_nonsense():
    f = workload_flops(TOY, [{"prompt_token_ids": [3], "max_tokens": 1}])
    with pytest.raises(ValueError):
        compute_ceiling(f, 0.0)
    with pytest.raises(ValueError, match="needed to count FLOPs"):
        ModelShape.from_config({"hidden_size": 8})


def test_matmul_rate_is_measured():
    r = measure_matmul_rate(128, repeats=2, best_of=3, warmup=1)
    assert r.size == 128 and r.dtype == "bfloat16" and r.device == "cpu"
    # Anything a CPU can do: more than 10 MFLOP/s, less than 100 TFLOP/s.
    assert 1e7 < r.median_flops_per_s <= r.flops_per_s < 1e14
    with pytest.raises(ValueError):
        measure_matmul_rate(128, dtype="int8x")
