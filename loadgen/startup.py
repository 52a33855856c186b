"""Where a worker's start-up goes: fresh processes that start the engine the way a worker does.

Owns the start-up profiling command::

    python -m mqinfer.loadgen.startup --model M [--quantization w8a8] [--kv-cache-dtype int8] [--runs 3]

Each run is a new Python process (``--child``) that imports torch and the worker's modules,
builds the engine from the worker's engine settings, and reports, from the process's own start
(as a worker's ``startup`` cost row counts it): the interpreter and torch import, the rest of the
worker's imports, and the engine's own parts (``LLMEngine.startup_seconds``: the model read or
prepared, the runner and its KV cache, quantizing, keeping the prepared model). The first run uses
an empty folder for prepared models, so it pays what the first start on a machine pays; the
later runs find what it kept (workers/engine/prepared.py), as every later worker on the machine does.
Worker-side Redis and Parquet set-up are not included (milliseconds on a local server).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _child(args: argparse.Namespace) -> int:
    from mqinfer.workers.queue.costs import process_start_time

    began = process_start_time() or time.time()
    from mqinfer.procs import short_openmp_spin

    short_openmp_spin()
    t0 = time.time()
    import torch  # noqa: F401

    t1 = time.time()
    import mqinfer.workers.queue.worker  # noqa: F401  (what a worker imports)
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    t2 = time.time()
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype, num_threads=args.num_threads))
    t3 = time.time()
    figures = {"interpreter": t0 - began, "import torch": t1 - t0, "other imports": t2 - t1,
               **{f"engine: {k}": v for k, v in engine.startup_seconds.items()},
               "total": t3 - began, "engine": t3 - t2}
    print(json.dumps(figures))
    return 0


def run_once(args: argparse.Namespace, cache: str) -> dict[str, float]:
    """One child process's figures, with prepared models kept in ``cache``."""
    argv = [sys.executable, "-m", "mqinfer.loadgen.startup", "--child", "--model", args.model, "--dtype", args.dtype,
            "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
            "--num-threads", str(args.num_threads)]
    env = {**os.environ, "MQINFER_PREPARED_CACHE_DIR": cache}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"start-up run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_runs(runs: list[dict[str, float]]) -> str:
    parts = list(dict.fromkeys(k for r in runs for k in r if k not in ("total", "engine")))
    head = f"{'seconds':<34}" + "".join(f"{'run ' + str(i + 1) + (' (first)' if i == 0 else ''):>16}"
                                          for i in range(len(runs)))
    lines = [head, "-" * len(head)]
    for part in [*parts, "engine", "total"]:
        lines.append(f"{part:<34}" + "".join(f"{r.get(part, 0.0):>16.2f}" for r in runs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.startup",
                                     description="Time a worker's start-up by its parts, first run and later runs.")
    parser.add_argument("--model", required=True, help="Checkpoint folder, .gguf file or tiny.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=("none", "w8a8", "w8a16"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"))
    parser.add_argument("--num-threads", type=int, default=1, help="Model threads (default: 1, a worker per core).")
    parser.add_argument("--runs", type=int, default=3, help="Processes, the first with nothing kept (default: 3).")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", default=None, metavar="FILE", help="Also write the figures here.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mqinfer-startup-") as cache:
        for i in range(args.runs):
            runs.append(run_once(args, cache))
            print(f"[startup] run {i + 1}: {runs[-1]['total']:.2f}s", file=sys.stderr, flush=True)
    print(f"start-up of one worker's engine: {args.model}, --quantization {args.quantization} --kv-cache-dtype "
          f"{args.kv_cache_dtype}, {args.num_threads} thread(s); load average {os.getloadavg()[0]:.2f}")
    print(format_runs(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "quantization": args.quantization, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
