"""The native w8a16 kernel (kernels/linear_w8a16.py): int8 weights widened inside the matmul
give, bit for bit, the float32 kernel's result on the dequantized weight ``q * scale`` (bias,
fused SwiGLU, strided input, both row paths: the widening tiles up to 12 rows and the scratch
panel above), and a row's result does not depend on the batch or on the thread count."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels import linear as dense
from mqinfer.kernels import linear_int8 as q8
from mqinfer.kernels import linear_w8a16 as w16

needs_kernel = pytest.mark.skipif(not (w16.native_available() and dense.native_linear_available()),
                                  reason="the native w8a16 kernel serves AVX2 CPUs without AVX-512")

# Rows 1-12 go through the widening tiles (one or two per panel), 13 and more through the
# scratch panel; 131 makes more than one block of rows at K = 1538.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 64, 131]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def _weights(out_features: int, in_features: int, with_bias: bool, seed: int):
    torch.manual_seed(seed)
    qweight, scale = q8.quantize_weight(torch.randn(out_features, in_features))
    bias = torch.randn(out_features) if with_bias else None
    return qweight, scale, bias, qweight.float() * scale[:, None]


@needs_kernel
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (3, 15), (37, 50), (100, 17), (576, 960), (1538, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_gives_the_bits_of_the_float32_kernel_on_the_dequantized_weight(in_features, out_features, with_bias,
                                                                         num_threads, threads):
    qweight, scale, bias, dequantized = _weights(out_features, in_features, with_bias, in_features + out_features)
    packed, reference = w16.pack(qweight, scale, bias), dense.pack(dequantized)
    threads(num_threads)
    x = torch.randn(max(ROWS), in_features)
    for rows in ROWS:
        got = w16.linear(x[:rows], packed)
        assert torch.equal(got, dense.linear(x[:rows], reference, bias)), f"rows {rows}"


@needs_kernel
@pytest.mark.parametrize("in_features,inter", [(5, 3), (64, 8), (100, 45), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_gives_the_bits_of_the_projection_then_silu_mul(in_features, inter, with_bias):
    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native ops library is not built here")
    qweight, scale, bias, dequantized = _weights(2 * inter, in_features, with_bias, in_features + inter)
    chunk = cpu_ops.silu_vector_chunk(torch.float32)
    fused_packed, plain_packed = w16.pack(qweight, scale, bias, swiglu=True), w16.pack(qweight, scale, bias)
    reference = dense.pack_swiglu(dequantized, bias)
    x = torch.randn(64, in_features)
    for rows in (1, 4, 7, 12, 13, 64):
        fused = w16.swiglu(x[:rows], fused_packed, chunk)
        assert fused.shape == (rows, inter)
        assert torch.equal(fused, cpu_ops.silu_mul(w16.linear(x[:rows], plain_packed))), f"rows {rows}"
        assert torch.equal(fused, dense.swiglu(x[:rows], reference, chunk)), f"rows {rows}"
    with pytest.raises(ValueError, match="swiglu"):
        w16.swiglu(x, plain_packed, chunk)
    with pytest.raises(ValueError, match="swiglu"):
        w16.linear(x, fused_packed)


@needs_kernel
def test_a_row_does_not_depend_on_the_batch_or_the_threads(threads):
    qweight, scale, bias, _ = _weights(700, 576, True, 2)
    packed = w16.pack(qweight, scale, bias)
    x = torch.randn(37, 576)
    threads(1)
    alone = torch.cat([w16.linear(x[i : i + 1], packed) for i in range(37)])
    threads(2)
    assert torch.equal(w16.linear(x, packed), alone)


@needs_kernel
def test_strided_input_given_output_and_errors():
    qweight, scale, bias, dequantized = _weights(24, 64, True, 3)
    packed = w16.pack(qweight, scale, bias)
    wide = torch.randn(20, 100)
    for rows in (3, 20):  # the widening tiles and the scratch panel
        x = wide[:rows, 20:84]
        out = torch.full((rows, 24), float("nan"))
        assert w16.linear(x, packed, out) is out
        assert torch.equal(out, dense.linear(x.contiguous(), dense.pack(dequantized), bias))
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        w16.linear(torch.randn(10, 63), packed)
    with pytest.raises(ValueError, match="out must be"):
        w16.linear(wide[:10, :64], packed, torch.empty(10, 23))
    assert w16.pack(qweight.float(), scale) is None  # only int8 weights pack
    assert w16.pack(qweight[:23], scale[:23], swiglu=True) is None  # gate/up needs an even row count
