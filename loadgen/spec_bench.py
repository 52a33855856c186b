"""Speculative decoding on a copy-heavy workload, one request at a time, against no speculation.

The workload: chat requests whose answers repeat spans of their prompts, as extraction,
summaries and code edits do: repeat a paragraph exactly, return a function with one name
changed, list the sentences of a paragraph one per line. The paragraphs and functions are the
documentation and source of Python's standard library (the same in every run), so the prompts
need no data set. It needs a real model with a tokenizer and a chat template (a checkpoint
folder or a ``.gguf`` file); a random model does not copy.

For each request, alone in the engine, it measures the time from submission to the last token
and the tokens produced, with ``--speculative none`` and with the proposer named by
``--speculative`` (``ngram``, the default, ``self`` with ``--draft-layers``, or ``draft`` with
``--draft-model``, which loadgen/draft_checkpoint.py can cut from the model) on the same engine
settings, in one process, taking turns request by request so that both see the same machine
load. It prints the time per output token of each and their ratio, the acceptance rate and
the tokens emitted per checking step, and whether the greedy outputs agree token for token.

``--step-sweep`` instead prints the engine's step time against the step's query tokens (B
decoding requests each checking s proposals), the measurement behind
``--speculative-max-batched-tokens``: speculation is cheap while a step's time stays flat.

    python -m mqinfer.loadgen.spec_bench --model MODEL [--num-requests 12] [--max-tokens 96]
        [--speculative ngram|self|draft] [--draft-layers L] [--draft-model M]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from typing import Any

STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq")


def copy_tasks(n: int) -> list[list[dict[str, str]]]:
    """``n`` chat conversations whose answers copy from their prompts, built from the standard library."""
    import importlib

    paragraphs: list[str] = []
    functions: list[tuple[str, str]] = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module) or ""
        paragraphs += [p for p in doc.split("\n\n") if 200 <= len(p) <= 900]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if inspect.isfunction(obj) and obj.__module__ == name and not attr.startswith("_"):
                source = inspect.getsource(obj)
                if 300 <= len(source) <= 1200:
                    functions.append((attr, source))
    tasks: list[list[dict[str, str]]] = []
    kinds = ("repeat", "rename", "sentences")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "rename" and functions:
            fname, source = functions[(i // len(kinds)) % len(functions)]
            prompt = (f"Rename the function `{fname}` to `{fname}_v2` in the code below. Output the complete "
                      f"code and nothing else.\n\n```python\n{source}```")
        elif kind == "sentences":
            text = paragraphs[(i // len(kinds) + 3) % len(paragraphs)]
            prompt = f"Write each sentence of the following text on its own line, unchanged.\n\n{text}"
        else:
            text = paragraphs[(i // len(kinds)) % len(paragraphs)]
            prompt = f"Repeat the following text exactly, word for word.\n\n{text}"
        tasks.append([{"role": "user", "content": prompt}])
    return tasks


def _engine(args: argparse.Namespace, speculative: str, **overrides: Any):
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    return LLMEngine(EngineConfig(**{
        "model": args.model, "dtype": args.dtype, "num_threads": args.num_threads,
        "num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len, "speculative": speculative,
        "num_speculative_tokens": args.k, "ngram_max": args.ngram_max, "ngram_min": args.ngram_min,
        "draft_layers": args.draft_layers, "draft_model": args.draft_model,
        "speculative_policy": args.speculative_policy, "enable_prefix_caching": False, **overrides,
    }))


def _one(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Run one request alone: (seconds from submission to its end, its tokens, engine steps)."""
    from mqinfer.scheduler.request import SamplingParams

    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    steps, tokens = 0, []
    while engine.has_unfinished():
        steps += 1
        for out in engine.step().outputs:
            if out.finished:
                tokens = list(out.output_token_ids)
    return time.perf_counter() - start, tokens, steps


def run_copy(args: argparse.Namespace) -> dict[str, Any]:
    spec = args.speculative
    engines = {mode: _engine(args, mode) for mode in ("none", spec)}
    tokenizer = engines["none"].tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: the copy workload is text")
    prompts = [engines["none"].encode_prompt(None, None, m) for m in copy_tasks(args.num_requests)]
    # One warm-up request each, not measured.
    for engine in engines.values():
        _one(engine, "warm", prompts[0][:64], 4)
    totals = {mode: {"seconds": 0.0, "tokens": 0, "steps": 0} for mode in engines}
    same = 0
    per_request = []
    for i, prompt in enumerate(prompts):
        outs = {}
        for mode, engine in engines.items():
            seconds, tokens, steps = _one(engine, f"r{i}", prompt, args.max_tokens)
            t = totals[mode]
            t["seconds"] += seconds
            t["tokens"] += len(tokens)
            t["steps"] += steps
            outs[mode] = (seconds, tokens, steps)
        same += outs["none"][1] == outs[spec][1]
        per_request.append({"prompt_tokens": len(prompt), **{m: {"seconds": s, "tokens": len(t), "steps": st}
                                                             for m, (s, t, st) in outs.items()}})
        none_tpot = outs["none"][0] / max(1, len(outs["none"][1]))
        spec_tpot = outs[spec][0] / max(1, len(outs[spec][1]))
        print(f"request {i}: {len(prompt)} prompt tokens, {len(outs['none'][1])} output tokens; ms/token none "
              f"{1000 * none_tpot:.1f}, {spec} {1000 * spec_tpot:.1f} ({none_tpot / spec_tpot:.2f}x)",
              file=sys.stderr, flush=True)
    stats = engines[spec].spec_stats
    tpot = {m: t["seconds"] / max(1, t["tokens"]) for m, t in totals.items()}
    report = {
        "model": args.model, "num_requests": len(prompts), "max_tokens": args.max_tokens,
        "speculative": spec, "k": args.k, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
        "num_threads": args.num_threads,
        "draft_layers": engines[spec].runner.draft.num_layers if spec == "self" else None,
        "draft_model": engines[spec].runner.draft.info.model_id if spec == "draft" else None,
        "ms_per_output_token": {m: 1000 * v for m, v in tpot.items()},
        "speedup": tpot["none"] / tpot[spec] if tpot[spec] > 0 else None,
        "tokens_per_step": {m: t["tokens"] / max(1, t["steps"]) for m, t in totals.items()},
        "acceptance_rate": stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else None,
        "tokens_per_check": stats.emitted_tokens / stats.num_checks if stats.num_checks else None,
        "proposed_tokens": stats.proposed_tokens, "accepted_tokens": stats.accepted_tokens,
        "identical_outputs": f"{same}/{len(prompts)}",
        "requests": per_request,
    }
    print(f"time per output token: none {report['ms_per_output_token']['none']:.1f} ms, {spec} "
          f"{report['ms_per_output_token'][spec]:.1f} ms: {report['speedup']:.2f}x; acceptance "
          f"{report['acceptance_rate'] or 0:.2f}, {report['tokens_per_check'] or 0:.2f} tokens per checking step, "
          f"{report['tokens_per_step'][spec]:.2f} tokens per step; identical greedy outputs "
          f"{report['identical_outputs']}")
    return report


class _FixedProposer:
    """Proposes ``s`` copies of one token (all rejected): the step's shape without its luck."""

    def __init__(self, s: int) -> None:
        self.s = s

    def propose(self, request, max_tokens: int) -> list[int]:
        return [5] * min(self.s, max_tokens)

    def forget(self, request_id: str) -> None:
        pass


def run_step_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Median step time with B requests decoding at a 200-token context, each checking s proposals."""
    from mqinfer.scheduler.request import SamplingParams

    rows = []
    for batch in args.batch_sizes:
        for s in (0, 1, 3, 7):
            engine = _engine(args, "ngram", num_speculative_tokens=max(1, s),
                             speculative_max_batched_tokens=1 << 20, max_num_batched_tokens=1 << 14,
                             speculative_policy="fixed")
            engine.scheduler.proposer = _FixedProposer(s) if s else None
            for i in range(batch):
                engine.add_request(f"r{i}", [7 + i % 50] * 200,
                                   SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            engine.step()
            engine.step()
            times = []
            for _ in range(args.sweep_steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            ms = 1000 * statistics.median(times)
            rows.append({"batch": batch, "proposals_each": s, "query_tokens": batch * (s + 1), "step_ms": ms})
            print(f"B={batch:3d} s={s}: {batch * (s + 1):4d} query tokens, step {ms:8.2f} ms", flush=True)
    return {"model": args.model, "num_threads": args.num_threads, "steps": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.spec_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Checkpoint folder or .gguf file (with a tokenizer, for the "
                                                  "copy workload).")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (default: 4).")
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--speculative", choices=("ngram", "self", "draft"), default="ngram",
                   help="The proposer compared with no speculation (default: ngram).")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="With --speculative self: the draft's layers (default: half the model's).")
    p.add_argument("--speculative-policy", choices=("adaptive", "fixed"), default="adaptive",
                   help="How many proposals each request runs (see `mqinfer worker --help`; default: adaptive, "
                        "the worker's default).")
    p.add_argument("--draft-model", default=None,
                   help="With --speculative draft: the draft checkpoint (a folder or .gguf file with the model's "
                        "tokenizer).")
    p.add_argument("--step-sweep", action="store_true", help="Measure step time against query tokens instead.")
    p.add_argument("--batch-sizes", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--sweep-steps", type=int, default=8)
    p.add_argument("--json", default=None, help="Also write the figures here.")
    args = p.parse_args(argv)
    report = run_step_sweep(args) if args.step_sweep else run_copy(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
