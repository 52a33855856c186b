"""The int8 dense layers (kernels/linear_int8.py): the quantization rules, the native w8a8
kernel held bit for bit to the same arithmetic in PyTorch (exact int32 sums, then the fixed
float32 scaling), a row's result independent of the batch and of the thread count, and the
fused SwiGLU giving the bits of the projection followed by silu_mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mqinfer.kernels import linear_int8 as q8

needs_bf16 = pytest.mark.skipif(not q8.native_takes_bf16(),
                                reason="the native int8 kernel here takes float32 rows only (bfloat16: AVX-512 VNNI)")
needs_kernel = pytest.mark.skipif(not q8.native_available(),
                                  reason="no native int8 kernel for this CPU (it needs AVX2, or AVX-512 with VNNI)")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def test_quantize_rows_is_symmetric_per_row_and_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(6, 50) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1.0, 0.0])[:, None]
    x[4, 7] = -25.0  # an outlier sets its row's scale
    q, scale = q8.quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert float(scale[5]) == 0.0 and not q[5].any()  # a zero row: scale 0, no division by zero
    assert int(q[4, 7]) == -127
    # Dequantized, each value is within half a quantization step of the original.
    err = (q.float() * scale[:, None] - x).abs()
    assert bool((err <= scale[:, None] * 0.5 * (1 + 1e-6) + 1e-30).all())


def test_rows_too_small_to_scale_quantize_to_zero_in_pytorch():
    # 127 / max|x| overflows below about 4e-37: such rows count as zero rows, not as garbage.
    x = torch.tensor([[1e-38, 0.0, -5e-39, 2e-38], [1e-36, -1e-37, 0.0, 1e-40], [1.0, -2.0, 0.5, 0.0]])
    q, scale = q8.quantize_rows(x)
    assert not q[0].any() and float(scale[0]) == 0.0
    assert int(q[1].abs().max()) == 127 and float(scale[1]) > 0.0  # 1e-36 still scales
    qweight, wscale = q8.quantize_weight(torch.randn(24, 4))
    assert not q8.reference_linear(x, qweight, wscale)[0].any()


@needs_kernel
def test_rows_too_small_to_scale_quantize_to_zero_in_the_kernel():
    x = torch.tensor([[1e-38, 0.0, -5e-39, 2e-38], [1e-36, -1e-37, 0.0, 1e-40], [1.0, -2.0, 0.5, 0.0]])
    qweight, wscale = q8.quantize_weight(torch.randn(24, 4))
    expected = q8.reference_linear(x, qweight, wscale)
    assert torch.equal(q8.linear(x, q8.pack(qweight, wscale)), expected)


def test_int_matmul_is_exact():
    torch.manual_seed(1)
    a = torch.randint(-127, 128, (5, 4100), dtype=torch.int8)
    b = torch.randint(-127, 128, (7, 4100), dtype=torch.int8)
    assert torch.equal(q8.int_matmul(a, b).long(), a.long() @ b.long().T)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64, 131])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (3, 15), (37, 50), (64, 16), (576, 960), (1538, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_gives_the_bits_of_the_reference(rows, in_features, out_features, with_bias):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    qweight, scale = q8.quantize_weight(weight)
    got = q8.linear(x, q8.pack(qweight, scale, bias))
    assert torch.equal(got, q8.reference_linear(x, qweight, scale, bias))
    # And the quantization error stays small against the float product: per-row int8
    # activations and per-feature int8 weights, random data, at most a few percent of the
    # largest output.
    ref = F.linear(x, weight, bias)
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.abs().max()) + 1e-6


@needs_kernel
def test_extreme_values_keep_the_sums_exact():
    """Every activation and weight at the int8 extremes of the same sign: each pair of
    products is 2 x 127 x 127, the most a 16-bit lane of vpmaddubsw holds without saturating,
    and a long row's int32 sum must still be exact."""
    k = 4100
    x = torch.full((5, k), 3.0)
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3] = 0.0
    weight = torch.full((19, k), -0.5)
    weight[4] = 0.5
    weight[7] = 0.0
    qweight, scale = q8.quantize_weight(weight)
    got = q8.linear(x, q8.pack(qweight, scale))
    assert torch.equal(got, q8.reference_linear(x, qweight, scale))
    qx, xs = q8.quantize_rows(x)
    exact = (qx.double() @ qweight.double().T) * xs.double()[:, None] * scale.double()[None, :]
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0.0)
    assert float(got[0, 0]) == pytest.approx(-1.5 * k, rel=1e-6)
    assert not got[3].any() and not got[:, 7].any()


@needs_kernel
def test_a_row_does_not_depend_on_the_batch_or_the_threads(threads):
    torch.manual_seed(2)
    x = torch.randn(37, 576)
    weight = torch.randn(700, 576)
    packed = q8.pack(*q8.quantize_weight(weight), torch.randn(700))
    threads(1)
    alone = torch.cat([q8.linear(x[i : i + 1], packed) for i in range(37)])
    threads(2)
    together = q8.linear(x, packed)
    assert torch.equal(alone, together)


@needs_kernel
def test_strided_input_given_output_and_errors():
    torch.manual_seed(3)
    wide = torch.randn(10, 100)
    x = wide[:, 20:84]
    weight = torch.randn(24, 64)
    qweight, scale = q8.quantize_weight(weight)
    packed = q8.pack(qweight, scale)
    out = torch.full((10, 24), float("nan"))
    assert q8.linear(x, packed, out) is out
    assert torch.equal(out, q8.reference_linear(x.contiguous(), qweight, scale))
    with pytest.raises(ValueError, match="x must be a float32( or bfloat16)? CPU tensor"):
        q8.linear(torch.randn(10, 63), packed)
    with pytest.raises(ValueError, match="out must be"):
        q8.linear(x, packed, torch.empty(10, 23))
    with pytest.raises(ValueError, match="swiglu"):
        q8.linear(x, q8.pack(qweight, scale, swiglu=True))
    assert q8.pack(qweight.float(), scale) is None  # only int8 weights pack


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 7, 64])
@pytest.mark.parametrize("in_features,inter", [(5, 3), (64, 8), (64, 20), (576, 1536), (100, 45)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_gives_the_bits_of_the_projection_then_silu_mul(rows, in_features, inter, with_bias):
    from mqinfer.kernels import cpu_ops

    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native ops library is not built here")
    torch.manual_seed(rows * 7 + in_features + inter)
    x = torch.randn(rows, in_features)
    weight = torch.randn(2 * inter, in_features)
    bias = torch.randn(2 * inter) if with_bias else None
    qweight, scale = q8.quantize_weight(weight)
    chunk = cpu_ops.silu_vector_chunk(torch.float32)
    fused = q8.swiglu(x, q8.pack(qweight, scale, bias, swiglu=True), chunk)
    unfused = cpu_ops.silu_mul(q8.linear(x, q8.pack(qweight, scale, bias)))
    assert fused.shape == (rows, inter)
    assert torch.equal(fused, unfused)
    with pytest.raises(ValueError, match="swiglu"):
        q8.swiglu(x, q8.pack(qweight, scale, bias), chunk)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 6, 7, 64])
@pytest.mark.parametrize("in_features,out_features", [(3, 15), (37, 50), (512, 768), (1538, 33)])
def test_bfloat16_rows_give_the_bits_of_the_reference(rows, in_features, out_features):
    torch.manual_seed(rows + in_features * 3 + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    qweight, scale = q8.quantize_weight(torch.randn(out_features, in_features))
    bias = torch.randn(out_features).bfloat16()
    packed = q8.pack(qweight, scale, bias)
    got = q8.linear(x, packed)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, q8.reference_linear(x, qweight, scale, bias))
    with pytest.raises(ValueError, match="out must be a contiguous bfloat16"):
        q8.linear(x, packed, torch.empty(rows, out_features))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("in_features,inter", [(5, 3), (64, 20), (512, 1408), (100, 77)])
def test_bfloat16_fused_swiglu_gives_the_bits_of_the_bfloat16_projection_then_silu_mul(rows, in_features, inter):
    from mqinfer.kernels import cpu_ops

    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native ops library is not built here")
    torch.manual_seed(rows * 5 + in_features + inter)
    x = torch.randn(rows, in_features).bfloat16()
    weight = torch.randn(2 * inter, in_features) * 2  # gates past the exponential's range too
    bias = torch.randn(2 * inter)
    qweight, scale = q8.quantize_weight(weight)
    chunk = cpu_ops.silu_vector_chunk(torch.bfloat16)
    fused = q8.swiglu(x, q8.pack(qweight, scale, bias, swiglu=True), chunk)
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, inter)
    assert torch.equal(fused, cpu_ops.silu_mul(q8.reference_linear(x, qweight, scale, bias)))


@needs_bf16
def test_bfloat16_fused_swiglu_over_every_finite_gate_value():
    """Gates covering the whole bfloat16 range (each finite bit pattern: both signs, every
    exponent, subnormals and zeros), one row per gate value and one input feature, so each row's
    gates are its input scaled back: the fused SwiGLU's silu agrees with silu_mul's on all."""
    from mqinfer.kernels import cpu_ops

    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native ops library is not built here")
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = patterns[torch.isfinite(patterns.float())][:, None]
    chunk = cpu_ops.silu_vector_chunk(torch.bfloat16)
    inter = max(chunk, 8)  # whole vector chunks: the vectorised silu, not the scalar tail
    weight = torch.cat((torch.ones(inter, 1), torch.linspace(-3.0, 3.0, inter)[:, None]))
    qweight, scale = q8.quantize_weight(weight)
    projection = q8.reference_linear(x, qweight, scale, None)
    # Between the rows that quantize to zero (max|x| below about 4e-37) and those whose scaling
    # back overflows, every gate keeps its input's bits: most of the bfloat16 range.
    middle = (x[:, 0].float().abs() > 1e-36) & (x[:, 0].float().abs() < 1e36)
    assert float(middle.float().mean()) > 0.9
    assert torch.equal(projection[middle, 0].view(torch.int16), x[middle, 0].view(torch.int16))
    fused = q8.swiglu(x, q8.pack(qweight, scale, None, swiglu=True), chunk)
    assert torch.equal(fused.view(torch.int16), cpu_ops.silu_mul(projection).view(torch.int16))


def test_int_matmul_is_exact_for_a_single_input_feature():
    qx = torch.tensor([[127], [-127], [3]], dtype=torch.int8)
    qw = torch.tensor([[127], [1], [-5], [0]], dtype=torch.int8)
    assert torch.equal(q8.int_matmul(qx, qw), (qx.long() @ qw.long().t()).int())


@pytest.mark.parametrize("rows, k, n", [(1, 64, 128), (16, 64, 128), (17, 64, 128), (3, 13, 7), (20, 1, 9), (40, 4100, 7)])
def test_padded_int_mm_is_exact_for_any_shape(rows, k, n):
    # CUDA's torch._int_mm needs more than 16 rows and K, N multiples of 8, and CUDA has no int64
    # matmul to fall back on; the padded product (what int_matmul runs on CUDA) is run here on the
    # CPU's torch._int_mm, held to exact int64 sums.
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    qx = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen)
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    got = q8.padded_int_mm(qx, qw)
    assert got.dtype == torch.int32 and got.shape == (rows, n)
    assert torch.equal(got.long(), qx.long() @ qw.long().t())
