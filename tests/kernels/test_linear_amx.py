"""The AMX bfloat16 dense kernel (kernels/linear_amx.py): held to the float32 product within
bfloat16 rounding, each row independent of its batch and of the threads, the model's layers on it
where it applies and on PyTorch's matmul where it does not or is switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mqinfer.kernels import cpu_ops, linear_amx

pytestmark = pytest.mark.skipif(not linear_amx.available(), reason="no AMX tiles on this CPU (or no C compiler)")


def _close_to_float32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    # One bfloat16 rounding of the result, plus float32 sums in another order.
    tol = exact.abs() * 2**-8 + 1e-3 * exact.abs().max()
    assert ((got.float() - exact).abs() <= tol).all()


@pytest.mark.parametrize("out_features,in_features", [(1152, 896), (100, 64), (3072, 576), (17, 32)])
@pytest.mark.parametrize("rows", [1, 7, 33, 64, 100])
def test_matches_the_float32_product_within_bfloat16_rounding(out_features, in_features, rows):
    torch.manual_seed(rows)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    packed = linear_amx.pack(w)
    assert packed is not None and packed.packed_from(w)
    _close_to_float32(linear_amx.linear(x, packed, bias), x, w, bias)
    _close_to_float32(linear_amx.linear(x, packed), x, w, None)
    # A strided view of wider rows, into a given output.
    wide = torch.randn(rows, in_features + 32).bfloat16()
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    assert linear_amx.linear(wide[:, :in_features], packed, bias, out=out) is out
    _close_to_float32(out, wide[:, :in_features], w, bias)


def test_a_rows_result_depends_on_nothing_else():
    torch.manual_seed(0)
    w = torch.randn(640, 256).bfloat16()
    x = torch.randn(77, 256).bfloat16()
    packed = linear_amx.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = linear_amx.linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(linear_amx.linear(x, packed), batch)
    finally:
        torch.set_num_threads(before)
    for i in (0, 31, 32, 76):
        assert torch.equal(linear_amx.linear(x[i:i + 1], packed), batch[i:i + 1])
    assert torch.equal(linear_amx.linear(x[40:], packed), batch[40:])


def test_what_the_kernel_takes_and_clear_errors():
    w = torch.randn(64, 96).bfloat16()
    assert linear_amx.pack(w.float()) is None and linear_amx.pack(torch.randn(64, 100).bfloat16()) is None
    assert linear_amx.takes(torch.randn(4, 96).bfloat16())
    assert not linear_amx.takes(torch.randn(4, 96))  # float32
    assert not linear_amx.takes(torch.randn(linear_amx.MAX_ROWS + 1, 96).bfloat16())  # long prompts: PyTorch
    packed = linear_amx.pack(w)
    with pytest.raises(ValueError, match="bfloat16 CPU tensor"):
        linear_amx.linear(torch.randn(4, 64).bfloat16(), packed)
    with pytest.raises(ValueError, match="bias"):
        linear_amx.linear(torch.randn(4, 96).bfloat16(), packed, torch.randn(64))


def test_the_models_layers_use_it_and_the_switch_turns_it_off(monkeypatch):
    from mqinfer.workers.engine.models.layers import Linear, LMHead

    torch.manual_seed(1)
    layer = Linear(256, 384, bias=True, dtype=torch.bfloat16, device="cpu")
    layer.weight.data.copy_(torch.randn(384, 256))
    layer.bias.data.copy_(torch.randn(384))
    head = LMHead(torch.nn.Parameter(torch.randn(1000, 256).bfloat16(), requires_grad=False))
    x = torch.randn(9, 256).bfloat16()
    got = layer(x)
    assert isinstance(layer.packed, linear_amx.AmxWeight)
    _close_to_float32(got, x, layer.weight, layer.bias)
    _close_to_float32(head(x), x, head.weight, None)
    # A replaced weight is packed again.
    layer.weight = torch.nn.Parameter(torch.randn(384, 256).bfloat16(), requires_grad=False)
    _close_to_float32(layer(x), x, layer.weight, layer.bias)
    # Long prompts and the switch: PyTorch's own calls, its bits.
    long = torch.randn(linear_amx.MAX_ROWS + 3, 256).bfloat16()
    assert torch.equal(layer(long), F.linear(long, layer.weight, layer.bias))
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_bfloat16_model_packs_every_layer_at_start(tmp_path):
    from mqinfer.loadgen.checkpoint import make_llama_checkpoint
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine
    from mqinfer.workers.engine.models.layers import Linear, LMHead
    from mqinfer.workers.engine.models.llama import MLP

    folder = make_llama_checkpoint(tmp_path / "ck", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=128)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", num_threads=1, num_kv_blocks=32))
    layers = [m for m in engine.model.modules() if isinstance(m, (Linear, LMHead))]
    assert len(layers) == 2 * 4 + 1
    gate_ups = [m.gate_up_proj for m in engine.model.modules() if isinstance(m, MLP)]
    assert len(gate_ups) == 2
    # The MLP's gate/up projection for the fused SwiGLU only (where the fused CPU ops run), the
    # others as they are.
    fused = cpu_ops.cpu_ops_available()
    for m in layers:
        packed = m.packed_swiglu if fused and m in gate_ups else m.packed
        assert isinstance(packed, linear_amx.AmxWeight) and packed.packed_from(m.weight)
        assert packed.inter == (m.weight.shape[0] // 2 if fused and m in gate_ups else 0)
    if fused:
        assert all(m.packed is None for m in gate_ups)
    assert engine.startup_seconds["pack weights"] > 0
    assert engine.model.pack_weights() == len(layers)  # packing again finds them packed


@pytest.mark.parametrize("inter,in_features", [(1408, 512), (1536, 576), (40, 64), (24, 32)])
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 33, 140])
def test_fused_swiglu_is_the_projection_then_silu_mul_bit_for_bit(inter, in_features, rows):
    # Intermediate sizes that fill whole panels of 16 and ones that do not; rows that fill one A
    # tile, two, and a partial last block. The bits of the plain kernel followed by silu_mul, for
    # PyTorch's vector chunk (every column through the vectorised exponential where the row has
    # whole chunks) and for none (std::exp throughout).
    torch.manual_seed(inter + rows)
    w = (torch.randn(2 * inter, in_features) * 0.1).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    packed = linear_amx.pack_swiglu(w)
    assert packed is not None and packed.packed_from(w) and packed.inter == inter
    gate_up = linear_amx.linear(x, linear_amx.pack(w))
    for chunk in (cpu_ops.silu_vector_chunk(torch.bfloat16), 0, 32):
        got = linear_amx.swiglu(x, packed, chunk)
        assert got.shape == (rows, inter)
        if chunk == cpu_ops.silu_vector_chunk(torch.bfloat16):
            assert torch.equal(got.view(torch.int16), cpu_ops.silu_mul(gate_up).view(torch.int16))
        # PyTorch's SwiGLU on the same projection (its exponential agrees with both forms here).
        assert torch.equal(got.view(torch.int16), (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).view(torch.int16))
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    wide = torch.zeros(rows, in_features + 32).bfloat16()
    wide[:, :in_features] = x
    assert linear_amx.swiglu(wide[:, :in_features], packed, 64, out=out) is out
    assert torch.equal(out, linear_amx.swiglu(x, packed, 64))


def test_fused_swiglu_refuses_what_it_cannot_take():
    w = torch.randn(64, 96).bfloat16()
    assert linear_amx.pack_swiglu(torch.randn(63, 96).bfloat16()) is None  # no gate/up halves
    assert linear_amx.pack_swiglu(w.float()) is None
    x = torch.randn(3, 96).bfloat16()
    with pytest.raises(ValueError, match="pack_swiglu"):
        linear_amx.swiglu(x, linear_amx.pack(w), 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_amx.swiglu(x, linear_amx.pack_swiglu(w), 24)
    with pytest.raises(ValueError, match=r"\[3, 32\]"):
        linear_amx.swiglu(x, linear_amx.pack_swiglu(w), 64, out=torch.empty(3, 64, dtype=torch.bfloat16))


def test_the_models_mlp_takes_the_fused_swiglu_with_the_same_bits():
    from mqinfer.workers.engine.models.llama import MLP, ModelConfig

    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native CPU ops are not built here")
    torch.manual_seed(3)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=128, intermediate_size=200,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64)
    mlp = MLP(config, torch.bfloat16, "cpu")
    for p in mlp.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.1)
    x = torch.randn(21, 128).bfloat16()
    fused = mlp(x)
    assert isinstance(mlp.gate_up_proj.packed_swiglu, linear_amx.AmxWeight) and mlp.gate_up_proj.packed is None
    gate_up = mlp.gate_up_proj(x)  # the plain projection, then SwiGLU and down on their own
    assert torch.equal(fused, mlp.down_proj(cpu_ops.silu_mul(gate_up)))
