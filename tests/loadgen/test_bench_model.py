"""The bench's model: any checkpoint folder, and prompt ids kept clear of its special tokens."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen.bench_model import prompt_id_range, resolve_model, special_token_ids
from mqinfer.loadgen.checkpoint import make_llama_checkpoint

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}


def _write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_a_folder_without_tokenizer_keeps_the_llama_low_ids_out(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "ckpt", **SMALL)
    spec = resolve_model(str(folder))
    assert spec.arg == str(folder.resolve()) and spec.folder == folder.resolve()
    assert (spec.min_token_id, spec.vocab_size, spec.max_model_len) == (3, 300, 256)
    assert spec.config["num_hidden_layers"] == 1


def test_special_tokens_of_a_tokenizer_bound_the_prompt_ids(tmp_path):
    # SmolLM2-like: 17 special tokens at the bottom of the vocabulary.
    low = tmp_path / "low"
    low.mkdir()
    _write(low, "config.json", {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2})
    _write(low, "tokenizer.json", {"added_tokens": [{"id": i, "content": f"<s{i}>", "special": True}
                                                    for i in range(17)]})
    assert prompt_id_range(low, json.loads((low / "config.json").read_text())) == (17, 49152)
    # Llama 3-like: special tokens at the top, listed in tokenizer_config.json only, and an eos list.
    high = tmp_path / "high"
    high.mkdir()
    config = {"vocab_size": 1000, "bos_token_id": 900, "eos_token_id": [901, 909]}
    _write(high, "config.json", config)
    _write(high, "tokenizer_config.json", {"added_tokens_decoder": {
        str(i): {"content": f"<r{i}>", "special": True} for i in range(900, 1000)}})
    assert special_token_ids(high, config) == set(range(900, 1000))
    assert prompt_id_range(high, config) == (3, 900)
    # A token added without `special` is an ordinary one.
    _write(high, "tokenizer.json", {"added_tokens": [{"id": 5, "content": "word", "special": False}]})
    assert prompt_id_range(high, config) == (3, 900)


def test_bad_model_folders_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    _write(tmp_path, "config.json", {"model_type": "llama"})
    with pytest.raises(ValueError, match="no vocab_size"):
        resolve_model(str(tmp_path))
    _write(tmp_path, "config.json", {"vocab_size": 10})
    _write(tmp_path, "tokenizer.json", {"added_tokens": [{"id": i, "special": True} for i in range(8)]})
    with pytest.raises(ValueError, match="no ordinary token ids left"):
        resolve_model(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not valid JSON"):
        resolve_model(str(tmp_path))
