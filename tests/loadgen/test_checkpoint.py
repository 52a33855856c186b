"""The checkpoint maker: deterministic, reused, and loadable by transformers and by our loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mqinfer.loadgen.checkpoint import STANDARD_CONFIG, is_checkpoint, make_llama_checkpoint
from mqinfer.workers.loader import cpu_computes_natively, load_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)


def test_standard_config_is_the_benchmark_model():
    c = STANDARD_CONFIG
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"], c["max_position_embeddings"]) == (512, 8, 8, 2, 1408, 32000, 2048)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["torch_dtype"] == "bfloat16"


def test_small_checkpoint_loads_in_transformers(tmp_path):
    import transformers

    folder = make_llama_checkpoint(tmp_path / "ck", **SMALL)
    config = json.loads((folder / "config.json").read_text())
    assert config["head_dim"] == 16 and config["torch_dtype"] == "bfloat16"
    assert not (folder / "tokenizer.json").exists()
    tensors = load_file(folder / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    emb = tensors["model.embed_tokens.weight"].float()
    assert emb.shape == (300, 64) and 0.018 < emb.std().item() < 0.022 and abs(emb.mean().item()) < 0.002
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, tensors["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_and_reuse(tmp_path):
    a = make_llama_checkpoint(tmp_path / "a", **SMALL)
    b = make_llama_checkpoint(tmp_path / "b", **SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert make_llama_checkpoint(a, **SMALL) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    assert is_checkpoint(a, {**STANDARD_CONFIG, **SMALL, "head_dim": 16}, 0)

    make_llama_checkpoint(a, seed=1, **SMALL)  # another seed replaces it
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_llama_checkpoint(tmp_path / "mine", **SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError):
        make_llama_checkpoint(tmp_path / "x", num_attention_heads=3, num_key_value_heads=2, hidden_size=48)
    with pytest.raises(ValueError):
        make_llama_checkpoint(tmp_path / "x", dtype="int8")


def test_our_loader_reads_it(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "ck", **SMALL)
    # auto is the checkpoint's bfloat16 where this CPU computes it natively, else float32.
    _model, info = load_model(str(folder), device="cpu", dtype="auto")
    assert info.dtype == ("bfloat16" if cpu_computes_natively(torch.bfloat16) else "float32")
    model, info = load_model(str(folder), device="cpu", dtype="bfloat16")
    assert info.dtype == "bfloat16" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert info.vocab_size == 300 and info.num_layers == 2
    assert info.num_kv_heads == 2 and info.head_dim == 16 and info.hidden_size == 64
    assert info.eos_token_ids == (2,)
