"""What 8-bit weights and an 8-bit KV cache cost in quality, measured on a real model.

    python -m mqinfer.loadgen.quality --model M [--quantization none,w8a8,w8a16] [--kv-cache-dtype auto,int8]
        [--quantize-lm-head on,off]

For every combination of ``--quantization`` and ``--kv-cache-dtype`` (and for ``w8a8``, of
``--quantize-lm-head``) it runs the engine itself
(the same model code, kernels and KV cache a worker uses) and reports:

- **perplexity** on a fixed English text: the docstrings of a fixed list of Python standard
  library modules (no download; the text depends only on the Python version, which the report
  names). The text is cut into windows of ``--window`` tokens; each window is one prefill
  through the paged KV cache, so an 8-bit cache is written and read as in serving. Every
  token but each window's first is scored.
- **greedy agreement** with the first combination (``none`` / ``auto``: the model as it is):
  fixed chat prompts, ``--max-tokens`` greedy tokens each; how many outputs are identical and
  the mean share of the longer output the two have in common from the start.

The relative perplexity change against the first combination is the figure to read; the README
gives a table from this tool and a recommendation.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

# Stable, prose-heavy modules: their docstrings make a few tens of thousands of tokens.
TEXT_MODULES = ("argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
                "fractions", "functools", "heapq", "itertools", "json", "logging", "pathlib", "random",
                "shutil", "statistics", "string", "subprocess", "textwrap", "threading", "typing")

PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works to a new programmer.",
    "What are three good habits for writing readable code?",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about autumn rain.",
    "List five uses of a paperclip.",
    "How do vaccines train the immune system?",
    "Describe the water cycle for a ten year old.",
    "What is the difference between a list and a tuple in Python?",
    "Write a polite email asking to reschedule a meeting.",
    "Explain what a prime number is, with examples.",
    "Suggest a name for a coffee shop and explain it.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning, how are you?' into French and Spanish.",
)


def reference_text(modules: tuple[str, ...] = TEXT_MODULES) -> str:
    """The scored text: the docstrings of ``modules`` and of their public classes and functions."""
    from mqinfer.workers.engine.models.quant import docstring_text

    return docstring_text(modules)


@dataclass
class Result:
    quantization: str
    kv_cache_dtype: str
    lm_head: str  # "int8" (w8a8's head quantized too) or "dtype" (the model dtype)
    perplexity: float
    tokens_scored: int
    kv_blocks: int
    seconds: float
    identical: float | None = None  # share of prompts with the same greedy output as the baseline
    common_prefix: float | None = None  # mean share of the longer output in common from the start


def _engine(args: argparse.Namespace, quantization: str, kv_cache_dtype: str, lm_head: str):
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    options: dict[str, Any] = dict(model=args.model, device="cpu", dtype=args.dtype, quantization=quantization,
                                   quantize_lm_head=lm_head == "int8",
                                   num_threads=args.num_threads, max_num_seqs=len(PROMPTS),
                                   smoothquant_alpha=args.smoothquant_alpha,
                                   num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    return LLMEngine(EngineConfig(**options))


def perplexity(engine, ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of ``ids``, scored window by window through the engine's
    model and paged KV cache (each window one prefill into blocks 0, 1, ...)."""
    import torch

    runner, model = engine.runner, engine.model
    total_nll, scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                break
            hidden = runner.forward_sequence(chunk)
            logits = model.compute_logits(hidden[:-1]).float()
            targets = torch.tensor(chunk[1:], dtype=torch.int64)
            total_nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            scored += len(chunk) - 1
    return math.exp(total_nll / scored), scored


def greedy_outputs(engine, max_tokens: int) -> dict[str, list[int]]:
    from mqinfer.scheduler.request import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        ids = engine.encode_prompt(None, None, [{"role": "user", "content": prompt}])
        engine.add_request(f"p{i}", ids, sampling)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outputs[out.request_id] = list(out.output_token_ids)
    return outputs


def _log(message: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return values
    return parse


class _CannotMeasure(Exception):
    """A combination the engine cannot run: the command says why and exits with 2."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.window < 2:
        parser.error("--window must be at least 2")
    try:
        results = _measure(args)
    except _CannotMeasure as exc:
        print(f"quality: {exc}", file=sys.stderr)
        return 2
    _print_table(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "python": platform.python_version(),
                       "window": args.window, "max_tokens": args.max_tokens, "command": sys.argv,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


def _parser() -> argparse.ArgumentParser:
    from mqinfer.workers.config import QUANTIZATIONS, EngineConfig

    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.quality", description=__doc__.split("\n\n")[0],
                                     epilog="Example: python -m mqinfer.loadgen.quality --model ./smollm2 --json q.json")
    parser.add_argument("--model", required=True, help="Checkpoint folder or .gguf file (tiny works, but says little).")
    parser.add_argument("--quantization", type=_choices(QUANTIZATIONS), default=list(QUANTIZATIONS), metavar="Q[,Q...]",
                        help="Weight modes to measure; the first is the baseline (default: none,w8a8,w8a16).")
    parser.add_argument("--kv-cache-dtype", type=_choices(("auto", "int8", "fp8")), default=["auto", "int8"],
                        metavar="D[,D...]", help="KV cache dtypes to measure; the first is the baseline (default: auto,int8).")
    parser.add_argument("--quantize-lm-head", type=_choices(("on", "off")), default=None, metavar="on|off[,...]",
                        help="For w8a8: the LM head in int8 too (on) or in the model dtype (off); both (on,off) "
                             "measures each (default: the engine's, " + ("on" if EngineConfig.quantize_lm_head else "off")
                             + "). The other modes keep the head in the model dtype.")
    parser.add_argument("--smoothquant-alpha", type=float, default=EngineConfig.smoothquant_alpha, metavar="A",
                        help=f"SmoothQuant's alpha for w8a8 (0 = off; default: {EngineConfig.smoothquant_alpha:g}, "
                             "the engine's default).")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                        help="Model dtype (default: float32, the reference).")
    parser.add_argument("--window", type=int, default=512, help="Tokens per perplexity window (default: 512).")
    parser.add_argument("--max-text-tokens", type=int, default=16384,
                        help="Score at most this many tokens of the text (default: 16384).")
    parser.add_argument("--max-tokens", type=int, default=64, help="Greedy tokens per prompt (default: 64).")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: every core).")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: the engine's).")
    parser.add_argument("--json", default=None, metavar="FILE", help="Also write the figures as JSON.")
    return parser


def _combinations(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(quantization, KV cache dtype, LM head) to measure, the baseline first; the LM head choice
    applies to w8a8 only."""
    from mqinfer.workers.config import EngineConfig

    head_choices = args.quantize_lm_head or ["on" if EngineConfig.quantize_lm_head else "off"]
    return [(quantization, kv, "int8" if quantization == "w8a8" and head == "on" else "dtype")
            for quantization in args.quantization for kv in args.kv_cache_dtype
            for head in (head_choices if quantization == "w8a8" else ["off"])]


def _measure(args: argparse.Namespace) -> list[Result]:
    """Each combination's perplexity on the reference text and greedy agreement with the first's."""
    text = reference_text()
    results: list[Result] = []
    baseline_outputs: dict[str, list[int]] | None = None
    ids: list[int] | None = None
    for quantization, kv, lm_head in _combinations(args):
        _log(f"--quantization {quantization} --kv-cache-dtype {kv} (LM head: {lm_head}): loading {args.model}")
        try:
            engine = _engine(args, quantization, kv, lm_head)
        except (TypeError, ValueError) as exc:
            raise _CannotMeasure(f"cannot build the engine with --quantization {quantization} --kv-cache-dtype "
                                 f"{kv}: {exc}") from exc
        if engine.tokenizer is None:
            raise _CannotMeasure(f"{args.model} has no tokenizer; perplexity needs one")
        if ids is None:
            ids = engine.tokenizer.encode(text)[: args.max_text_tokens]
            _log(f"text: {len(ids)} tokens of docstrings from {len(TEXT_MODULES)} modules "
                 f"(Python {platform.python_version()})")
        t = time.perf_counter()
        ppl, scored = perplexity(engine, ids, min(args.window, engine.max_model_len))
        outputs = greedy_outputs(engine, args.max_tokens)
        result = Result(quantization, kv, lm_head, ppl, scored, engine.scheduler_config.num_kv_blocks, time.perf_counter() - t)
        if baseline_outputs is None:
            baseline_outputs = outputs
        else:
            from mqinfer.loadgen.metrics import token_agreement

            agreement = token_agreement(outputs, baseline_outputs)
            if agreement is not None:
                result.identical, result.common_prefix = agreement.identical, agreement.common_prefix
        results.append(result)
        _log(f"perplexity {ppl:.4f} over {scored} tokens ({result.seconds:.1f}s)")
        del engine
    return results


def _print_table(args: argparse.Namespace, results: list[Result]) -> None:
    """One row per combination, its perplexity's change against the first row's."""
    base = results[0]
    print(f"quality of {args.model} ({args.dtype}); text: {base.tokens_scored} tokens scored in windows of "
          f"{args.window} (docstrings, Python {platform.python_version()}); greedy: {len(PROMPTS)} chat prompts x "
          f"{args.max_tokens} tokens, against the first row")
    print(f"{'quantization':<13} {'kv cache':<9} {'lm head':<7} {'perplexity':>10} {'vs first':>9} {'identical':>9} "
          f"{'common prefix':>13} {'KV blocks':>9}")
    for r in results:
        change = r.perplexity / base.perplexity - 1
        same = "-" if r.identical is None else f"{r.identical:.0%}"
        prefix = "-" if r.common_prefix is None else f"{r.common_prefix:.0%}"
        print(f"{r.quantization:<13} {r.kv_cache_dtype:<9} {r.lm_head:<7} {r.perplexity:>10.4f} {change:>+9.2%} {same:>9} "
              f"{prefix:>13} {r.kv_blocks:>9}")


if __name__ == "__main__":
    sys.exit(main())
