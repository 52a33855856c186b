"""How close the engine's bfloat16 outputs stay to the float32 model, against transformers' own
bfloat16 on the same checkpoint and prompts.

    python -m mqinfer.loadgen.bf16_agreement --model DIR [--max-tokens 64] [--switch VAR=VALUE ...]

The reference is transformers in float32. Against it, for transformers in bfloat16, the engine in
bfloat16 (as a worker runs it, and once per ``--switch``, a kernel switch such as
``MQINFER_CPU_ATTENTION=torch``) and the engine in float32, on real chat prompts (the chat
template applied, as a worker does for ``messages``):

- **next-token agreement under the reference's text**: each prompt followed by the reference's
  greedy output is run through the model once (a prefill), and every position's top token is
  compared with the reference's next token. Hundreds of positions, so the figure holds still.
- **greedy agreement**: each side generates ``--max-tokens`` greedy tokens by itself (the engine
  through its decoding steps and paged KV cache); the share of first tokens and of whole outputs
  that equal the reference's, and the mean share of the longer output the two have in common
  from the start. A near-tie flipped once changes the rest of an output, so these move in steps
  of a prompt.

The engine meets the bar where its figures are at least transformers' bfloat16 ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from mqinfer.loadgen.quality import PROMPTS


def _log(message: str) -> None:
    print(f"[bf16_agreement {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _engine(model: str, dtype: str, num_threads: int | None):
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    return LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, num_threads=num_threads,
                                  max_num_seqs=len(PROMPTS), enable_prefix_caching=False))


def _engine_side(engine, prompts: list[list[int]], reference: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from mqinfer.scheduler.request import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, sampling)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outputs[out.request_id] = list(out.output_token_ids)
    with torch.inference_mode():
        def top_tokens(ids: list[int]) -> list[int]:
            return engine.model.compute_logits(engine.runner.forward_sequence(ids)).float().argmax(-1).tolist()
        forced = [top_tokens(p + r) for p, r in zip(prompts, reference)]
    return {"greedy": [outputs[f"p{i}"] for i in range(len(prompts))], "forced": forced}


def _hf_side(hf, prompts: list[list[int]], reference: list[list[int]] | None, max_tokens: int) -> dict[str, Any]:
    greedy, forced = [], []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                              top_p=None, top_k=None, temperature=None)
            greedy.append(out[0, len(ids):].tolist())
            if reference is not None:
                full = torch.tensor([ids + reference[i]])
                forced.append(hf(full).logits[0].float().argmax(-1).tolist())
    return {"greedy": greedy, "forced": forced}


def _scores(side: dict[str, Any], prompts: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    from mqinfer.loadgen.metrics import token_agreement

    agree = positions = 0
    for p, r, top in zip(prompts, reference, side["forced"]):
        # Position len(p) - 1 + j predicts reference token j.
        predicted = top[len(p) - 1: len(p) - 1 + len(r)]
        agree += sum(a == b for a, b in zip(predicted, r))
        positions += len(r)
    greedy = token_agreement({str(i): g for i, g in enumerate(side["greedy"])},
                             {str(i): r for i, r in enumerate(reference)})
    return {"next_token": agree / positions, "positions": positions, "first_token": greedy.first_token,
            "identical": greedy.identical, "common_prefix": greedy.common_prefix}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = _engine(args.model, "bfloat16", args.num_threads)
    if engine.tokenizer is None:
        raise SystemExit(f"bf16_agreement: {args.model} has no tokenizer (real chat prompts need one)")
    prompts = [engine.encode_prompt(None, None, [{"role": "user", "content": p}]) for p in PROMPTS]
    _log(f"{len(prompts)} chat prompts, {sum(map(len, prompts))} tokens; transformers float32 (the reference)")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    reference = _hf_side(hf, prompts, None, args.max_tokens)["greedy"]
    rows = [{"side": "transformers float32", **_scores(_hf_side(hf, prompts, reference, args.max_tokens),
                                                       prompts, reference)}]
    _log("transformers bfloat16")
    rows.append({"side": "transformers bfloat16",
                 **_scores(_hf_side(hf.to(torch.bfloat16), prompts, reference, args.max_tokens), prompts, reference)})
    del hf
    for switch in [None, *args.switch]:
        variable, _, value = (switch or "").partition("=")
        before = os.environ.get(variable) if switch else None
        if switch:
            os.environ[variable] = value
        try:
            _log(f"mqinfer bfloat16{' with ' + switch if switch else ''}")
            rows.append({"side": f"mqinfer bfloat16{' with ' + switch if switch else ''}",
                         **_scores(_engine_side(engine, prompts, reference, args.max_tokens), prompts, reference)})
        finally:
            if switch:
                os.environ.pop(variable, None) if before is None else os.environ.__setitem__(variable, before)
    del engine
    _log("mqinfer float32")
    rows.append({"side": "mqinfer float32", **_scores(
        _engine_side(_engine(args.model, "float32", args.num_threads), prompts, reference, args.max_tokens),
        prompts, reference)})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'against transformers float32':<52} {'next token':>10} {'first token':>11} {'identical':>9} "
             f"{'common prefix':>13}", "-" * 99]
    for r in rows:
        lines.append(f"{r['side']:<52} {r['next_token']:>10.2%} {r['first_token']:>11.0%} {r['identical']:>9.0%} "
                     f"{r['common_prefix']:>13.1%}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.bf16_agreement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Checkpoint folder with a tokenizer (e.g. SmolLM2's).")
    parser.add_argument("--max-tokens", type=int, default=64, help="Greedy tokens per prompt (default: 64).")
    parser.add_argument("--num-threads", type=int, default=None, help="Threads (default: every core).")
    parser.add_argument("--switch", action="append", default=[], metavar="VAR=VALUE",
                        help="Also run the engine in bfloat16 with this environment setting (a kernel switch); "
                             "repeatable.")
    parser.add_argument("--json", default=None, metavar="FILE", help="Also write the rows as JSON.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for switch in args.switch:
        if "=" not in switch or not switch.partition("=")[0]:
            _parser().error(f"--switch takes VAR=VALUE, got {switch!r}")
    rows = measure(args)
    print(f"bf16_agreement: {args.model}, {len(PROMPTS)} chat prompts, {args.max_tokens} greedy tokens each")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
