"""How long the sampler takes on one step's logits: ``sample`` on ``[rows, vocab]`` float32 rows
drawn from a normal distribution (scaled so that, like a model's, a few tokens stand out), with
the native Gumbel-max kernel and with the PyTorch path (``MQINFER_CPU_OPS=torch``), alternately.

    python -m mqinfer.loadgen.sampling_bench [--rows 192] [--vocab 49152] [--temperature 1.0]
                                             [--top-k 0] [--top-p 1.0] [--repeats 10]

Prints the median milliseconds of each path and their ratio. Both paths pick the same tokens
(the tests check it); this checks that again on the timed rows. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from mqinfer.kernels.sampling import SamplingTensors, sample


def _timed(logits: torch.Tensor, params: SamplingTensors, repeats: int, switch: str | None) -> tuple[float, torch.Tensor]:
    before = os.environ.get("MQINFER_CPU_OPS")
    if switch is None:
        os.environ.pop("MQINFER_CPU_OPS", None)
    else:
        os.environ["MQINFER_CPU_OPS"] = switch
    try:
        out = sample(logits, params)  # warm-up (and the native path's noise tables)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            sample(logits, params)
            times.append(time.perf_counter() - t)
        return statistics.median(times), out
    finally:
        if before is None:
            os.environ.pop("MQINFER_CPU_OPS", None)
        else:
            os.environ["MQINFER_CPU_OPS"] = before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.sampling_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=192, help="Rows (sequences) in the step (default: 192).")
    p.add_argument("--vocab", type=int, default=49152, help="Vocabulary size (default: 49152, SmolLM2's).")
    p.add_argument("--temperature", type=float, default=1.0, help="Every row's temperature (default: 1.0).")
    p.add_argument("--top-k", type=int, default=0, help="Every row's top-k (default: 0, off).")
    p.add_argument("--top-p", type=float, default=1.0, help="Every row's top-p (default: 1.0, off).")
    p.add_argument("--repeats", type=int, default=10, help="Timed calls per path (default: 10).")
    args = p.parse_args(argv)
    if args.rows < 1 or args.vocab < 1 or args.repeats < 1 or not args.temperature > 0:
        p.error("--rows, --vocab and --repeats must be at least 1, --temperature above 0")
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3.0
    params = SamplingTensors.from_lists([args.temperature] * args.rows, [args.top_k] * args.rows,
                                        [args.top_p] * args.rows, list(range(args.rows)), [100] * args.rows)
    native_s, native_ids = _timed(logits, params, args.repeats, None)
    torch_s, torch_ids = _timed(logits, params, args.repeats, "torch")
    same = torch.equal(native_ids, torch_ids)
    print(f"sample() on [{args.rows}, {args.vocab}], temperature {args.temperature:g}, top-k {args.top_k}, "
          f"top-p {args.top_p:g}, {torch.get_num_threads()} threads: native {native_s * 1e3:.1f} ms, "
          f"PyTorch {torch_s * 1e3:.1f} ms ({torch_s / native_s:.1f}x); same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
