"""The phases' shared parts of ``gpu_bench`` (``python -m mqinfer.loadgen.gpu.bench``, whose
docstring says what it measures): the time budget, the JSON report written after each phase, the
goals checked in the summary, the run's header, gpu_check as a subprocess, and a phase run under the
budget. ``gpu_bench`` (the command) and ``gpu_bench_run`` (the phases) both import them from here.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

SKIPPED = "skipped: time budget spent"
# The goals set for a GPU worker, checked in the summary.
GOAL_VS_STATIC = 5.0
GOAL_DECODE_B1_SHARE = 0.5
GOAL_OVER_ROOF = 1.5


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Budget:
    """Seconds left of the run's time budget."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def spent(self) -> bool:
        return self.left() <= 0


class Report:
    """Every figure of the run, written to ``--json`` after each phase."""

    def __init__(self, path: str | None, header: dict[str, Any]) -> None:
        self.path = path
        self.body: dict[str, Any] = {**header, "gpu_check": None, "bandwidth": None, "models": {},
                                     "finished": False}
        self.save()

    def save(self) -> None:
        from mqinfer.loadgen.bench_report import save_json

        save_json(self.path, self.body)

    def phase(self, model: str, name: str, value: Any) -> None:
        self.body["models"].setdefault(model, {})[name] = value
        self.save()


def header(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """The report's fixed part: when, on what, with which settings."""
    import platform

    from mqinfer.loadgen.gpu.check import environment

    env = environment(args.device)
    return {"date_utc": env["date_utc"], "environment": env,
            "python": platform.python_version(), "dtype": dtype,
            "settings": dict(vars(args))}


def run_gpu_check(args: argparse.Namespace, budget: Budget, workdir: Path) -> dict[str, Any]:
    """``gpu_check`` in its own process (its output passed through), at most
    ``--gpu-check-timeout-s`` or what is left of the budget: its exit code and rows."""
    timeout = max(1.0, min(args.gpu_check_timeout_s, budget.left()))
    out = workdir / "gpu_check.json"
    argv = [sys.executable, "-m", "mqinfer.loadgen.gpu.check", "--json", str(out), "--workdir",
            str(workdir / "gpu-check")]
    log(f"gpu_check (at most {timeout:.0f}s): {' '.join(argv[1:])}")
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Its lines are passed on as they come (through sys.stdout, whatever that is now).
    pump = threading.Thread(target=_pass_through, args=(proc.stdout,), daemon=True)
    pump.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
        status = "ok" if code == 0 else "FAIL"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code, status = None, f"timed out after {timeout:.0f}s"
    pump.join(timeout=5)
    result: dict[str, Any] = {"status": status, "exit_code": code, "seconds": time.monotonic() - began}
    try:
        result["rows"] = json.loads(out.read_text()).get("rows")
    except (OSError, ValueError):
        result["rows"] = None
    return result


def _pass_through(stream) -> None:
    for line in stream:
        print(line, end="", flush=True)


def timed_phase(report: Report, model: str, name: str, budget: Budget, fn: Callable[[], Any],
                errors: list[str]) -> Any:
    """Run one phase unless the budget is spent; its figures (or why there are none) go into the report."""
    if budget.spent():
        report.phase(model, name, {"status": SKIPPED})
        log(f"{model}: {name} {SKIPPED}")
        return None
    began = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # one failed phase is recorded, and the others still run
        report.phase(model, name, {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                                   "seconds": time.monotonic() - began})
        errors.append(f"{model} {name}: {type(exc).__name__}: {exc}")
        log(f"{model}: {name} failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        gc.collect()
        _empty_device_cache()
    entry = value if isinstance(value, dict) else {"value": value}
    report.phase(model, name, {"status": "ok", "seconds": time.monotonic() - began, **entry})
    return value


def _empty_device_cache() -> None:
    """Give back the memory one in-process phase cached on the GPU, before the next (a worker
    process sizes its KV cache from the memory it finds free)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def default_workdir() -> Path:
    from mqinfer.loadgen.checkpoint import default_cache_dir

    return default_cache_dir() / "gpu-bench"
