"""KV tiers benchmark: a shared-prefix bulk job whose prefixes are several times the device KV cache,
run with ``mqinfer run`` three times side by side, and the tiers' stored bytes against bfloat16.

1. ``device``: tiers off (the device prefix cache only), a fresh output folder;
2. ``tiers``: ``--kv-host-cache-gib`` and ``--kv-disk-cache`` on, a fresh, empty disk tier;
3. ``restart``: ``run --fresh`` of the same job on the same output folder and the same disk tier, with
   new worker processes (the host tier starts empty): what a re-run of a job finds.

The job: ``--prefixes`` prompt prefixes of ``--prefix-tokens`` token ids, together ``--cache-multiple``
times the device cache (``--num-kv-blocks`` is sized from that), each followed by a short tail of its
own, requests cycling over the prefixes in input order (``--order input``), so that a prefix comes
back after the device cache has evicted it. Figures come from the jobs' rows: throughput is requests
per second from the first request started to the last finished (worker start-up excluded); time to
first token is ``first_token_at - enqueued_at`` (all requests are enqueued at the start of a bulk
job, so this includes the queue) and ``first_token_at - started_at`` (the prefill alone); the prefix
tokens served from each tier are the cost rows' ``*_cached_tokens``.

``--storage-model M`` also measures what the disk tier stores for a real model's KV: the README's
text through M with a disk tier, the bytes of the block files against the same blocks in bfloat16.

    python -m mqinfer.loadgen.kv_tiers_bench [--requests N] [--storage-model M] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 16


def workload(prefixes: int, prefix_tokens: int, requests: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 256) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    return [{"id": f"r{i}", "prompt_token_ids": heads[i % prefixes] + [rng.randrange(3, 256) for _ in range(8)],
             "max_tokens": 4, "temperature": 0, "ignore_eos": True} for i in range(requests)]


def run_job(input_path: Path, out: Path, flags: list[str], fresh: bool) -> float:
    """``mqinfer run`` once; its wall seconds."""
    cmd = [sys.executable, "-m", "mqinfer", "run", str(input_path), "--out", str(out), "--workers", "1",
           "--order", "input", *flags, *(["--fresh"] if fresh else [])]
    env = dict(os.environ, MQINFER_LOG_LEVEL="warning")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def job_figures(out: Path, prefix_tokens: int) -> dict:
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    results = ds.dataset(out / "results", format="parquet", partitioning="hive").to_table()
    errors = results.filter(pc.field("finish_reason") == "error")
    if errors.num_rows:
        raise RuntimeError(f"{errors.num_rows} requests ended in errors, first: {errors['error'][0]} (a device "
                           "cache too small for one prompt? raise --cache-multiple's share or lower --prefix-tokens)")
    costs = ds.dataset(out / "costs", format="parquet", partitioning="hive").to_table(
        filter=pc.field("kind") == "request")
    # The last run's rows only: --fresh removed the earlier ones.
    started = [t.timestamp() for t in results["started_at"].to_pylist()]
    finished = [t.timestamp() for t in results["finished_at"].to_pylist()]
    first = [t.timestamp() for t in results["first_token_at"].to_pylist()]
    enqueued = [t.timestamp() for t in results["enqueued_at"].to_pylist()]
    n = results.num_rows
    window = max(finished) - min(started)
    cached = sum(costs["cached_prompt_tokens"].to_pylist())
    tiers = {t: sum(v or 0 for v in costs[f"{t}_cached_tokens"].to_pylist()) for t in ("host", "disk", "shared")}
    prefix_total = n * prefix_tokens
    return {
        "requests": n, "window_s": window, "requests_per_s": n / window,
        "ttft_p50_s": statistics.median(f - e for f, e in zip(first, enqueued)),
        "prefill_ttft_p50_s": statistics.median(f - s for f, s in zip(first, started)),
        "cached_tokens": cached, "tier_tokens": tiers, "prefix_tokens": prefix_total,
        "from_tiers_share": sum(tiers.values()) / prefix_total,
        "not_recomputed_share": min(1.0, cached / prefix_total),
        "outputs": dict(zip(results["id"].to_pylist(), results["output_token_ids"].to_pylist())),
    }


def disk_ratio(folder: Path, bf16_block_bytes: int) -> dict:
    sizes = [p.stat().st_size for p in folder.iterdir() if p.name.endswith(".kv")]
    return {"blocks": len(sizes), "bytes": sum(sizes),
            "ratio_to_bf16": sum(sizes) / (len(sizes) * bf16_block_bytes) if sizes else None}


def storage_on_model(model: str, folder: Path, tokens: int = 1024) -> dict:
    """Run the README's text through ``model`` with a disk tier; the block files against bfloat16, and
    the same blocks in the other forms considered (raw 8-bit, lz4, zstd in one frame, zstd with the
    scales' bytes split)."""
    import zlib

    import numpy as np
    import torch

    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, kv_cache_dtype="int8", num_kv_blocks=tokens // BLOCK + 8,
                                 max_model_len=tokens + 64, kv_disk_cache=str(folder)))
    try:
        text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
        ids = eng.tokenizer.encode(text)[:tokens] if eng.tokenizer is not None else list(text.encode())[:tokens]
        eng.add_request("storage", ids, SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
        info = eng.info
        caches = eng.runner.kv_caches
        blocks = []
        for b in range(len(ids) // BLOCK):  # blocks 0.. hold the prompt in order on a fresh engine
            values = torch.stack([t[b] for c in caches for t in (c.k, c.v)]).view(torch.uint8).numpy()
            scales = torch.stack([s[b] for c in caches for s in (c.k_scale, c.v_scale)]).view(torch.int16).numpy()
            blocks.append((values, scales))
    finally:
        eng.close()
    bf16 = 2 * info.num_layers * BLOCK * info.num_kv_heads * info.head_dim * 2
    forms: dict[str, float] = {}
    raw = [v.tobytes() + s.tobytes() for v, s in blocks]
    forms["raw 8-bit"] = sum(map(len, raw))
    try:
        import lz4.frame
        forms["lz4"] = sum(len(lz4.frame.compress(r)) for r in raw)
    except ImportError:
        pass
    try:
        import zstandard
        z = zstandard.ZstdCompressor(level=3).compress
    except ImportError:
        z = lambda data: zlib.compress(data, 6)  # noqa: E731 - the codec's own fallback
    forms["zstd, one frame"] = sum(len(z(r)) for r in raw)
    split = [(s.view(np.uint16) >> 8).astype(np.uint8).tobytes() + (s.view(np.uint16) & 255).astype(np.uint8).tobytes()
             for _, s in blocks]
    forms["zstd, scale bytes split"] = sum(len(z(v.tobytes())) + len(z(sp)) for (v, _), sp in zip(blocks, split))
    n = len(blocks) * bf16
    return {"model": info.model_id, **disk_ratio(folder, bf16),
            "forms": {name: size / n for name, size in forms.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--cache-multiple", type=float, default=4.0,
                        help="The prefixes together over the device cache.")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--storage-model", default=None, help="Also measure the stored bytes on this model.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    blocks = int(args.prefixes * args.prefix_tokens / args.cache_multiple) // BLOCK
    common = ["--model", args.model, "--kv-cache-dtype", "int8", "--num-kv-blocks", str(blocks),
              "--max-num-seqs", "4", "--max-model-len", str(args.prefix_tokens + 64)]
    report: dict = {"num_kv_blocks": blocks, "device_cache_tokens": blocks * BLOCK,
                    "prefix_tokens_total": args.prefixes * args.prefix_tokens}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as tmp:
        tmp = Path(tmp)
        input_path = tmp / "job.jsonl"
        input_path.write_text("".join(json.dumps(r) + "\n" for r in workload(args.prefixes, args.prefix_tokens,
                                                                              args.requests)))
        tier_flags = ["--kv-host-cache-gib", "0.5", "--kv-disk-cache", str(tmp / "kv")]
        # A one-request job first: whatever a first start pays once (building the native kernels
        # after their sources changed, cold files) is paid outside the measured runs.
        warm = tmp / "warm.jsonl"
        warm.write_text(input_path.read_text().splitlines()[0] + "\n")
        run_job(warm, tmp / "warm", common, False)
        runs = {}
        for name, out, flags, fresh in (("device", tmp / "device", common, False),
                                        ("tiers", tmp / "tiers", common + tier_flags, False),
                                        ("restart", tmp / "tiers", common + tier_flags, True)):
            wall = run_job(input_path, out, flags, fresh)
            runs[name] = {"wall_s": wall, **job_figures(out, args.prefix_tokens)}
        outputs = {name: r.pop("outputs") for name, r in runs.items()}
        report["runs"] = runs
        report["same_outputs"] = outputs["device"] == outputs["tiers"] == outputs["restart"]
        report["throughput_tiers_over_device"] = runs["tiers"]["requests_per_s"] / runs["device"]["requests_per_s"]
        report["ttft_p50_device_over_restart"] = runs["device"]["ttft_p50_s"] / runs["restart"]["ttft_p50_s"]
        report["prefill_ttft_p50_device_over_restart"] = (runs["device"]["prefill_ttft_p50_s"]
                                                          / runs["restart"]["prefill_ttft_p50_s"])
        report["disk_tier"] = disk_ratio(tmp / "kv", 2 * 4 * BLOCK * 2 * 64 * 2) if args.model == "tiny" else None
        if args.storage_model:
            report["storage"] = storage_on_model(args.storage_model, tmp / "storage")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def print_report(report: dict) -> None:
    print(f"device cache {report['num_kv_blocks']} blocks ({report['device_cache_tokens']} tokens); "
          f"prefixes {report['prefix_tokens_total']} tokens")
    print(f"{'run':8} {'req/s':>7} {'window s':>9} {'TTFT p50':>9} {'prefill TTFT':>13} {'from tiers':>11} "
          f"{'not recomputed':>15}  tier tokens")
    for name, r in report["runs"].items():
        print(f"{name:8} {r['requests_per_s']:7.2f} {r['window_s']:9.2f} {r['ttft_p50_s']:9.3f} "
              f"{r['prefill_ttft_p50_s']:13.4f} {r['from_tiers_share']:11.1%} {r['not_recomputed_share']:15.1%}  "
              f"{r['tier_tokens']}")
    print(f"throughput tiers / device: {report['throughput_tiers_over_device']:.2f}x; TTFT p50 device / restart: "
          f"{report['ttft_p50_device_over_restart']:.2f}x (prefill alone {report['prefill_ttft_p50_device_over_restart']:.2f}x); "
          f"same outputs: {report['same_outputs']}")
    if report.get("disk_tier"):
        d = report["disk_tier"]
        print(f"disk tier: {d['blocks']} blocks, {d['bytes']} bytes, {d['ratio_to_bf16']:.3f} of bfloat16")
    if report.get("storage"):
        s = report["storage"]
        print(f"stored on {s['model']}: {s['blocks']} blocks, {s['ratio_to_bf16']:.3f} of bfloat16 (other forms: "
              + ", ".join(f"{name} {ratio:.3f}" for name, ratio in s["forms"].items()) + ")")


if __name__ == "__main__":
    sys.exit(main())
