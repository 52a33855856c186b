"""vLLM's CPU build as a peer of `mqinfer bench` (``--compare vllm``).

vLLM lives in an environment of its own (``--vllm-python``: that environment's interpreter; see
docs/benchmarking.md for how to make it), and runs the same requests as mqinfer through
:mod:`mqinfer.loadgen.vllm_runner`: the checkpoint folder mqinfer loads, the workload's prompt token
ids, greedy, every request generating exactly its ``max_tokens``, bf16 (or the bench's dtype).

Each side runs at its best on the machine: vLLM gets every core for compute and none reserved for
its front end (``VLLM_CPU_OMP_THREADS_BIND`` = the cores this process may use,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; its defaults keep one core of two for the front end), and runs
once with its small-batch CPU kernels off and once on (``VLLM_CPU_SGL_KERNEL``); the faster run is
the figure. Reported per run: start-up (``LLM(...)``, which compiles on a CPU), the timed
``generate`` and its output tokens per second, and the whole process; the table row is the best
run's ``generate``, against which mqinfer's offline span compares, like transformers' rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_options import VLLM
from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.metrics import RunSummary

RUNNER = Path(__file__).with_name("vllm_runner.py")
# The runs: vLLM's small-batch CPU kernels off, then on.
SETTINGS = ({"VLLM_CPU_SGL_KERNEL": "0"}, {"VLLM_CPU_SGL_KERNEL": "1"})
# KV cache space for vLLM, GiB (its CPU backend reserves it up front; 4 is its own default).
KV_CACHE_GIB = 4


def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's vLLM flags (None: nothing)."""
    if VLLM not in (args.compare or []):
        return "--vllm-python applies to --compare vllm only" if args.vllm_python else None
    if not args.vllm_python:
        return ("--compare vllm needs --vllm-python PATH: the python of an environment with vLLM's CPU build "
                "(docs/benchmarking.md says how to make one)")
    if not Path(args.vllm_python).is_file():
        return f"--vllm-python {args.vllm_python}: no such file"
    if args.mode != "offline":
        return "--compare vllm compares offline throughput; leave out --mode online"
    return None


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_list(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5`` (the form vLLM's thread binding takes)."""
    parts, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)


def environment(setting: dict[str, str], python: str) -> dict[str, str]:
    """vLLM's environment: this one with the cores bound, and vLLM's ``python``'s environment
    first on PATH in place of an activated one (vLLM starts helper processes by name: under
    mqinfer's activated venv they would get an interpreter without vLLM)."""
    env = dict(os.environ)
    bin_dir = str(Path(python).absolute().parent)
    active = env.pop("VIRTUAL_ENV", None)
    skip = {str(Path(active) / "bin")} if active else set()
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p not in skip])
    if (Path(bin_dir).parent / "pyvenv.cfg").is_file():
        env["VIRTUAL_ENV"] = str(Path(bin_dir).parent)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores()), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_TARGET_DEVICE": "cpu", **setting})
    for name in ("OMP_NUM_THREADS", "MQINFER_NUM_THREADS"):  # vLLM sets its own threads from the binding
        env.pop(name, None)
    return env


def run_once(python: str, folder: Path, requests: list[dict], dtype: str, max_num_seqs: int,
             setting: dict[str, str], scratch: Path, timeout_s: float) -> dict[str, Any]:
    """One vLLM process over ``requests``: the runner's result plus the process's wall time."""
    scratch.mkdir(parents=True, exist_ok=True)
    tag = "-".join(f"{k.lower()}={v}" for k, v in setting.items())
    spec_path, out_path = scratch / f"vllm-{tag}-in.json", scratch / f"vllm-{tag}-out.json"
    max_model_len = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    spec = {"model": str(folder), "dtype": dtype, "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len, "engine_args": {"skip_tokenizer_init": True},
            "requests": [{"prompt_token_ids": r["prompt_token_ids"], "max_tokens": r["max_tokens"]}
                         for r in requests]}
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    t0 = time.time()
    done = subprocess.run([python, str(RUNNER), str(spec_path), str(out_path)], env=environment(setting, python),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    wall_s = time.time() - t0
    if done.returncode != 0 or not out_path.is_file():
        tail = (done.stderr or done.stdout)[-2000:]
        return {"setting": setting, "error": f"exit status {done.returncode}: {tail}", "wall_s": wall_s}
    result = json.loads(out_path.read_text())
    generated = sum(result["output_tokens"])
    return {"setting": setting, **result, "output_tokens": generated, "wall_s": wall_s,
            "output_tok_s": generated / result["generate_s"] if result["generate_s"] > 0 else 0.0,
            "max_num_seqs": max_num_seqs, "max_model_len": max_model_len}


def summary(run: dict[str, Any], requests: list[dict]) -> RunSummary:
    """The table row of a run: its timed ``generate`` as the span, its output tokens."""
    return RunSummary(num_requests=len(requests), num_errors=0, requested_tokens=run["output_tokens"],
                      span_s=run["generate_s"], throughput=run["output_tok_s"], ttft=None, tpot=None, e2e=None)


def compare(args: argparse.Namespace, folder: Path, requests: list[dict], max_num_seqs: int,
            scratch: Path) -> tuple[dict[str, Any], RunSummary | None]:
    """vLLM once per setting; the report part and the best run's table row (None when none ran)."""
    runs = []
    for setting in SETTINGS:
        log(f"vLLM CPU: {len(requests)} requests, {' '.join(f'{k}={v}' for k, v in setting.items())} "
            f"(start-up compiles for a minute or so)")
        run = run_once(args.vllm_python, folder, requests, args.dtype, max_num_seqs, setting, scratch / "vllm",
                       args.timeout_s)
        if "error" in run:
            log(f"vLLM failed: {run['error'][-500:]}")
        else:
            log(f"vLLM {setting}: {run['output_tok_s']:.1f} output tok/s over {run['generate_s']:.2f}s "
                f"(start-up {run['init_s']:.1f}s, process {run['wall_s']:.1f}s)")
        runs.append(run)
    ok = [r for r in runs if "error" not in r]
    best = max(ok, key=lambda r: r["output_tok_s"]) if ok else None
    report = {"python": args.vllm_python, "folder": str(folder), "runs": runs,
              "best": best["setting"] if best else None, "cores": cpu_list(cores())}
    return report, (summary(best, requests) if best else None)
