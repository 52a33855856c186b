"""The checkpoint maker: deterministic, reused, and loadable by transformers and by our loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mqinfer.loadgen.checkpoint import STANDARD_CONFIG, is_checkpoint, make_llama_checkpoint
from mqinfer.workers.engine.loader import cpu_computes_natively, load_model

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


def test_shapes_people_run_have_their_parameter_counts():
    from mqinfer.loadgen.checkpoint import SHAPES
    from mqinfer.loadgen.matrix_rate import ModelShape

    # Qwen2.5-0.5B's and -1.5B's published counts, less their q/k/v biases (this Llama has none).
    for name, published in (("0.5b", 494_032_768), ("1.5b", 1_543_714_304)):
        config = {**STANDARD_CONFIG, **SHAPES[name]}
        shape = ModelShape.from_config(config)
        biases = shape.num_layers * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        # Tied embeddings: the head is the embedding table, counted once; two norms per layer and one at the end.
        norms = (2 * shape.num_layers + 1) * shape.hidden_size
        assert shape.layer_params + shape.head_params + norms == published - biases
        assert config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]


def test_the_gguf_beside_a_tied_checkpoint_holds_the_same_weights(tmp_path):
    import transformers

    from mqinfer.loadgen import llamacpp
    from mqinfer.loadgen.checkpoint import GGUF_NAME
    from mqinfer.workers.engine.gguf import GGUFFile

    config = {**SMALL, "tie_word_embeddings": True}
    folder = make_llama_checkpoint(tmp_path / "ck", gguf=True, **config)
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    hf_model, _ = load_model(str(folder), device="cpu", dtype="bfloat16")
    gguf_model, gguf_info = load_model(str(folder / GGUF_NAME), device="cpu", dtype="bfloat16")
    ours, theirs = hf_model.state_dict(), gguf_model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert gguf_info.vocab_size == 300 and gguf_info.num_kv_heads == 2 and gguf_info.eos_token_ids == (2,)
    gguf_file = GGUFFile(folder / GGUF_NAME)
    assert "output.weight" not in gguf_file.tensors  # tied: llama.cpp uses the embedding
    assert gguf_file.metadata["tokenizer.ggml.model"] == "none" and gguf_file.metadata["llama.vocab_size"] == 300
    assert gguf_file.tensors["blk.0.attn_q.weight"].type_name == "BF16"
    assert gguf_file.tensors["blk.0.attn_norm.weight"].type_name == "F32"
    assert llamacpp.shape_mismatches(llamacpp.gguf_shape(folder / GGUF_NAME), {**STANDARD_CONFIG, **config}) == []

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    # Reused with its GGUF; asked again without one, the same folder is a different checkpoint.
    stamp = (folder / GGUF_NAME).stat().st_mtime_ns
    assert make_llama_checkpoint(folder, gguf=True, **config) == folder
    assert (folder / GGUF_NAME).stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="bfloat16"):
        make_llama_checkpoint(tmp_path / "f32", gguf=True, dtype="float32", **config)


def test_a_gguf_model_as_a_bf16_folder_and_gguf_of_the_same_bytes(tmp_path):
    from mqinfer.loadgen.checkpoint import GGUF_NAME, checkpoint_from_gguf, main
    from mqinfer.workers.engine.tokenizer import load_tokenizer
    from tests.workers.gguf_files import byte_level_vocab, write_gguf

    # A Q8_0 source (the kind of file people download), made from a random checkpoint.
    original = make_llama_checkpoint(tmp_path / "orig", **{**SMALL, "tie_word_embeddings": True})
    config = json.loads((original / "config.json").read_text())
    source = write_gguf(tmp_path / "src" / "m.gguf", "llama", config, load_file(original / "model.safetensors"),
                        "Q8_0", byte_level_vocab(300))
    assert main(["--from-gguf", str(source), "--out", str(tmp_path / "out")]) == 0
    folder = tmp_path / "out"
    # The source read in bfloat16, the folder and the new GGUF: one set of bytes.
    models = [load_model(str(p), device="cpu", dtype="bfloat16")[0].state_dict()
              for p in (source, folder, folder / GGUF_NAME)]
    assert all(set(m) == set(models[0]) and all(torch.equal(m[k], models[0][k]) for k in m) for m in models[1:])
    text = "the quick brown fox"
    assert load_tokenizer(folder).encode(text) == load_tokenizer(source).encode(text)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert checkpoint_from_gguf(source, folder) == folder  # reused
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        checkpoint_from_gguf(source, tmp_path / "theirs")
