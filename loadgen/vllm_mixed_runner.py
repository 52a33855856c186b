"""vLLM's engine on timed arrivals with priorities: the script `python -m mqinfer.loadgen.mixed_bench
--compare vllm` runs with the Python of a separate environment that has vLLM's CPU build.

It imports vLLM and the standard library only (never mqinfer). Input: a JSON file with the model
folder, engine settings and phases, each a list of requests (id, prompt token ids, max_tokens, an
arrival time in seconds from the phase's start, a priority: vLLM serves the lower value first).
It builds ``vllm.LLM`` with ``scheduling_policy="priority"`` (timed: start-up), warms it up on a
few requests, then runs each phase in turn: requests are added to the engine as their arrival
time comes, the engine is stepped, and each request's first token and finish are timed when a
step returns them. Greedy with ``ignore_eos``, so every request generates exactly its max_tokens.
Output: a JSON file with, per phase and request, the arrival, first-token and finish times (unix
seconds) and the tokens generated, and vLLM's version.

    python loadgen/vllm_mixed_runner.py IN.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time


def run_phase(engine, requests, sampling, tokens_prompt) -> list[dict]:
    """Add each request at its arrival time and step the engine until every one has finished."""
    pending = sorted(requests, key=lambda r: r["arrival_s"])
    start = time.time()
    timing: dict[str, dict] = {}
    while pending or engine.has_unfinished_requests():
        now = time.time()
        while pending and start + pending[0]["arrival_s"] <= now:
            r = pending.pop(0)
            params = sampling(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(r["id"], tokens_prompt(prompt_token_ids=r["prompt_token_ids"]), params,
                               priority=r["priority"])
            timing[r["id"]] = {"id": r["id"], "enqueued_at": now, "first_token_at": None, "finished_at": None,
                               "prompt_tokens": len(r["prompt_token_ids"]), "output_tokens": 0}
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0]["arrival_s"] - time.time()))
            continue
        outputs = engine.step()
        stamp = time.time()
        for out in outputs:
            t = timing.get(out.request_id)
            if t is None:
                continue
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and t["first_token_at"] is None:
                t["first_token_at"] = stamp
            t["output_tokens"] = max(t["output_tokens"], n)
            if out.finished:
                t["finished_at"] = stamp
    return list(timing.values())


def main(argv: list[str]) -> int:
    started = time.time()
    if len(argv) != 2:
        print("usage: vllm_mixed_runner.py IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0, scheduling_policy="priority",
              **spec.get("engine_args", {}))
    init_s = time.time() - t0
    engine = llm.llm_engine
    warm = [dict(r, id=f"warm-{i}", arrival_s=0.0) for i, r in enumerate(spec["phases"][0]["requests"][:4])]
    run_phase(engine, warm, SamplingParams, TokensPrompt)
    phases = {}
    for phase in spec["phases"]:
        phases[phase["name"]] = run_phase(engine, phase["requests"], SamplingParams, TokensPrompt)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump({"vllm_version": vllm.__version__, "init_s": init_s, "phases": phases,
                   "process_s": time.time() - started}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
