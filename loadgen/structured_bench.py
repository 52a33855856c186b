"""Structured output's cost and quality: ``LLMEngine`` driven directly (no Redis, no sinks).

Two measurements::

    python -m mqinfer.loadgen.structured_bench [--model tiny|FOLDER|FILE.gguf] [--num-requests 256]
        [--repeat 3] [--json OUT]
    python -m mqinfer.loadgen.structured_bench --validity --model FILE.gguf [--json OUT]

**Throughput** (the default): the standard workload's prompts (uniform in 16..256 tokens, all
requests added at once), every request constrained by one of the 60 JSON Schemas of
loadgen/structured_workload.py with its ``max_tokens`` (16..128) as the cap, greedy. Then the
same prompts unconstrained, each asking (``ignore_eos``) for exactly as many tokens as its
constrained run produced: the same steps over the same batch shapes, so the ratio of the two is
what the masks cost. The two take turns ``--repeat`` times after a warm-up that also compiles the
grammars (compilation is timed on its own, on a fresh compiler); throughput is output tokens over
the time from the first request added to the last finished, the median of the rounds. It also
reports the token masks' own figures: how long filling them took and how much of that the
forward pass did not hide (the seconds sampling waited).

**Validity** (``--validity``): the 60 schemas with chat prompts that show the schema (a real model
with a chat template), greedy and seeded: the share of rows that end ``stop``, the share of those
whose text parses and validates against its schema with the ``jsonschema`` package (installed
with the dev extra), and whether the rows' ``schema_valid`` agrees; then the same prompts greedy
without ``response_format``, the model left to follow the instruction alone (its text parsed as
it is, whitespace around it allowed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def _log(message: str) -> None:
    print(f"[structured {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_engine(args: argparse.Namespace):
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    return LLMEngine(EngineConfig(
        model=args.model, device="cpu", dtype=args.dtype, num_threads=args.num_threads,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
    ))


def _grammar(schema: dict[str, Any]):
    from mqinfer.schemas.response_format import GrammarSpec

    return GrammarSpec("json_schema", json.dumps(schema))


def run_round(engine, requests: list[dict[str, Any]], grammars: list | None,
              lengths: dict[str, int] | None) -> tuple[float, dict[str, Any]]:
    """One pass over ``requests``: constrained by ``grammars`` (capped by each request's
    max_tokens), or unconstrained with ``lengths`` tokens each. (seconds, outputs by id)."""
    from mqinfer.scheduler.request import SamplingParams

    outputs: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        if grammars is not None:
            sampling = SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, grammar=grammars[i])
        else:
            sampling = SamplingParams(max_tokens=lengths[r["id"]], temperature=0.0, ignore_eos=True)
        engine.add_request(r["id"], r["prompt_token_ids"], sampling)
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                outputs[o.request_id] = o
    return time.perf_counter() - t0, outputs


def compile_times(engine, schemas: list[tuple[str, dict]]) -> list[float]:
    """Seconds to compile each schema on a fresh compiler over the engine's tokenizer."""
    from mqinfer.workers.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(engine.structured.compiler.tokenizer)
    times = []
    for _, schema in schemas:
        t = time.perf_counter()
        compiler.matcher(_grammar(schema))
        times.append(time.perf_counter() - t)
    return times


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from mqinfer.loadgen.structured_workload import json_schemas
    from mqinfer.loadgen.workload import standard_workload

    engine = build_engine(args)
    if engine.structured is None:
        raise SystemExit(f"{args.model} has no tokenizer: structured output needs one")
    vocab = engine.info.vocab_size
    requests = standard_workload(vocab_size=vocab, n=args.num_requests, seed=args.seed)
    schemas = json_schemas(60)
    grammars = [_grammar(schemas[i % len(schemas)][1]) for i in range(len(requests))]
    compiled = compile_times(engine, schemas)

    _log(f"warm-up: {args.model}, {len(requests)} requests")
    _, outs = run_round(engine, requests, grammars, None)
    lengths = {rid: len(o.output_token_ids) for rid, o in outs.items()}
    reasons = [o.finish_reason for o in outs.values()]
    run_round(engine, requests, None, lengths)
    tokens = sum(lengths.values())
    constrained_s, free_s = [], []
    fill_s = wait_s = 0.0
    masks = steps = 0
    for k in range(args.repeat):
        stats = engine.structured.stats
        before = (stats.fill_seconds, stats.wait_seconds, stats.masks, stats.steps)
        seconds, outs = run_round(engine, requests, grammars, None)
        got = {rid: len(o.output_token_ids) for rid, o in outs.items()}
        if got != lengths:
            raise RuntimeError("a constrained round produced other lengths than the warm-up (greedy must repeat)")
        constrained_s.append(seconds)
        fill_s += stats.fill_seconds - before[0]
        wait_s += stats.wait_seconds - before[1]
        masks += stats.masks - before[2]
        steps += stats.steps - before[3]
        free_s.append(run_round(engine, requests, None, lengths)[0])
        _log(f"round {k + 1}: constrained {tokens / constrained_s[-1]:.1f} tok/s, "
             f"unconstrained {tokens / free_s[-1]:.1f} tok/s")
    engine.close()
    constrained = tokens / statistics.median(constrained_s)
    free = tokens / statistics.median(free_s)
    report = {
        "model": engine.info.model_id, "vocab_size": vocab, "num_requests": len(requests), "output_tokens": tokens,
        "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))},
        "constrained_tokens_per_s": constrained, "unconstrained_tokens_per_s": free, "ratio": constrained / free,
        "mask_fill_us_per_mask": 1e6 * fill_s / max(1, masks), "mask_steps": steps // max(1, args.repeat),
        "mask_fill_s_per_round": fill_s / args.repeat, "mask_wait_s_per_round": wait_s / args.repeat,
        "round_s_constrained": statistics.median(constrained_s),
        "compile_ms_median": 1e3 * statistics.median(compiled), "compile_ms_max": 1e3 * max(compiled),
        "num_threads": args.num_threads, "repeat": args.repeat,
    }
    print(f"{report['model']}: {len(requests)} requests, {tokens} output tokens "
          f"({', '.join(f'{k} {v}' for k, v in report['finish_reasons'].items())})")
    print(f"constrained {constrained:.1f} tok/s, unconstrained {free:.1f} tok/s: ratio {report['ratio']:.3f} "
          f"(median of {args.repeat})")
    print(f"masks: {report['mask_fill_us_per_mask']:.1f} us each, {report['mask_fill_s_per_round'] * 1e3:.1f} ms "
          f"filling per round, {report['mask_wait_s_per_round'] * 1e3:.1f} ms of it waited for "
          f"(of a {report['round_s_constrained']:.2f} s round)")
    print(f"compile: median {report['compile_ms_median']:.2f} ms, max {report['compile_ms_max']:.2f} ms "
          f"over the 60 schemas")
    return report


def run_validity(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    from mqinfer.loadgen.structured_workload import json_schemas, structured_requests
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.schemas.request import request_from_obj, to_sampling_kwargs

    engine = build_engine(args)
    if engine.structured is None or engine.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: structured output needs one")
    schemas = json_schemas(args.num_schemas)
    by_name = dict(schemas)
    report: dict[str, Any] = {"model": engine.info.model_id, "num_schemas": len(schemas), "runs": {}}
    for label, temperature, seed in (("greedy", 0.0, None), ("seeded", args.temperature, args.seed),
                                     ("greedy_unconstrained", 0.0, None)):
        t0 = time.perf_counter()
        for obj in structured_requests(schemas, max_tokens=args.max_tokens, temperature=temperature, seed=seed):
            if label.endswith("unconstrained"):
                del obj["response_format"]
            req = request_from_obj(obj)
            prompt = engine.encode_prompt(None, None, [{"role": m.role, "content": m.content} for m in req.messages])
            engine.add_request(req.id, prompt, SamplingParams(**to_sampling_kwargs(req)))
        outs = {}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.finished:
                    outs[o.request_id] = o
        stopped = [o for o in outs.values() if o.finish_reason == "stop"]
        valid, disagree, examples = 0, 0, []
        for o in stopped:
            schema = by_name[o.request_id.rsplit("-", 1)[0]]
            try:
                jsonschema.validate(json.loads(o.text), schema)
                ok = True
            except (ValueError, jsonschema.ValidationError) as exc:
                ok = False
                examples.append(f"{o.request_id}: {str(exc).splitlines()[0][:120]}")
            valid += ok
            disagree += o.schema_valid is not None and ok != o.schema_valid
        run = {"rows": len(outs), "stop": len(stopped), "stop_valid": valid,
               "stop_share": len(stopped) / len(outs), "valid_share_of_stop": valid / max(1, len(stopped)),
               "schema_valid_disagrees": disagree, "output_tokens": sum(len(o.output_token_ids) for o in outs.values()),
               "seconds": time.perf_counter() - t0, "invalid_examples": examples[:5],
               "sample_text": next((o.text for o in stopped), None)}
        report["runs"][label] = run
        print(f"{label}: {run['stop']}/{run['rows']} rows end stop, {valid}/{run['stop']} of them parse and "
              f"validate (jsonschema); schema_valid disagrees on {disagree}; {run['output_tokens']} tokens in "
              f"{run['seconds']:.1f} s")
    engine.close()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.structured_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, a checkpoint folder or a .gguf file (default: tiny).")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=256, help="Throughput: requests (default: 256, the "
                                                                 "standard workload's).")
    p.add_argument("--repeat", type=int, default=3, help="Throughput: rounds of each (default: 3).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validity", action="store_true", help="Measure validity on the 60 schemas instead.")
    p.add_argument("--num-schemas", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=384, help="Validity: max_tokens of each request.")
    p.add_argument("--temperature", type=float, default=0.8, help="Validity: the seeded run's temperature.")
    p.add_argument("--json", default=None, help="Also write the figures here.")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.num_requests < 1:
        p.error("--repeat and --num-requests must be at least 1")
    report = run_validity(args) if args.validity else run_throughput(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
