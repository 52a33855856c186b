"""Pipeline parallelism measured on CPU: step times of P = 2 stages against one rank.

``python -m mqinfer.loadgen.bench_pipeline`` runs the same batches through one worker engine in
three layouts, in alternating rounds (the layouts see the same machine load): one rank with one
thread; two stages of one thread each with the stages run one after the other (one micro-batch
per step, ``MQINFER_PIPELINE_MICRO_BATCHES=1``); and two stages with the default micro-batches
(two per step, the stages working at once). It prints the median prefill and decode step times of
each, their ratios to one rank, and whether every request's greedy tokens agree with one rank's
(float32: they must).

Two stages use two cores where one rank uses one: the pipeline does not make one step of a small
model faster (its point is a model that does not fit one device); with micro-batches a step costs
about ``(M + P - 1) / M`` of one stage's work, plus the transfers, rather than all P stages' work
one after the other. The model is the benchmark checkpoint (``loadgen/checkpoint.py``: hidden
512, 8 layers, vocabulary 32000). ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

LAYOUTS = {
    "P=1": {"pp": 1, "micro_batches": None},
    "P=2, 1 micro-batch": {"pp": 2, "micro_batches": "1"},
    "P=2, 2 micro-batches": {"pp": 2, "micro_batches": None},
}


def run_layout(model: str, *, pp: int, micro_batches: str | None, batch: int, prompt_len: int,
               new_tokens: int, waves: int = 1) -> dict:
    """One engine, ``waves`` batches one after the other: each step's seconds by kind, and every
    request's greedy tokens."""
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine
    from mqinfer.workers.engine.pipeline import MICRO_BATCHES_ENV

    if micro_batches is None:
        os.environ.pop(MICRO_BATCHES_ENV, None)
    else:
        os.environ[MICRO_BATCHES_ENV] = micro_batches
    max_len = prompt_len + new_tokens + 16
    config = EngineConfig(model=model, device="cpu", num_threads=1, pipeline_parallel_size=pp, dtype="float32",
                          max_model_len=max_len, num_kv_blocks=(batch + 1) * -(-max_len // 16) + 8,
                          max_num_seqs=batch, max_num_batched_tokens=max(2048, batch))
    engine = LLMEngine(config)
    try:
        rng = random.Random(0)
        vocab = engine.info.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch * waves + 1)]
        # A warm-up request: first-call costs (buffers, packed weights, the group's first transfers).
        engine.add_request("warm", prompts[-1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        prefill, decode, tokens = [], [], {}
        for wave in range(waves):
            for i in range(wave * batch, (wave + 1) * batch):
                engine.add_request(f"r{i}", prompts[i], greedy)
            while engine.has_unfinished():
                t0 = time.perf_counter()
                result = engine.step()
                (prefill if any(w.is_prefill for w in result.work) else decode).append(time.perf_counter() - t0)
                for out in result.outputs:
                    if out.finished:
                        tokens[out.request_id] = list(out.output_token_ids)
    finally:
        engine.close()
        os.environ.pop(MICRO_BATCHES_ENV, None)
    return {"prefill": prefill, "decode": decode, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.bench_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the benchmark checkpoint)")
    parser.add_argument("--batch", type=int, default=16, help="requests at once (default 16)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    parser.add_argument("--waves", type=int, default=2, help="batches per engine, one after the other (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three layouts (default 3)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.new_tokens, args.waves, args.rounds) < 1:
        parser.error("--batch, --prompt-len, --new-tokens, --waves and --rounds must be at least 1")
    model = args.model
    if model is None:
        from mqinfer.loadgen.checkpoint import make_standard_checkpoint

        model = str(make_standard_checkpoint())
    steps = {name: {"prefill": [], "decode": []} for name in LAYOUTS}
    agree = {name: True for name in LAYOUTS}
    for _ in range(args.rounds):
        baseline = None
        for name, layout in LAYOUTS.items():
            run = run_layout(model, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                             waves=args.waves, **layout)
            steps[name]["prefill"] += run["prefill"]
            steps[name]["decode"] += run["decode"]
            baseline = run["tokens"] if baseline is None else baseline
            agree[name] = agree[name] and run["tokens"] == baseline
    figures = {}
    for name in LAYOUTS:
        figures[name] = {kind: round(statistics.median(steps[name][kind]) * 1e3, 2) if steps[name][kind] else None
                         for kind in ("prefill", "decode")}
        figures[name]["same_tokens_as_one_rank"] = agree[name]
    one = figures["P=1"]
    print(f"{args.waves} x {args.batch} requests x {args.prompt_len} prompt tokens + {args.new_tokens} new, float32, "
          f"one thread per rank, {args.rounds} alternating rounds; median step ms (ratio to P=1):")
    for name, row in figures.items():
        cells = [f"{kind} {row[kind]:.1f} ({row[kind] / one[kind]:.2f}x)" for kind in ("prefill", "decode")
                 if row[kind] and one[kind]]
        print(f"  {name:22s} {'  '.join(cells)}  greedy tokens as P=1: {row['same_tokens_as_one_rank']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "batch": args.batch, "waves": args.waves, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "rounds": args.rounds, "layouts": figures}, f, indent=2)
    return 0 if all(agree.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
