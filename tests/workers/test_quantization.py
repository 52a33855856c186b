"""--quantization w8a8 / w8a16 in the model and the engine: the layer swap touches only the
decoder projections (and, with w8a8's --quantize-lm-head, the LM head, as an int8 copy beside
a tied embedding), the native and PyTorch w8a8 paths give the same tokens and logprobs bit for
bit, the native w8a16 engine gives those of the float32 engine on the dequantized weights bit for
bit (and the PyTorch w8a16 path the same tokens, logprobs to rounding), and quantized outputs
stay close to the float model's."""

from __future__ import annotations

import sys

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels import linear_int8 as q8
from mqinfer.kernels import linear_w8a16 as w16
from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.loader import load_model
from mqinfer.workers.engine.models.layers import Linear, LMHead
from mqinfer.workers.engine.models.quant import Int8Linear, quantize_model
from tests import zygote


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, make_hf_checkpoint):
    """A random Qwen2 (biases on q/k/v, tied embeddings off) saved by transformers, float32."""
    folder = tmp_path_factory.mktemp("qwen2")
    make_hf_checkpoint("qwen2", folder, seed=3)
    return str(folder)


def _generate(model: str, prompts: list[list[int]], prepare=None, **kw) -> dict[str, tuple[list[int], list[float]]]:
    engine = LLMEngine(EngineConfig(model=model, num_threads=1, num_kv_blocks=256, **kw))
    if prepare is not None:
        prepare(engine.model)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = (list(out.output_token_ids), [e["logprob"] for e in out.logprobs])
    return done


PROMPTS = [[5 + (i * 7 + j * 3) % 280 for j in range(3 + i * 5)] for i in range(6)]


def test_the_swap_touches_only_the_decoder_projections(qwen2):
    model, _ = load_model(qwen2, "cpu", "float32")
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert quantize_model(model, "none") == 0
    assert quantize_model(model, "w8a8") == 4 * len(model.model.layers)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model.lm_head.weight is head and model.model.embed_tokens.weight is embed
    swapped = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(swapped, Int8Linear) and swapped.bias is qkv.bias and swapped.qweight.dtype == torch.int8
    # Each weight is its int8 value times its row's scale, to half a step.
    error = (swapped.qweight.float() * swapped.scale[:, None] - qkv.weight).abs()
    assert bool((error <= swapped.scale[:, None] * 0.5 * (1 + 1e-6)).all())
    assert quantize_model(model, "w8a8") == 0  # already swapped
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "int4")


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory, make_hf_checkpoint):
    """A random Qwen2 whose LM head is its embedding table (tied), float32."""
    folder = tmp_path_factory.mktemp("qwen2_tied")
    make_hf_checkpoint("qwen2", folder, seed=5, tie_word_embeddings=True)
    return str(folder)


@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_swap_gives_an_int8_copy_and_keeps_the_embedding(qwen2, qwen2_tied, tied):
    model, _ = load_model(qwen2_tied if tied else qwen2, "cpu", "float32")
    head, embed = model.lm_head, model.model.embed_tokens.weight
    float_weight = head.weight.detach().clone()
    assert (head.weight is embed) == tied
    # Only w8a8 takes the head.
    model16, _ = load_model(qwen2, "cpu", "float32")
    assert quantize_model(model16, "w8a16", lm_head=True) == 4 * len(model16.model.layers)
    assert isinstance(model16.lm_head, LMHead)
    assert quantize_model(model, "w8a8", lm_head=True) == 4 * len(model.model.layers) + 1
    swapped = model.lm_head
    assert isinstance(swapped, Int8Linear) and swapped.bias is None and swapped.qweight.dtype == torch.int8
    assert swapped.out_features == float_weight.shape[0] and swapped.in_features == float_weight.shape[1]
    # The embedding keeps its float table (the head's int8 copy is its own), bit for bit.
    assert model.model.embed_tokens.weight is embed and torch.equal(embed.detach(), float_weight if tied else embed)
    error = (swapped.qweight.float() * swapped.scale[:, None] - float_weight).abs()
    assert bool((error <= swapped.scale[:, None] * 0.5 * (1 + 1e-6)).all())
    # compute_logits goes through it: reference_linear's bits, and close to the float head
    # (relative to the logits' spread: measured at most 4% of it on this random model).
    torch.manual_seed(0)
    hidden = torch.randn(5, float_weight.shape[1])
    logits = model.compute_logits(hidden)
    assert torch.equal(logits, q8.reference_linear(hidden, swapped.qweight, swapped.scale))
    exact = hidden @ float_weight.t()
    assert float((logits - exact).abs().max()) < 0.06 * float(exact.std())
    out = torch.full_like(exact, float("nan"))
    assert model.compute_logits(hidden, out) is out and torch.equal(out, logits)
    assert quantize_model(model, "w8a8", lm_head=True) == 0  # already swapped


def test_the_engine_quantizes_the_lm_head_with_w8a8_unless_told_not_to(qwen2_tied):
    def head_of(**kw):
        return LLMEngine(EngineConfig(model=qwen2_tied, num_threads=1, num_kv_blocks=64, **kw)).model.lm_head

    assert EngineConfig().quantize_lm_head
    assert isinstance(head_of(quantization="w8a8"), Int8Linear)
    assert isinstance(head_of(quantization="w8a8", quantize_lm_head=False), LMHead)
    assert isinstance(head_of(quantization="w8a16"), LMHead)
    assert isinstance(head_of(), LMHead)


@pytest.mark.skipif(not q8.native_available(), reason="no native int8 kernel for this CPU (it needs AVX2, or AVX-512 with VNNI)")
def test_w8a8_native_and_pytorch_paths_give_the_same_tokens_and_logprobs(qwen2, monkeypatch):
    native = _generate(qwen2, PROMPTS, quantization="w8a8")
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert not q8.native_available()
    assert _generate(qwen2, PROMPTS, quantization="w8a8") == native


@pytest.mark.skipif(not q8.native_available(), reason="no native int8 kernel for this CPU (it needs AVX2, or AVX-512 with VNNI)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_half_precision_rows_take_the_native_kernel_with_the_bits_of_pytorch(dtype, monkeypatch):
    torch.manual_seed(4)
    linear = Linear(96, 40, True, dtype, "cpu")
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.normal_()
    layer = Int8Linear(linear, "w8a8")
    calls = []
    kernel = q8.linear
    monkeypatch.setattr(q8, "linear", lambda *a, **kw: calls.append(a[0].dtype) or kernel(*a, **kw))
    x = torch.randn(7, 96).to(dtype)
    expected = q8.reference_linear(x, layer.qweight, layer.scale, layer.bias)
    got = layer(x)
    # bfloat16 rows go in as they are where the kernel takes them, else widened to float32.
    direct = dtype == torch.bfloat16 and q8.native_takes_bf16()
    assert calls == [dtype if direct else torch.float32]
    assert got.dtype == dtype and torch.equal(got, expected)
    out = torch.full((7, 40), float("nan"), dtype=dtype)
    assert layer(x, out) is out and torch.equal(out, expected)
    # The fused SwiGLU: on bfloat16 rows the kernel's, with the bits of the unfused path (the
    # projection rounded to bfloat16, then silu_mul); elsewhere none (the caller goes unfused).
    chunk = cpu_ops.silu_vector_chunk(dtype)
    fused = layer.swiglu(x, chunk)
    if direct and cpu_ops.cpu_ops_available():
        assert torch.equal(fused, cpu_ops.silu_mul(expected))
    else:
        assert fused is None


def _dequantize_projections(model: torch.nn.Module) -> None:
    """Each decoder projection's float weight replaced by its int8 weight times its scales, the
    weight a w8a16 layer computes with."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear):  # the decoder projections (the LM head is an LMHead)
                qweight, scale = q8.quantize_weight(module.weight)
                module.weight.copy_(qweight.float() * scale[:, None])
                module.packed = module.packed_swiglu = None


@pytest.mark.skipif(not w16.native_available(), reason="the native w8a16 kernel serves AVX2 CPUs without AVX-512")
def test_w8a16_native_gives_the_float32_engine_on_the_dequantized_weights(qwen2, monkeypatch):
    native = _generate(qwen2, PROMPTS, quantization="w8a16")
    # The native kernel is the float32 kernel on q * scale, bias and fused SwiGLU included.
    assert _generate(qwen2, PROMPTS, prepare=_dequantize_projections) == native
    # PyTorch's path (dequantize, then F.linear: MKL's summation order) agrees to rounding.
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert not w16.native_available()
    torch_path = _generate(qwen2, PROMPTS, quantization="w8a16")
    for r in native:
        assert torch_path[r][0] == native[r][0]
        assert max(abs(a - b) for a, b in zip(torch_path[r][1], native[r][1])) < 1e-4


@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_quantized_outputs_stay_close_to_the_float_model(qwen2, mode):
    plain = _generate(qwen2, PROMPTS)
    quantized = _generate(qwen2, PROMPTS, quantization=mode)
    # The first token comes from the prompt alone: it must agree for most prompts, and its
    # logprob stays within a small distance (measured: at most 0.04 on this random model).
    firsts = sum(quantized[r][0][0] == plain[r][0][0] for r in plain)
    assert firsts >= len(PROMPTS) - 1
    for r in plain:
        if quantized[r][0][0] == plain[r][0][0]:
            assert abs(quantized[r][1][0] - plain[r][1][0]) < 0.1


def test_a_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be none, w8a8 or w8a16"):
        EngineConfig(quantization="int4")
    proc = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--quantization", "int4"],
                      capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "'int4' is not one of none, w8a8, w8a16" in proc.stderr


def test_smoothing_keeps_the_float_model_and_flattens_the_activations(qwen2):
    from mqinfer.workers.engine.models.quant import activation_ranges, smooth

    engine = LLMEngine(EngineConfig(model=qwen2, num_threads=1, num_kv_blocks=64))
    runner, model = engine.runner, engine.model
    ids = [3 + (i * 37) % 290 for i in range(200)]
    before = runner.forward_sequence(ids).clone()
    ranges = activation_ranges(model, lambda: runner.forward_sequence(ids))
    layers = len(model.model.layers)
    assert len(ranges) == 3 * layers and all(r.dim() == 1 and bool((r >= 0).all()) for r in ranges.values())
    assert smooth(model, ranges, 0.7) == 3 * layers
    # The same function in float32, to rounding.
    torch.testing.assert_close(runner.forward_sequence(ids), before, rtol=1e-4, atol=1e-4)
    # And each smoothed projection's input channels now span a narrower range of maxima.
    after = activation_ranges(model, lambda: runner.forward_sequence(ids))
    for proj, r in ranges.items():
        spread = lambda t: float(t.max() / t.clamp(min=1e-6).median())  # noqa: E731
        assert spread(after[proj]) <= spread(r) + 1e-6


def test_smoothing_the_lm_head_keeps_the_function_and_the_tied_embedding(qwen2_tied):
    from mqinfer.workers.engine.models.quant import activation_ranges, smooth

    engine = LLMEngine(EngineConfig(model=qwen2_tied, num_threads=1, num_kv_blocks=64))
    runner, model = engine.runner, engine.model
    embed = model.model.embed_tokens.weight
    table = embed.detach().clone()
    assert model.lm_head.weight is embed
    ids = [3 + (i * 37) % 290 for i in range(200)]
    hidden = runner.forward_sequence(ids).clone()
    before = model.compute_logits(hidden).clone()
    assert model.lm_head not in activation_ranges(model, lambda: runner.forward_sequence(ids))
    ranges = activation_ranges(model, lambda: runner.forward_sequence(ids), lm_head=True)
    torch.testing.assert_close(ranges[model.lm_head], hidden.abs().amax(dim=0))
    assert smooth(model, ranges, 0.7) == 3 * len(model.model.layers) + 1
    # The head has a weight of its own; the embedding table is untouched, bit for bit.
    assert model.lm_head.weight is not embed and model.model.embed_tokens.weight is embed
    assert torch.equal(embed.detach(), table)
    # The same logits in float32, to rounding, from a flatter final hidden state.
    smoothed = runner.forward_sequence(ids)
    torch.testing.assert_close(model.compute_logits(smoothed), before, rtol=1e-4, atol=1e-4)
    spread = lambda t: float(t.max() / t.clamp(min=1e-6).median())  # noqa: E731
    assert spread(smoothed.abs().amax(dim=0)) < spread(hidden.abs().amax(dim=0))


@pytest.mark.skipif(not q8.native_available(), reason="no native int8 kernel for this CPU (it needs AVX2, or AVX-512 with VNNI)")
def test_w8a8_weights_are_packed_at_start_up_and_the_first_step_uses_that_packing():
    engine = LLMEngine(EngineConfig(model="tiny", num_threads=1, num_kv_blocks=64, quantization="w8a8"))
    try:
        layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
        packed = [(m.packed, m.packed_swiglu) for m in layers]
        # Every int8 layer holds its packing before any request: the gate/up projections the fused
        # SwiGLU's (where the fused CPU ops run), the others the plain one.
        assert layers and all(p is not None or s is not None for p, s in packed)
        engine.add_request("r", [256, 9, 10], SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        # The steps ran on those packings, packing nothing again.
        assert all(m.packed is p and m.packed_swiglu is s for m, (p, s) in zip(layers, packed))
    finally:
        engine.close()
