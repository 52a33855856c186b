"""vLLM's CPU build as the peer of `python -m mqinfer.loadgen.mixed_bench` (``--compare vllm``).

The same three runs as mqinfer's (bulk alone, interactive alone, mixed: the same requests at the
same arrival times) go through :mod:`mqinfer.loadgen.vllm_mixed_runner` in vLLM's own environment
(``--vllm-python``), on the checkpoint folder mqinfer loads, greedy, every request generating
exactly its ``max_tokens``, with ``scheduling_policy="priority"``: the interactive requests at
priority 0, the bulk ones at 1 (vLLM serves the lower value first). vLLM gets every core, as for
`mqinfer bench --compare vllm` (loadgen/vllm_peer.py), with its small-batch CPU kernels off. Its
per-request times become the bench's request timings, and the figures are computed by the same
function as mqinfer's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.metrics import RequestTiming
from mqinfer.loadgen.vllm_peer import environment

RUNNER = Path(__file__).with_name("vllm_mixed_runner.py")
SETTING = {"VLLM_CPU_SGL_KERNEL": "0"}
INTERACTIVE_PRIORITY, BULK_PRIORITY = 0, 1


def runner_spec(folder: Path, dtype: str, max_num_seqs: int, work: dict[str, list[dict[str, Any]]],
                phases: list[tuple[str, list[tuple[str, list[float]]]]]) -> dict[str, Any]:
    """The runner's input: every run's requests with their arrival times and priorities."""
    out = []
    for name, schedules in phases:
        requests = []
        for key, arrivals in schedules:
            priority = INTERACTIVE_PRIORITY if key.endswith("interactive") else BULK_PRIORITY
            requests += [{"id": f"{key}/{r['id']}", "prompt_token_ids": r["prompt_token_ids"],
                          "max_tokens": r["max_tokens"], "arrival_s": at, "priority": priority}
                         for r, at in zip(work[key], arrivals)]
        out.append({"name": name, "requests": requests})
    every = [r for phase in out for r in phase["requests"]]
    return {"model": str(folder), "dtype": "bfloat16" if dtype == "auto" else dtype, "max_num_seqs": max_num_seqs,
            "max_model_len": max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in every),
            "engine_args": {"skip_tokenizer_init": True}, "phases": out}


def timings_of(result: dict[str, Any], work: dict[str, list[dict[str, Any]]]) -> dict[str, list[RequestTiming]]:
    """The runner's per-request times as the bench's timings, per workload key; a request with no
    finish (the runner stopped early) counts as not ok."""
    by_id = {t["id"]: t for phase in result["phases"].values() for t in phase}
    timings: dict[str, list[RequestTiming]] = {}
    for key, requests in work.items():
        rows = []
        for r in requests:
            t = by_id.get(f"{key}/{r['id']}")
            ok = t is not None and t["finished_at"] is not None
            rows.append(RequestTiming(
                id=r["id"], prompt_tokens=len(r["prompt_token_ids"]), requested_tokens=r["max_tokens"],
                output_tokens=t["output_tokens"] if t else 0, enqueued_at=t["enqueued_at"] if t else 0.0,
                started_at=t["enqueued_at"] if t else 0.0, first_token_at=t["first_token_at"] if t else None,
                finished_at=t["finished_at"] if ok else 0.0, ok=ok))
        timings[key] = rows
    return timings


def compare(args: argparse.Namespace, folder: Path, work: dict[str, list[dict[str, Any]]],
            phases: list[tuple[str, list[tuple[str, list[float]]]]],
            summarize: Callable[[dict[str, list[RequestTiming]]], dict[str, Any]]) -> dict[str, Any]:
    """Run vLLM on the bench's runs; its figures (``summarize``'s), or ``error`` when it failed.
    Its input and output files go under ``--out`` when given (kept), else in a temp dir."""
    if args.out:
        scratch = Path(args.out).resolve() / "vllm-mixed"
        scratch.mkdir(parents=True, exist_ok=True)
        return _compare(args, folder, work, phases, summarize, scratch)
    with tempfile.TemporaryDirectory(prefix="mqinfer-vllm-mixed-") as tmp:
        return _compare(args, folder, work, phases, summarize, Path(tmp))


def _compare(args: argparse.Namespace, folder: Path, work: dict[str, list[dict[str, Any]]],
             phases: list[tuple[str, list[tuple[str, list[float]]]]],
             summarize: Callable[[dict[str, list[RequestTiming]]], dict[str, Any]], scratch: Path) -> dict[str, Any]:
    spec_path, out_path = scratch / "in.json", scratch / "out.json"
    max_num_seqs = args.max_num_seqs or 256
    spec_path.write_text(json.dumps(runner_spec(folder, args.dtype, max_num_seqs, work, phases)))
    out_path.unlink(missing_ok=True)
    log("vLLM CPU (priority scheduling): the same three runs (start-up compiles for a minute or so)")
    t0 = time.time()
    try:
        done = subprocess.run([args.vllm_python, str(RUNNER), str(spec_path), str(out_path)],
                              env=environment(SETTING, args.vllm_python), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout_s:g} s", "wall_s": time.time() - t0}
    wall_s = time.time() - t0
    if done.returncode != 0 or not out_path.is_file():
        return {"error": f"exit status {done.returncode}: {(done.stderr or done.stdout)[-2000:]}", "wall_s": wall_s}
    result = json.loads(out_path.read_text())
    figures = summarize(timings_of(result, work))
    log(f"vLLM: start-up {result['init_s']:.1f}s, process {wall_s:.1f}s")
    return {"vllm_version": result["vllm_version"], "init_s": result["init_s"], "wall_s": wall_s,
            "setting": SETTING, "max_num_seqs": max_num_seqs, **figures}
