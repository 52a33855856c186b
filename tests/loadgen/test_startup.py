"""The start-up profile: fresh processes, the first with nothing kept, the later ones reading the
prepared model the first kept; every part of start-up accounted for."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen.startup import main


def test_first_and_later_starts_of_a_gguf_model(tmp_path, capsys):
    from mqinfer.loadgen.checkpoint import GGUF_NAME, make_llama_checkpoint

    folder = make_llama_checkpoint(tmp_path / "ck", gguf=True, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=128)
    out = tmp_path / "startup.json"
    assert main(["--model", str(folder / GGUF_NAME), "--quantization", "w8a8", "--runs", "2", "--json", str(out)]) == 0
    first, later = json.loads(out.read_text())["runs"]
    assert first["engine: load model"] > 0 and "engine: read prepared model" not in first
    assert first["engine: quantize"] > 0 and first["engine: keep prepared model"] > 0
    assert later["engine: read prepared model"] > 0 and "engine: quantize" not in later
    for run in (first, later):
        parts = sum(v for k, v in run.items() if k not in ("total", "engine"))
        assert parts == pytest.approx(run["total"], abs=0.05)
        assert run["import torch"] > 0 and run["interpreter"] >= 0
    text = capsys.readouterr().out
    assert "run 1 (first)" in text and "engine: read prepared model" in text
