"""One GPU benchmark: mqinfer against transformers and against the memory roof, in one command.

``python -m mqinfer.loadgen.gpu.bench [--models 0.5b,1.5b] [--budget-s 360] [--json FILE]``
downloads nothing. In order, within a time budget:

1. ``gpu_check`` (every CUDA path against its reference), as a subprocess with its own timeout;
2. the device's memory bandwidth, from a measured copy (``gpu_bench_roofs``);
3. per model (random-weight checkpoints of Qwen2.5-0.5B's and -1.5B's shapes, written once into
   ``--workdir`` by ``loadgen/checkpoint.py``):
   - the standard workload through the whole pipeline (an embedded server, the client, one
     ``mqinfer worker`` process, the results Parquet), as ``mqinfer bench`` runs it offline;
   - the same requests through transformers on the same device: static batching at each
     ``--hf-batch-sizes`` (the best one counts) and its continuous batching (``generate_batch``)
     where the installed transformers has it;
   - a decode step at batch 1 as a share of the bandwidth, and a decode step at ``--roof-batch``
     against its roof (the weights and the batch's KV cache read once at that bandwidth), the
     engine driven directly;
   - TTFT and TPOT through the pipeline at two online rates, fractions (``--online-rates``) of the
     offline run's request rate.

It prints each figure as it is measured, then a summary with the ratios and the goals set for a GPU worker
(5x transformers' static batching, ahead of its continuous batching, batch 1 at 50% of the
bandwidth, the batch-``--roof-batch`` step within 1.5x its roof), and writes every figure to
``--json`` after each phase. When the budget runs out the phases not yet begun are recorded as
skipped and the summary is printed: a run cut short keeps what it measured. An interrupt
(Ctrl-C, ``timeout -s INT``) does the same.

``--device cpu --models tiny`` with a few requests is a dry run of every phase on the CPU
(gpu_check then says it has nothing to run), which the test suite runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mqinfer.loadgen.bench_options import positive_int, positive_int_list
from mqinfer.loadgen.gpu.bench_phases import SKIPPED, Budget  # noqa: F401  (SKIPPED: the report's word)
from mqinfer.loadgen.gpu.bench_run import run_all

DEFAULT_MODELS = ["0.5b", "1.5b"]
DEFAULT_BUDGET_S = 360.0


def parse_models(text: str) -> list[str]:
    """argparse type: comma-separated shape names (``loadgen/checkpoint.py`` SHAPES), ``tiny``, or
    checkpoint folders."""
    from mqinfer.loadgen.checkpoint import SHAPES

    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError("expected at least one model")
    for m in models:
        if m != "tiny" and m not in SHAPES and not (Path(m) / "config.json").is_file():
            raise argparse.ArgumentTypeError(
                f"{m!r} is neither a shape ({', '.join(SHAPES)}), tiny, nor a checkpoint folder with config.json")
    return models


def parse_fractions(text: str) -> list[float]:
    """argparse type: comma-separated fractions in (0, 1]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in (0, 1], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.gpu.bench", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every phase that ran succeeded (a phase skipped for the budget is no "
               "failure), 1 when gpu_check failed or a phase raised, 2 on bad arguments or no CUDA device.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where everything runs (default: cuda, device 0); cpu is a dry run of every phase")
    parser.add_argument("--models", type=parse_models, default=DEFAULT_MODELS, metavar="M,...",
                        help="models, in order: shape names of loadgen/checkpoint.py (0.5b, 1.5b, standard: random "
                             "weights, written once into --workdir), tiny, or checkpoint folders (default: 0.5b,1.5b)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                        help="weights and activations for every system (default: auto = bfloat16 on cuda, "
                             "float32 on cpu)")
    parser.add_argument("--num-requests", type=positive_int, default=256, metavar="N",
                        help="requests of the standard workload (prompts 16..256 tokens, outputs 16..128; "
                             "default: 256)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--hf-batch-sizes", type=positive_int_list, default=[16, 64, 256], metavar="B,...",
                        help="transformers' static batch sizes; the fastest counts (default: 16,64,256)")
    parser.add_argument("--roof-batch", type=positive_int, default=256, metavar="B",
                        help="batch of the decode step timed against its roof (default: 256)")
    parser.add_argument("--roof-context", type=positive_int, default=512, metavar="T",
                        help="prompt tokens of each sequence in the timed decode steps (default: 512)")
    parser.add_argument("--roof-steps", type=positive_int, default=20, metavar="K",
                        help="decode steps timed at each batch; the median counts (default: 20)")
    parser.add_argument("--online-rates", type=parse_fractions, default=[0.25, 0.5], metavar="F,...",
                        help="online rates as fractions of the offline run's request rate (default: 0.25,0.5)")
    parser.add_argument("--online-requests", type=positive_int, default=64, metavar="N",
                        help="requests per online rate, the workload's first N (default: 64)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="S",
                        help="time budget of the whole run, gpu_check and checkpoints included (default: 360 = "
                             "6 minutes); phases not begun when it is spent are skipped and the summary printed")
    parser.add_argument("--gpu-check-timeout-s", type=float, default=180.0, metavar="S",
                        help="most seconds gpu_check may take out of the budget (default: 180)")
    parser.add_argument("--skip-gpu-check", action="store_true", help="do not run gpu_check first")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where checkpoints are written and reused (default: the mqinfer cache, "
                             "$MQINFER_CACHE_DIR or ~/.cache/mqinfer, under gpu-bench)")
    parser.add_argument("--json", metavar="FILE", default="gpu_bench.json",
                        help="write every figure here, after each phase (default: gpu_bench.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.gpu_check_timeout_s <= 0:
        parser.error("--budget-s and --gpu-check-timeout-s must be > 0")
    if args.device == "cuda":
        from mqinfer.layout import cuda_available

        if not cuda_available():
            print("gpu_bench: no CUDA device here; --device cpu --models tiny runs every phase on the CPU as a dry run",
                  file=sys.stderr)
            return 2
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    try:
        return run_all(args, dtype, Budget(args.budget_s))
    except KeyboardInterrupt:
        print("gpu_bench: interrupted; the figures so far are in " + str(args.json), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
