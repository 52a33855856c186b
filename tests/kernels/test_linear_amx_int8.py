"""The AMX int8 w8a8 kernel (kernels/linear_amx_int8.py): bit for bit the PyTorch reference and the
VNNI kernel over row counts and shapes (float32 and bfloat16 rows, bias, fused SwiGLU), a row's
result independent of its batch and of the threads, what packs for it and what does not, and an
engine's greedy w8a8 output the same with the kernel on and off."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels import linear_amx_int8 as amx8
from mqinfer.kernels import linear_int8 as q8

pytestmark = pytest.mark.skipif(amx8.library() is None or not q8.native_takes_bf16(),
                                reason="no AMX int8 tiles on this CPU (or the OS refused them, or no C compiler)")

ROWS = [1, 7, 16, 33, 64, 200]
# (out_features, in_features): the model's shapes, and edges of panels (16) and K blocks (64).
SHAPES = [(576, 1536), (1536, 576), (100, 70), (17, 5), (64, 64), (33, 129)]


@pytest.fixture
def amx_on(monkeypatch):
    monkeypatch.delenv(amx8.SWITCH, raising=False)


def _vnni(monkeypatch, *args, **kw) -> q8.Int8Weight:
    """The same weight packed for the VNNI kernel (the switch off for the packing only)."""
    with monkeypatch.context() as m:
        m.setenv(amx8.SWITCH, "off")
        packed = q8.pack(*args, **kw)
    assert type(packed) is q8.Int8Weight
    return packed


def _weight(out_features: int, in_features: int, seed: int):
    torch.manual_seed(seed)
    qweight, scale = q8.quantize_weight(torch.randn(out_features, in_features))
    return qweight, scale, torch.randn(out_features)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gives_the_bits_of_the_reference_and_of_the_vnni_kernel(rows, out_features, in_features, dtype, amx_on,
                                                                 monkeypatch):
    qweight, scale, bias = _weight(out_features, in_features, rows * 31 + in_features + out_features)
    bias = bias if rows % 2 else None
    x = (torch.randn(rows, in_features) * 3).to(dtype)
    packed = q8.pack(qweight, scale, bias)
    assert isinstance(packed, amx8.AmxInt8Weight)
    got = q8.linear(x, packed)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert torch.equal(got, q8.reference_linear(x, qweight, scale, bias))
    assert torch.equal(got, q8.linear(x, _vnni(monkeypatch, qweight, scale, bias)))


@pytest.mark.parametrize("rows", [1, 7, 33, 200])
@pytest.mark.parametrize("in_features,inter", [(64, 20), (576, 1536), (100, 45), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_gives_the_bits_of_the_projection_then_silu_mul(rows, in_features, inter, dtype, amx_on,
                                                                     monkeypatch):
    if not cpu_ops.cpu_ops_available():
        pytest.skip("the native ops library is not built here")
    torch.manual_seed(rows * 5 + in_features + inter)
    weight = torch.randn(2 * inter, in_features) * 2  # gates past the exponential's range too
    bias = torch.randn(2 * inter)
    qweight, scale = q8.quantize_weight(weight)
    x = torch.randn(rows, in_features).to(dtype)
    chunk = cpu_ops.silu_vector_chunk(dtype)
    packed = q8.pack(qweight, scale, bias, swiglu=True)
    assert isinstance(packed, amx8.AmxInt8Weight)
    fused = q8.swiglu(x, packed, chunk)
    assert fused.dtype == dtype and fused.shape == (rows, inter)
    assert torch.equal(fused, cpu_ops.silu_mul(q8.reference_linear(x, qweight, scale, bias)))
    assert torch.equal(fused, q8.swiglu(x, _vnni(monkeypatch, qweight, scale, bias, swiglu=True), chunk))


def test_extreme_values_keep_the_sums_exact(amx_on):
    # Every weight +-127 and every activation at +-127 after quantization: the largest sums
    # (127 * 127 * 4160, about 2^26) in both signs, exact in int32.
    torch.manual_seed(2)
    k = 4160
    qweight = (torch.randint(0, 2, (48, k)) * 254 - 127).to(torch.int8)
    qweight[0] = 127
    qweight[1] = -127
    scale = torch.rand(48) + 0.5
    x = torch.ones(5, k)
    x[1] = -1.0
    x[2] = torch.where(torch.rand(k) > 0.5, 1.0, -1.0)
    x[3] = 0.0  # a zero row: scale 0
    x[4] = 1e-38  # too small to scale: zeros
    packed = q8.pack(qweight, scale)
    assert isinstance(packed, amx8.AmxInt8Weight)
    got = q8.linear(x, packed)
    assert torch.equal(got, q8.reference_linear(x, qweight, scale))
    sums = q8.int_matmul(q8.quantize_rows(x)[0], qweight)
    assert int(sums[0, 0]) == 127 * 127 * k and int(sums[0, 1]) == -127 * 127 * k
    assert not got[3:].any()


def test_a_rows_result_depends_on_nothing_else(amx_on):
    qweight, scale, bias = _weight(200, 320, 5)
    x = torch.randn(77, 320).bfloat16()
    packed = q8.pack(qweight, scale, bias)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = q8.linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(q8.linear(x, packed), batch)
    finally:
        torch.set_num_threads(before)
    for i in (0, 15, 16, 31, 32, 76):
        assert torch.equal(q8.linear(x[i:i + 1], packed), batch[i:i + 1])
    assert torch.equal(q8.linear(x[40:], packed), batch[40:])


@pytest.mark.parametrize("rows", [512, 529, 1100])
def test_long_prompts_past_the_kernels_row_chunks(rows, amx_on):
    qweight, scale, bias = _weight(72, 200, rows)
    x = torch.randn(rows, 200).bfloat16()
    assert torch.equal(q8.linear(x, q8.pack(qweight, scale, bias)), q8.reference_linear(x, qweight, scale, bias))


def test_strided_rows_and_a_given_output(amx_on):
    qweight, scale, bias = _weight(96, 130, 6)
    wide = torch.randn(9, 200)
    packed = q8.pack(qweight, scale, bias)
    out = torch.full((9, 96), float("nan"))
    assert q8.linear(wide[:, :130], packed, out) is out
    assert torch.equal(out, q8.reference_linear(wide[:, :130], qweight, scale, bias))


def test_what_packs_for_it_and_what_does_not(monkeypatch, amx_on):
    qweight, scale, bias = _weight(40, 96, 7)
    assert amx8.enabled() and isinstance(q8.pack(qweight, scale, bias), amx8.AmxInt8Weight)
    # The switch keeps the VNNI kernel; a bad value is an error, not a silent choice.
    for value in ("off", "0"):
        monkeypatch.setenv(amx8.SWITCH, value)
        assert not amx8.enabled() and type(q8.pack(qweight, scale, bias)) is q8.Int8Weight
    monkeypatch.setenv(amx8.SWITCH, "maybe")
    with pytest.raises(ValueError, match=amx8.SWITCH):
        q8.pack(qweight, scale, bias)
    monkeypatch.setenv(amx8.SWITCH, "on")
    # Not an int8 2-D CPU weight, an odd number of rows for SwiGLU, no input features: not for
    # this kernel (the caller's other paths take them).
    assert amx8.pack(qweight.float(), scale) is None
    assert amx8.pack(qweight[None], scale) is None
    assert amx8.pack(qweight[:39], scale[:39], swiglu=True) is None
    assert amx8.pack(torch.empty(8, 0, dtype=torch.int8), scale[:8]) is None
    # The dense layers' switch turns it off with the other native kernels.
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert amx8.library() is None and q8.pack(qweight, scale, bias) is None
    monkeypatch.delenv("MQINFER_CPU_LINEAR")
    packed = q8.pack(qweight, scale, bias)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensor"):
        q8.linear(torch.randn(3, 95), packed)
    with pytest.raises(ValueError, match="swiglu"):
        q8.linear(torch.randn(3, 96), q8.pack(qweight, scale, swiglu=True))


def test_the_switch_is_read_at_every_call(monkeypatch, amx_on):
    qweight, scale, bias = _weight(50, 140, 8)
    x = torch.randn(21, 140).bfloat16()
    expected = q8.reference_linear(x, qweight, scale, bias)
    packed = q8.pack(qweight, scale, bias)
    assert torch.equal(q8.linear(x, packed), expected) and packed.vnni is None
    # Off: the VNNI kernel on a copy in its layout, made once; on again: the tiles.
    monkeypatch.setenv(amx8.SWITCH, "off")
    assert torch.equal(q8.linear(x, packed), expected)
    vnni = packed.vnni
    assert type(vnni) is q8.Int8Weight and packed.for_call() is vnni
    assert torch.equal(q8.linear(x, packed), expected) and packed.vnni is vnni
    monkeypatch.setenv(amx8.SWITCH, "on")
    assert packed.for_call() is packed and torch.equal(q8.linear(x, packed), expected)


# ------------------------------------------------------------------ a model on it
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A random Qwen2 saved by transformers: biases on q/k/v, widths that are not multiples of
    the kernel's 64-input blocks (hidden 96, intermediate 200) or of its 16-feature panels
    (vocabulary 300)."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen2_amx_int8")
    torch.manual_seed(11)
    config = transformers.Qwen2Config(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
                                      eos_token_id=2, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


def _greedy(model: str, dtype: str) -> tuple[dict, set[type]]:
    """Greedy w8a8 continuations of a few prompts (prefills of 3 to 43 tokens, then decoding),
    with their logprobs, and the kinds of packed weight the layers used."""
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine
    from mqinfer.workers.engine.models.quant import Int8Linear

    engine = LLMEngine(EngineConfig(model=model, num_threads=1, num_kv_blocks=128, dtype=dtype,
                                    quantization="w8a8"))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    for i in range(5):
        engine.add_request(f"r{i}", [5 + (i * 7 + j * 3) % 280 for j in range(3 + i * 10)], sampling)
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = (list(out.output_token_ids), [e["logprob"] for e in out.logprobs])
    kinds = {type(packed) for layer in engine.model.modules() if isinstance(layer, Int8Linear)
             for packed in (layer.packed, layer.packed_swiglu) if packed is not None}
    return done, kinds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engines_greedy_w8a8_output_is_the_same_with_the_kernel_on_and_off(tiny_qwen2, dtype, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setenv(amx8.SWITCH, "on")
        on, kinds_on = _greedy(tiny_qwen2, dtype)
        monkeypatch.setenv(amx8.SWITCH, "off")
        off, kinds_off = _greedy(tiny_qwen2, dtype)
    finally:
        torch.set_num_threads(before)
    assert kinds_on == {amx8.AmxInt8Weight} and kinds_off == {q8.Int8Weight}
    assert len(on) == 5 and all(len(tokens) == 8 for tokens, _ in on.values())
    assert on == off
