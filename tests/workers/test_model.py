"""The model families and the loader, held to transformers on tiny random checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from mqinfer.kernels.attention import build_attention_metadata
from mqinfer.workers.engine.loader import (
    ModelLoadError,
    cpu_computes_natively,
    load_model,
    make_random_checkpoint,
    save_tiny_checkpoint,
)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _our_logits(model, info, token_ids, chunks=None):
    """Run a prompt through our model (optionally in prefill chunks) and return all logits."""
    block_size = 16
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 2
    table = list(reversed(range(num_blocks)))  # non-trivial block order
    caches = [
        (torch.zeros(num_blocks, block_size, info.num_kv_heads, info.head_dim, dtype=model.dtype),
         torch.zeros(num_blocks, block_size, info.num_kv_heads, info.head_dim, dtype=model.dtype))
        for _ in range(info.num_layers)
    ]
    chunks = chunks or [n]
    logits, done = [], 0
    with torch.inference_mode():
        for size in chunks:
            md = build_attention_metadata([size], [done + size], [table], block_size,
                                          info.num_heads // info.num_kv_heads)
            ids = torch.tensor(token_ids[done:done + size])
            hidden = model(ids, md.positions, caches, md)
            logits.append(model.compute_logits(hidden).float())
            done += size
    return torch.cat(logits)


PROMPT = [1, 17, 250, 3, 99, 42, 42, 7, 150, 5, 61, 200, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 299]


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                   "attention_bias": True, "mlp_bias": True, "rope_theta": 500.0}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 32}),
    ],
)
def test_logits_match_transformers(tmp_path, family, overrides, make_hf_checkpoint):
    # Norm weights and projection biases are random, so a misplaced norm or bias would show.
    hf_model = make_hf_checkpoint(family, tmp_path, **overrides)
    model, info = load_model(str(tmp_path), "cpu", "float32")
    assert info.architecture == type(hf_model).__name__
    assert info.num_params == sum(p.numel() for p in hf_model.parameters())
    with torch.inference_mode():
        ref = hf_model(torch.tensor([PROMPT])).logits[0].float()
    ours = _our_logits(model, info, PROMPT)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # The same logits when the prompt is computed in three chunks over the paged cache.
    chunked = _our_logits(model, info, PROMPT, chunks=[5, 11, 8])
    torch.testing.assert_close(chunked, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["torch", "auto"])
def test_bfloat16_close_to_transformers_bfloat16(tmp_path, monkeypatch, attention, make_hf_checkpoint):
    # "torch": the SDPA path, the same attention kernel transformers uses, so greedy tokens are
    # identical. "auto": the native CPU kernel where it builds, whose float32 arithmetic differs
    # from SDPA's in the last bits: its tokens may differ only where transformers' own two best
    # logits are within one bfloat16 step of each other (a tie at bfloat16 resolution).
    monkeypatch.setenv("MQINFER_CPU_ATTENTION", attention)
    make_hf_checkpoint("llama", tmp_path)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model, info = load_model(str(tmp_path), "cpu", "bfloat16")
    assert info.dtype == "bfloat16" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        ref = hf_model(torch.tensor([PROMPT])).logits[0].float()
    ours = _our_logits(model, info, PROMPT)
    assert (ours - ref).abs().max() < 0.05
    if attention == "torch":
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        return
    top2 = ref.topk(2, dim=-1)
    step = 2.0 ** -7 * top2.values[:, 0].abs()  # one bfloat16 step (8 significant bits) near the top logit
    near_tie = (top2.values[:, 0] - top2.values[:, 1]) <= step
    picked = ours.argmax(-1)
    assert torch.equal(picked[~near_tie], ref.argmax(-1)[~near_tie])
    assert bool((picked[near_tie, None] == top2.indices[near_tie]).any(-1).all())
    # Random weights give flat logits, so about one position in five is such a tie here.
    assert int(near_tie.sum()) <= len(PROMPT) // 4


def test_model_info_and_id(tmp_path, make_hf_checkpoint):
    make_hf_checkpoint("llama", tmp_path / "ckpt")
    gen = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(gen))
    _, info = load_model(str(tmp_path / "ckpt"))
    assert info.name == "ckpt"
    name, _, digest = info.model_id.partition("@")
    assert name == "ckpt" and len(digest) == 8 and int(digest, 16) >= 0
    assert info.eos_token_ids == (2, 7)
    assert info.bos_token_id == 1
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.hidden_size) == (2, 2, 16, 64)
    assert info.max_model_len == 512 and info.vocab_size == 300 and info.dtype == "float32"
    # Same files -> same id; a changed weight -> a different id.
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    assert load_model(str(tmp_path / "copy"))[1].model_id.split("@")[1] == digest
    data = bytearray((tmp_path / "copy" / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (tmp_path / "copy" / "model.safetensors").write_bytes(bytes(data))
    assert load_model(str(tmp_path / "copy"))[1].model_id.split("@")[1] != digest


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, make_hf_checkpoint):
    hf_model = make_hf_checkpoint("llama", tmp_path / "one")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    m1, _ = load_model(str(tmp_path / "one"))
    m2, _ = load_model(str(tmp_path / "sharded"))
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_dtype_auto_follows_the_checkpoint(tmp_path, make_hf_checkpoint):
    hf_model = make_hf_checkpoint("llama", tmp_path / "f32")
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # auto is the checkpoint's dtype where this CPU computes it natively, else float32
    # (tests/workers/test_dtype.py covers both cases for any CPU).
    native = cpu_computes_natively(torch.bfloat16)
    assert load_model(str(tmp_path / "bf16"), dtype="auto")[1].dtype == ("bfloat16" if native else "float32")
    assert load_model(str(tmp_path / "bf16"), dtype="bfloat16")[1].dtype == "bfloat16"
    assert load_model(str(tmp_path / "bf16"), dtype="float32")[1].dtype == "float32"
    assert load_model(str(tmp_path / "f32"), dtype="auto")[1].dtype == "float32"
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(str(tmp_path / "f32"), dtype="int8")


def test_load_errors_name_the_problem(tmp_path, make_hf_checkpoint):
    with pytest.raises(ModelLoadError, match="neither 'tiny' nor a checkpoint folder"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    make_hf_checkpoint("llama", tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())

    bad = tmp_path / "arch"
    shutil.copytree(tmp_path / "ok", bad)
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(bad))

    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copy(tmp_path / "ok" / "config.json", noweights)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(noweights))

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "ok", missing)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing 1 weight tensors.*layers.1.mlp.up_proj"):
        load_model(str(missing))

    shape = tmp_path / "shape"
    shutil.copytree(tmp_path / "ok", shape)
    tensors = load_file(shape / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, shape / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight.*shape"):
        load_model(str(shape))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp_path / "ok", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(ModelLoadError, match="corrupt/model.safetensors: cannot read"):
        load_model(str(corrupt))

    rope = tmp_path / "rope"
    shutil.copytree(tmp_path / "ok", rope)
    (rope / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn"}}))
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        load_model(str(rope))


def test_tiny_is_deterministic_and_loads_in_transformers(tmp_path):
    m1, info1 = load_model("tiny")
    m2, info2 = load_model("tiny")
    assert info1.model_id == info2.model_id and info1.model_id.startswith("tiny@")
    assert info1.num_params == m1.model.embed_tokens.weight.numel() * 2 + 4 * (
        256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 704 + 2 * 256) + 256
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    # Drawn from a seeded generator: std 0.02, norms exactly 1.
    assert abs(float(m1.model.embed_tokens.weight.std()) - 0.02) < 0.001
    assert torch.equal(m1.model.norm.weight, torch.ones(256))
    assert (info1.vocab_size, info1.eos_token_ids, info1.bos_token_id, info1.max_model_len) == (264, (257,), 256, 2048)

    folder = save_tiny_checkpoint(tmp_path / "tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [256, *b"The tiny model"]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_our_logits(m1, info1, prompt), ref, rtol=1e-4, atol=1e-4)


def test_make_random_checkpoint(tmp_path):
    folder = make_random_checkpoint(tmp_path / "rand", dtype="bfloat16", hidden_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, intermediate_size=256)
    model, info = load_model(str(folder), dtype="bfloat16")
    assert info.dtype == "bfloat16" and info.head_dim == 32 and info.num_kv_heads == 1
    assert load_model(str(folder))[1].dtype == ("bfloat16" if cpu_computes_natively(torch.bfloat16) else "float32")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model32, info32 = load_model(str(folder), dtype="float32")
    prompt = [256, 1, 2, 3, 4, 5]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_our_logits(model32, info32, prompt), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reused_activation_buffers_carry_nothing_between_steps(tmp_path, make_hf_checkpoint, dtype):
    # The forward pass writes its intermediate activations into buffers kept across layers and
    # steps: a step's logits must not depend on what an earlier, larger or smaller step left
    # there, and the hidden states a step returns must not be overwritten by the next step.
    make_hf_checkpoint("llama", tmp_path, attention_bias=True, mlp_bias=True)
    model, info = load_model(str(tmp_path), "cpu", dtype)
    first = _our_logits(model, info, PROMPT)
    block_size, n = 16, len(PROMPT)
    table = list(range(-(-n // block_size)))
    caches = [(torch.zeros(len(table), block_size, info.num_kv_heads, info.head_dim, dtype=model.dtype),
               torch.zeros(len(table), block_size, info.num_kv_heads, info.head_dim, dtype=model.dtype))
              for _ in range(info.num_layers)]
    with torch.inference_mode():
        md = build_attention_metadata([5], [5], [table], block_size, info.num_heads // info.num_kv_heads)
        hidden = model(torch.tensor(PROMPT[:5]), md.positions, caches, md)
        kept = hidden.clone()
        bigger = [3 + (7 * i) % 250 for i in range(n)]
        _our_logits(model, info, bigger)  # a step over other tokens reuses every buffer
    assert torch.equal(hidden, kept)
    assert all(hidden.data_ptr() != b.data_ptr() for b in model.activations._buffers.values())
    again = _our_logits(model, info, PROMPT)
    assert torch.equal(again, first)
    fresh, _ = load_model(str(tmp_path), "cpu", dtype)  # a model whose buffers were never used
    assert torch.equal(_our_logits(fresh, info, PROMPT), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_in_vocabulary_slices_gives_the_same_bits(dtype, monkeypatch):
    # Without the native dense kernel the LM head on CPU runs as one matmul per slice of the
    # vocabulary, written into that slice's columns: each logit must be exactly what one
    # matmul over the whole head gives.
    from mqinfer.workers.engine.models.layers import LMHead

    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(1000, 1024).to(dtype), requires_grad=False)  # 256-row slices, a short last one
    head = LMHead(weight)
    for rows in (1, 5, 64):
        hidden = torch.randn(rows, 1024).to(dtype)
        expected = torch.nn.functional.linear(hidden, weight)
        assert torch.equal(head(hidden), expected)
        out = torch.full((rows, 1000), float("nan"), dtype=dtype)
        assert head(hidden, out).data_ptr() == out.data_ptr()
        assert torch.equal(out, expected)
