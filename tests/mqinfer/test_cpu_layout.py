"""--workers auto on a CPU by the model's size: a copy per core for small models, one worker with
every core once a copy's weights stream from memory, sooner on a CPU with AMX tiles
(mqinfer/cpu_layout.py through choose_layout)."""

from __future__ import annotations

import pytest

from mqinfer import cpu_layout
from mqinfer.cpu_layout import WEIGHTS_STREAMED_BYTES, cpu_layout_for_model, half_precision_bytes
from mqinfer.layout import choose_layout

GIB = 1 << 30
REAL_CPU_HAS_AMX = cpu_layout.cpu_has_amx


@pytest.fixture(autouse=True)
def no_amx(monkeypatch):
    """The rule without AMX tiles, whatever this machine has (the AMX test says otherwise)."""
    monkeypatch.setattr(cpu_layout, "cpu_has_amx", lambda: False)


def _sparse(path, size):
    """A file of ``size`` bytes that takes no disk (only its size matters to the rule)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _layout(model, cores=2, **kw):
    opts = {"workers": "auto", "num_threads": None, "device": "cpu", "shards": 1, "model": str(model), **kw}
    return choose_layout(opts, cores=cores, gpu=False, memory=64 * GIB)


def test_small_models_get_a_single_threaded_worker_per_core(tmp_path):
    small = _sparse(tmp_path / "small" / "model.safetensors", 269 << 20)  # SmolLM2-135M in bfloat16
    assert half_precision_bytes(str(small.parent)) == 269 << 20
    assert _layout(small.parent)[:2] == (2, 1)
    assert _layout("tiny", cores=8)[:2] == (8, 1)


def test_a_model_whose_weights_stream_gets_one_worker_with_every_core(tmp_path):
    folder = tmp_path / "big"
    _sparse(folder / "model-00001-of-00002.safetensors", 600 << 20)
    _sparse(folder / "model-00002-of-00002.safetensors", 400 << 20)
    workers, threads, why = _layout(folder)
    assert (workers, threads) == (1, 2) and "stream from memory" in why
    assert _layout(folder, cores=16)[:2] == (1, 16)
    # A GGUF file's blocks count twice their size, dequantized.
    gguf = _sparse(tmp_path / "m.gguf", WEIGHTS_STREAMED_BYTES // 2)
    assert _layout(gguf)[:2] == (1, 2)
    assert _layout(_sparse(tmp_path / "s.gguf", WEIGHTS_STREAMED_BYTES // 2 - 1))[:2] == (2, 1)


def test_explicit_threads_one_core_and_parallel_ranks_keep_the_old_rule(tmp_path):
    folder = tmp_path / "big"
    _sparse(folder / "model.safetensors", 2 * GIB)
    assert _layout(folder, num_threads=1)[:2] == (2, 1)
    assert _layout(folder, cores=1)[:2] == (1, 1)
    assert cpu_layout_for_model(1, str(folder)) is None
    assert _layout(folder, tensor_parallel_size=2)[:2] == (1, 1)
    assert _layout(folder, workers=2)[:2] == (2, None)  # an explicit count wins


def test_with_amx_tiles_a_smaller_model_already_streams(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_layout, "cpu_has_amx", lambda: True)
    smollm2 = _sparse(tmp_path / "smollm2" / "model.safetensors", 269 << 20)
    standard = _sparse(tmp_path / "standard" / "model.safetensors", 110 << 20)
    assert _layout(smollm2.parent)[:2] == (1, 2)
    assert _layout(standard.parent)[:2] == (2, 1)
    assert cpu_layout_for_model(2, str(smollm2.parent), amx=False) is None


def test_amx_is_read_from_the_cpu_flags():
    from pathlib import Path

    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    assert REAL_CPU_HAS_AMX() == ("amx_bf16" in flags.split(":", 1)[-1].split())
