"""The native dense-layer kernel (kernels/linear.py): held to a float64 reference within the
rounding error of a float32 dot product, a row's result independent of the batch and of the
thread count, and the model's layers using it where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mqinfer.kernels import linear as dense

needs_kernel = pytest.mark.skipif(not dense.native_linear_available(),
                                  reason="the native dense kernel serves float32 on AVX2 CPUs without AVX-512")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def _check_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within the error bound of summing K float32 products one after another (K units of
    float32 rounding on the sum of their magnitudes), plus the bias's rounding."""
    ref = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        ref = ref + bias.double()
        magnitude = magnitude + bias.double().abs()
    bound = (x.shape[1] + 2) * 2.0**-24 * magnitude + 1e-30
    assert got.dtype == torch.float32 and got.shape == ref.shape
    excess = ((got.double() - ref).abs() - bound).max()
    assert excess <= 0, f"error exceeds the float32 bound by {float(excess)}"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 301])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (3, 15), (64, 16), (100, 17), (576, 960), (1536, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_reference_at_odd_sizes(rows, in_features, out_features, with_bias):
    torch.manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    packed = dense.pack(weight)
    got = dense.linear(x, packed, bias)
    _check_close(got, x, weight, bias)
    # The error is float32 rounding, not a different result: as close as PyTorch's own.
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4 * in_features**0.5)


@needs_kernel
def test_strided_input_and_given_output():
    torch.manual_seed(1)
    wide = torch.randn(40, 700)
    x = wide[:, 50:626]  # rows strided by 700
    weight = torch.randn(100, 576)
    out = torch.full((40, 100), float("nan"))
    got = dense.linear(x, dense.pack(weight), None, out)
    assert got.data_ptr() == out.data_ptr()
    _check_close(out, x, weight, None)
    with pytest.raises(ValueError, match="out must be"):
        dense.linear(x, dense.pack(weight), None, torch.empty(40, 99))
    with pytest.raises(ValueError, match="x must be"):
        dense.linear(torch.randn(3, 575), dense.pack(weight))


@needs_kernel
def test_a_row_does_not_depend_on_the_batch_or_the_thread_count(threads):
    # Each output is one chain of multiply-adds in a fixed order: a row gives the same bits
    # alone, at any place in a batch (any position in a tile of rows, any block) and on any
    # number of threads.
    torch.manual_seed(2)
    weight = torch.randn(1000, 576)
    packed = dense.pack(weight)
    batch = torch.randn(300, 576)
    threads(1)
    together = dense.linear(batch, packed)
    threads(3)
    assert torch.equal(dense.linear(batch, packed), together)
    for i in (0, 5, 6, 11, 150, 299):
        assert torch.equal(dense.linear(batch[i:i + 1], packed), together[i:i + 1])
        assert torch.equal(dense.linear(batch[i:i + 7], packed), together[i:i + 7])


def test_pack_declines_what_the_kernel_does_not_take(monkeypatch):
    assert dense.pack(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    assert dense.pack(torch.randn(2, 4, 8)) is None
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert not dense.native_linear_available()
    assert dense.pack(torch.randn(4, 8)) is None
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "sometimes")
    with pytest.raises(ValueError, match="MQINFER_CPU_LINEAR must be auto, native or torch"):
        dense.native_linear_available()


@needs_kernel
def test_model_layers_use_the_kernel_and_repack_after_loading(tmp_path, monkeypatch):
    from mqinfer.workers.engine.loader import load_model, make_random_checkpoint
    from mqinfer.workers.engine.models.layers import Linear

    make_random_checkpoint(tmp_path, dtype="float32", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model, _ = load_model(str(tmp_path), "cpu", "float32")
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Linear)
    x = torch.randn(9, 96)
    with torch.inference_mode():
        y = layer(x)
    assert layer.packed is not None and layer.packed.packed_from(layer.weight)
    _check_close(y, x, layer.weight, None)
    # New weights through load_weights: the old packed copy is dropped, the next call repacks.
    new = torch.randn_like(layer.weight)
    model.load_weights([("model.layers.0.mlp.down_proj.weight", new)])
    assert layer.packed is None
    with torch.inference_mode():
        _check_close(layer(x), x, new, None)
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, new))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 7, 64])
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
    chunk = cpu_ops.silu_vector_chunk(torch.float32)
    fused = dense.swiglu(x, dense.pack_swiglu(weight, bias), chunk)
    unfused = cpu_ops.silu_mul(dense.linear(x, dense.pack(weight), bias))
    assert fused.shape == (rows, inter)
    assert torch.equal(fused, unfused)
    # And close to PyTorch's own SwiGLU.
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=1e-4, atol=1e-4 * in_features**0.5)
    with pytest.raises(ValueError, match="swiglu"):
        dense.linear(x, dense.pack_swiglu(weight, bias))
