"""The tensor-parallel measurement script: without two GPUs it says so and exits 0; on CPU it runs
its three layouts and checks that they agree."""

from __future__ import annotations

import json

import pytest

from mqinfer.loadgen.gpu import tensor_parallel as gpu_tensor_parallel


def test_without_two_gpus_it_says_so(capsys, monkeypatch):
    from mqinfer.workers import devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    assert gpu_tensor_parallel.main([]) == 0
    assert "needs 2 CUDA devices; this machine has 1" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_layouts_agree_token_for_token(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert gpu_tensor_parallel.main(["--device", "cpu", "--model", "tiny", "--batch", "3", "--prompt-len", "8",
                                     "--new-tokens", "4", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [(r["tensor_parallel_size"], r["threads_per_rank"]) for r in figures["results"]] == [(1, 1), (1, 2), (2, 1)]
    assert [r["requests_agreeing_with_first"] for r in figures["results"][1:]] == [3, 3]
    kv = [r["kv_cache_bytes_per_rank"] for r in figures["results"]]
    assert kv[2] * 2 == kv[0]  # tiny's two KV heads: one per rank
