"""The quantizing KV store divides as PyTorch does on a GPU too: compiled for Hopper (sm_90), its
code has IEEE divisions (div.rn.f32) and no approximate ones (div.full.f32, what Triton's `/`
on float32 compiles to). The interpreter divides exactly, so only compiled code shows this; on an
H200 the approximate division made the fp8 store write other bytes than the PyTorch store."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Not imported here: triton imported before TRITON_INTERPRET is set would break the interpreted
# kernels of the test modules that share this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: nothing to compile")

# Run in a fresh interpreter without TRITON_INTERPRET: kernels decorated under the interpreter
# (other test modules set it) cannot be compiled.
COMPILE = """
import json, re, torch
from mqinfer.kernels import triton_store
from mqinfer.kernels.kv_quant import quantize_kv
from mqinfer.loadgen.gpu import kernels as gpu_kernels

case = gpu_kernels.Case("decode", (1, 1), (40, 70), 32, 8, 128, 16)
counts = {}
for dtype in (torch.int8, torch.float8_e4m3fn):
    x = gpu_kernels.make_inputs(case, torch.float32, "cpu")
    k8, k_scale = quantize_kv(x["k_cache"], dtype)
    v8, v_scale = quantize_kv(x["v_cache"], dtype)
    launch = triton_store.plan_store_kv(x["k"], x["v"], k8, v8, x["metadata"].slot_mapping, k_scale, v_scale)
    ptx = gpu_kernels.compile_launch(launch, 90).asm["ptx"]
    counts[str(dtype)] = {"rn": len(re.findall(r"div\\.rn\\.f32", ptx)), "approx": len(re.findall(r"div\\.(full|approx)\\.f32", ptx))}
print(json.dumps(counts))
"""


def test_the_quantizing_store_compiles_to_ieee_divisions():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(counts) == {"torch.int8", "torch.float8_e4m3fn"}
    for dtype, found in counts.items():
        assert found["approx"] == 0 and found["rn"] > 0, (dtype, found)
