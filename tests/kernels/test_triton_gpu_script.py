"""`python -m mqinfer.loadgen.gpu.kernels`: its checks run (interpreted) on the CPU, it bows out
without a GPU, and its ahead-of-time mode compiles every kernel for Hopper without spills."""

from __future__ import annotations

import os

# Before triton is imported anywhere in this process: @triton.jit picks the interpreter at
# decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from mqinfer.kernels import triton_attention, triton_attention_kernels, triton_store  # noqa: E402
from mqinfer.loadgen.gpu import kernels as gpu_kernels  # noqa: E402

if type(triton_attention_kernels.paged_attention_kernel).__name__ != "InterpretedFunction":
    # Decorated before TRITON_INTERPRET was set: decorate again under the interpreter (the
    # script looks the module up at call time, so it gets these).
    importlib.reload(triton_store)
    importlib.reload(triton_attention_kernels)
    importlib.reload(triton_attention)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert gpu_kernels.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_check_case_passes_on_the_small_mixed_step_and_reports_errors():
    result = gpu_kernels.check_case(gpu_kernels.REFERENCE_CASE, torch.float32, "cpu")
    assert result["store_exact"] is True
    assert result["ok"] is True
    assert result["tol"] == gpu_kernels.FLOAT32_REF_TOL
    assert 0 <= result["ref_err"] <= 2e-6 and 0 <= result["err"] <= 2e-6


def test_time_case_measures_both_paths():
    case = gpu_kernels.Case("tiny decode", (1, 1), (20, 33), 4, 2, 64, 16)
    row = gpu_kernels.time_case(case, torch.float32, "cpu", reps=1)
    for key in ("attn_torch_ms", "attn_triton_ms", "store_torch_ms", "store_triton_ms"):
        assert row[key] > 0


def test_make_inputs_hands_out_fused_qkv_views_and_disjoint_tables():
    case = gpu_kernels.Case("c", (3, 1), (19, 40), 8, 2, 64, 16)
    x = gpu_kernels.make_inputs(case, torch.float32, "cpu")
    assert x["q"].shape == (4, 8, 64) and x["k"].shape == (4, 2, 64)
    assert x["q"].stride(0) == (8 + 2 * 2) * 64  # a view of one QKV tensor, not a copy
    blocks = [b for t in x["tables"] for b in t]
    assert len(blocks) == len(set(blocks)) == 2 + 3


def test_compile_only_builds_every_variant_for_hopper_without_spills():
    pytest.importorskip("triton.backends.nvidia", reason="triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "mqinfer.loadgen.gpu.kernels", "--compile-only", "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "variants compiled for sm_90 without register spills" in proc.stdout
    for kernel in ("store", "decode", "decode split", "merge", "prefill"):
        assert f" {kernel} " in proc.stdout


def test_checks_and_timings_print_both_tables_and_pass(capsys, tmp_path):
    # The GPU run's driver, on the CPU in float32 with one tiny case.
    case = gpu_kernels.Case("tiny mixed", (3, 1), (19, 40), 4, 2, 64, 16)
    out_json = tmp_path / "figures.json"
    assert gpu_kernels.run_checks_and_timings("cpu", (case,), (torch.float32,), reps=1, json_path=str(out_json)) == 0
    printed = capsys.readouterr().out
    assert "tiny mixed" in printed and "mixed small vs float64" in printed
    assert printed.count(" ok") == 2 and "FAIL" not in printed
    assert "attn triton" in printed and "speedup" in printed
    import json

    figures = json.loads(out_json.read_text())
    assert [c["case"] for c in figures["checks"]] == ["mixed small vs float64", "tiny mixed"]
    assert figures["timings"][0]["attn_triton_ms"] > 0
