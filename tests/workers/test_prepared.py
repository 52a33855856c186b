"""The prepared model kept between starts: a second engine reads what the first prepared (a GGUF's
dequantized weights, w8a8's calibrated and quantized projections, the GGUF's tokenizer) and runs
exactly as the first did; a changed file, a corrupt entry or the switch make it prepare again."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.engine import prepared
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.models.quant import Int8Linear
from tests.workers.gguf_files import byte_level_vocab, write_gguf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv(prepared.DIR_ENV, str(tmp_path / "prepared"))
    monkeypatch.delenv(prepared.SWITCH, raising=False)


@pytest.fixture
def gguf_path(tmp_path, make_hf_checkpoint):
    model = make_hf_checkpoint("llama", tmp_path / "hf", seed=5, **SHAPE)
    state = dict(model.state_dict())
    return write_gguf(tmp_path / "m" / "model.gguf", "llama", model.config.to_dict(), state, "Q8_0",
                      byte_level_vocab(300))


def _engine(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", num_threads=1, num_kv_blocks=64, **overrides))


def _greedy(engine: LLMEngine) -> dict[str, list[int]]:
    prompts = {"a": engine.tokenizer.encode("the quick brown fox"), "b": [5, 17, 42, 99, 250, 7]}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


def _entries() -> list:
    root = prepared.cache_dir()
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_a_second_start_reads_the_prepared_w8a8_model_and_runs_the_same(gguf_path, caplog):
    first = _engine(gguf_path, quantization="w8a8", kv_cache_dtype="int8")
    assert len(_entries()) == 1
    with caplog.at_level(logging.INFO, logger="mqinfer.workers.engine.startup"):
        second = _engine(gguf_path, quantization="w8a8", kv_cache_dtype="int8")
    assert "read as prepared by an earlier start" in caplog.text
    assert second.info == first.info
    ours, theirs = first.model.state_dict(), second.model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    kinds = {type(m).__name__ for m in second.model.modules() if isinstance(m, Int8Linear)}
    assert kinds == {"Int8Linear"} and isinstance(second.model.lm_head, Int8Linear)  # the head too
    text = "the quick brown fox jumps"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert _greedy(second) == _greedy(first)


def test_a_plain_gguf_is_kept_dequantized_and_a_changed_file_is_prepared_again(gguf_path):
    first = _greedy(_engine(gguf_path))
    [entry] = _entries()
    assert _greedy(_engine(gguf_path)) == first and _entries() == [entry]
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed
    _engine(gguf_path)
    assert len(_entries()) == 2


def test_a_corrupt_entry_is_removed_and_the_model_prepared_again(gguf_path, caplog):
    # 8-bit weights (the w8a8 entry, read back, is the first test's; its calibration costs more).
    first = _greedy(_engine(gguf_path, quantization="w8a16"))
    [entry] = _entries()
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="mqinfer.workers.engine.prepared"):
        again = _engine(gguf_path, quantization="w8a16")
    assert "unreadable" in caplog.text
    assert _greedy(again) == first and len(_entries()) == 1  # written anew


def test_switched_off_or_nothing_to_save_keeps_nothing(gguf_path, tmp_path, monkeypatch):
    from mqinfer.loadgen.checkpoint import make_llama_checkpoint

    folder = make_llama_checkpoint(tmp_path / "ck", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=128)
    _engine(folder)  # a safetensors folder in its own dtype: read as fast as an entry would be
    assert _entries() == []
    monkeypatch.setenv(prepared.SWITCH, "off")
    _engine(gguf_path)
    assert _entries() == []
    monkeypatch.delenv(prepared.SWITCH)
    _engine(folder, quantization="w8a16")  # quantized: kept
    assert len(_entries()) == 1


def test_only_the_most_recently_used_entries_are_kept(gguf_path, monkeypatch):
    monkeypatch.setattr(prepared, "_MAX_ENTRIES", 2)
    # Three entries of three kinds: the GGUF's weights as they are, 8-bit weights, and w8a8's.
    variants = [{}, {"quantization": "w8a16"}, {"quantization": "w8a8", "smoothquant_alpha": 0.6}]
    for made, variant in enumerate(variants, 1):
        _engine(gguf_path, **variant)
        assert len(_entries()) == min(made, 2)
    keys = {prepared.entry_key(EngineConfig(model=str(gguf_path), dtype="bfloat16", **v), torch.device("cpu"))
            for v in variants[1:]}
    assert {p.name for p in _entries()} == keys
