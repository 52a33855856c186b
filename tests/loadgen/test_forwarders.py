"""The command lines of before the plan and the GPU tools became subpackages still run them:
``python -m mqinfer.loadgen.plan_check`` and ``gpu_check``, ``gpu_bench``, ``gpu_kernels``,
``gpu_tensor_parallel`` forward to the subpackages' commands, and ``loadgen/gpu_session.sh`` to
``loadgen/gpu/session.sh``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORWARDED = {"plan_check": "plan.check", "gpu_check": "gpu.check", "gpu_bench": "gpu.bench",
             "gpu_kernels": "gpu.kernels", "gpu_tensor_parallel": "gpu.tensor_parallel"}


@pytest.mark.parametrize("old, new", sorted(FORWARDED.items()))
def test_an_old_module_runs_the_new_command(old, new):
    forwarder = importlib.import_module(f"mqinfer.loadgen.{old}")
    assert forwarder.main is importlib.import_module(f"mqinfer.loadgen.{new}").main


def test_an_old_command_line_still_runs():
    proc = subprocess.run([sys.executable, "-m", "mqinfer.loadgen.gpu_check", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m mqinfer.loadgen.gpu.check")


def test_the_old_session_script_forwards_to_the_new_one():
    script = (ROOT / "loadgen" / "gpu_session.sh").read_text()
    assert 'exec bash "$(dirname "$0")/gpu/session.sh" "$@"' in script
    assert (ROOT / "loadgen" / "gpu" / "session.sh").is_file()
