"""Tensor parallelism measured: step times of T=2 against T=1, and the check that they agree.

``python -m mqinfer.loadgen.gpu.tensor_parallel`` (GPU, the default): on two CUDA devices, runs the
same batch through one worker engine with ``--tensor-parallel-size 1`` on ``cuda:0`` and with
``2`` on ``cuda:0,1``, and prints prefill and decode step times, decode tokens per second, each
rank's KV cache bytes, and how many requests' greedy tokens agree. Without two CUDA devices it
says so and exits 0 (nothing to measure).

``--device cpu``: the same on CPU with gloo, in three layouts: one rank with one thread, one rank
with ``--threads`` threads, and ``T`` ranks of one thread each (``T = --threads``), so the ranks
use as many cores as the threaded rank.

The model is the benchmark checkpoint (``loadgen/checkpoint.py``: hidden 512, 8 layers, 8 heads,
2 KV heads, vocabulary 32000) unless ``--model`` names a folder; ``--hidden-size`` and
``--layers`` make a bigger random Llama of the same shape otherwise. In float32 (the default)
greedy tokens must agree exactly; in bfloat16 the all-reduces change rounding, so agreement is
reported, not required. ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _checkpoint(args) -> str:
    from mqinfer.loadgen.checkpoint import make_llama_checkpoint, make_standard_checkpoint

    if args.model:
        return args.model
    if args.hidden_size is None and args.layers is None:
        return str(make_standard_checkpoint())
    overrides = {}
    if args.hidden_size is not None:
        overrides.update(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 11 // 4 // 64 * 64,
                         num_attention_heads=max(2, args.hidden_size // 64), num_key_value_heads=2, head_dim=64)
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    folder = Path(tempfile.gettempdir()) / f"mqinfer-tp-llama-{args.hidden_size}-{args.layers}"
    return str(make_llama_checkpoint(folder, seed=0, dtype="bfloat16", **overrides))


def run_layout(model: str, *, device: str, devices: str | None, tp: int, threads: int, dtype: str,
               batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One engine, one batch: step times by kind and the greedy tokens of every request."""
    import random

    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    config = EngineConfig(model=model, device=device, devices=devices, tensor_parallel_size=tp, num_threads=threads,
                          dtype=dtype, max_model_len=prompt_len + new_tokens + 16,
                          num_kv_blocks=batch * (-(-(prompt_len + new_tokens + 16) // 16)) + 8,
                          max_num_seqs=batch, max_num_batched_tokens=max(2048, batch))
    began = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - began
    try:
        rng = random.Random(0)
        vocab = engine.info.vocab_size
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        # One warm-up request (first-call costs: packing, buffers, the process group's first rounds).
        engine.add_request("warm", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        for i in range(batch):
            engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], greedy)
        prefill, decode, tokens = [], [], {}
        while engine.has_unfinished():
            t0 = time.perf_counter()
            result = engine.step()
            if device.startswith("cuda") or engine.device.type == "cuda":
                import torch

                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            (prefill if any(w.is_prefill for w in result.work) else decode).append(seconds)
            for out in result.outputs:
                if out.finished:
                    tokens[out.request_id] = list(out.output_token_ids)
        kv_bytes = engine.runner.kv_cache_bytes
    finally:
        engine.close()
    decode_ms = statistics.median(decode) * 1e3 if decode else None
    return {
        "tensor_parallel_size": tp, "threads_per_rank": threads, "device": device, "devices": devices,
        "startup_s": round(startup_s, 2), "prefill_s": round(sum(prefill), 4),
        "prefill_tokens_per_s": round(batch * prompt_len / sum(prefill), 1) if prefill else None,
        "decode_step_ms_median": round(decode_ms, 3) if decode_ms else None,
        "decode_tokens_per_s": round(batch * 1e3 / decode_ms, 1) if decode_ms else None,
        "kv_cache_bytes_per_rank": kv_bytes, "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.gpu.tensor_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", help="checkpoint folder (default: the benchmark checkpoint)")
    parser.add_argument("--hidden-size", type=int, help="a random Llama this wide instead (64-wide heads, 2 KV heads)")
    parser.add_argument("--layers", type=int, help="layers of that random Llama")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, default=16, help="requests at once")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="--device cpu: cores to use (and ranks of T)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the layouts this many times, interleaved, and report the best and median "
                             "(a shared machine's load swings between runs)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        from mqinfer.workers.devices import cuda_device_count

        count = cuda_device_count()
        if count < 2:
            print(f"tensor parallelism on GPUs needs 2 CUDA devices; this machine has {count}: nothing to measure")
            return 0
        layouts = [dict(device="cuda:0", devices=None, tp=1, threads=1),
                   dict(device="cuda", devices="0,1", tp=2, threads=1)]
    else:
        t = args.threads
        layouts = [dict(device="cpu", devices=None, tp=1, threads=1),
                   dict(device="cpu", devices=None, tp=1, threads=t),
                   dict(device="cpu", devices=None, tp=t, threads=1)]
    model = _checkpoint(args)
    runs: list[list[dict]] = [[] for _ in layouts]
    for _ in range(max(1, args.repeat)):
        for i, layout in enumerate(layouts):
            r = run_layout(model, dtype=args.dtype, batch=args.batch, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens, **layout)
            runs[i].append(r)
            print(f"T={r['tensor_parallel_size']} x {r['threads_per_rank']} thread(s) on "
                  f"{r['devices'] or r['device']}: prefill {r['prefill_s']:.3f}s ({r['prefill_tokens_per_s']} tok/s), "
                  f"decode step {r['decode_step_ms_median']} ms median ({r['decode_tokens_per_s']} tok/s), "
                  f"KV cache {r['kv_cache_bytes_per_rank'] / 2**20:.1f} MiB per rank, startup {r['startup_s']}s",
                  flush=True)
    results = []
    for layout_runs in runs:
        r = dict(layout_runs[0])
        decode = sorted(x["decode_step_ms_median"] for x in layout_runs if x["decode_step_ms_median"])
        prefill = sorted(x["prefill_s"] for x in layout_runs)
        r.update(runs=len(layout_runs), decode_step_ms_best=decode[0] if decode else None,
                 decode_step_ms_median_of_runs=round(statistics.median(decode), 3) if decode else None,
                 prefill_s_best=prefill[0], prefill_s_median_of_runs=round(statistics.median(prefill), 4))
        r["tokens_agree_across_runs"] = all(x["tokens"] == r["tokens"] for x in layout_runs)
        results.append(r)
    if args.repeat > 1:
        for r in results:
            print(f"T={r['tensor_parallel_size']} x {r['threads_per_rank']}: over {r['runs']} runs, decode step best "
                  f"{r['decode_step_ms_best']} ms, median {r['decode_step_ms_median_of_runs']} ms; prefill best "
                  f"{r['prefill_s_best']}s, median {r['prefill_s_median_of_runs']}s")
    base = results[0]["tokens"]
    failed = False
    for r in results[1:]:
        same = sum(r["tokens"].get(k) == v for k, v in base.items())
        r["requests_agreeing_with_first"] = same
        print(f"T={r['tensor_parallel_size']} x {r['threads_per_rank']}: {same} of {len(base)} requests' greedy tokens "
              "equal the first layout's")
        failed |= args.dtype == "float32" and same != len(base)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "dtype": args.dtype, "batch": args.batch,
                                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                               "results": [{k: v for k, v in r.items() if k != "tokens"}
                                                           for r in results],
                                               "runs": [[{k: v for k, v in x.items() if k != "tokens"} for x in rs]
                                                        for rs in runs]}, indent=2) + "\n")
    if failed:
        print("float32 greedy tokens differ between layouts", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
