"""One GPU check: everything of mqinfer that needs CUDA, against its reference, in one command.

``python -m mqinfer.loadgen.gpu.check [--json FILE] [--model CHECKPOINT] [--only NAME,...]``
runs, on CUDA device 0 (the parallel rows on devices 0 and 1), in a few minutes:

- the Triton KV store and paged attention against the PyTorch path, float32 and bfloat16
  (``gpu_kernels``), and over an 8-bit (int8, fp8) cache;
- w8a8: ``torch._int_mm``'s int32 sums against exact ones, and the w8a8 engine against float32;
- the 8-bit KV cache in the engine against the model's dtype;
- swap: KV blocks through pinned host memory, and swap preemption in the engine;
- the float32 engine on the GPU against the float32 engine on the CPU;
- ``mqinfer run`` end to end on the tiny model and on a checkpoint read from disk (``--model``,
  else a random-weight Llama written by ``loadgen/checkpoint.py``);
- with two or more GPUs, tensor parallelism (and pipeline parallelism where built) against one
  rank; with one GPU those rows say so.

It prints one table (case, result, time, detail) and exits 1 if any case failed or raised, else
0. ``--json FILE`` writes the table and the environment (rewritten after each case, so a run cut
short keeps what it finished). On a machine without CUDA it says so and exits 0 with nothing run.
``--device cpu --small`` (not in the help) runs every case on the CPU at small sizes, the Triton
kernels under ``TRITON_INTERPRET=1``: how the tests exercise this script without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

# A failing row's result, and the results that do not fail the check.
FAILED = ("FAIL", "ERROR")
PASSED_OR_NOT_RUN = ("ok", "skipped", "not built")


@dataclass(frozen=True)
class Row:
    case: str
    result: str  # ok | FAIL | ERROR | skipped | not built
    seconds: float
    detail: str


def case_list() -> list[tuple[str, Callable[[Any], Any]]]:
    """(name, function of a ``Setup``) for every case, in the order they run."""
    import torch

    from mqinfer.loadgen.gpu import check_cases as c

    return [
        ("triton kernels float32", lambda s: c.triton_kernels(s, torch.float32)),
        ("triton kernels bfloat16", lambda s: c.triton_kernels(s, torch.bfloat16)),
        ("triton 8-bit KV store + attention", c.triton_kv8),
        ("w8a8 int8 matmul (torch._int_mm)", c.w8a8_matmul),
        ("swap: host blocks (pinned)", c.swap_host_cache),
        ("engine float32 vs CPU", c.engine_vs_cpu),
        ("w8a8 engine vs float32", c.w8a8_engine),
        ("8-bit KV cache engine vs float32", c.kv8_engine),
        ("swap preemption in the engine", c.swap_engine),
        ("KV tiers (host, disk) in the engine", c.kv_tiers_engine),
        ("mqinfer run tiny", c.run_tiny),
        ("mqinfer run checkpoint", c.run_checkpoint),
        ("tensor parallel T=2", c.tensor_parallel),
        ("pipeline parallel P=2", c.pipeline_parallel),
    ]


def run_case(name: str, fn: Callable[[Any], Any], setup: Any) -> Row:
    """One case, timed: its outcome, its skip, or the exception it raised (an ERROR row)."""
    from mqinfer.loadgen.gpu.check_cases import Skip

    began = time.perf_counter()
    try:
        outcome = fn(setup)
    except Skip as skip:
        return Row(name, skip.result, time.perf_counter() - began, skip.detail)
    except Exception as exc:  # a case that breaks is a failed check, and the others still run
        where = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"
        return Row(name, "ERROR", time.perf_counter() - began, detail)
    return Row(name, "ok" if outcome.ok else "FAIL", time.perf_counter() - began, outcome.detail)


def format_row(row: Row) -> str:
    return f"{row.case:36} {row.result:9} {row.seconds:7.1f}s  {row.detail}"


def format_table(rows: list[Row]) -> str:
    header = f"{'case':36} {'result':9} {'time':>8}  detail"
    return "\n".join([header, *(format_row(r) for r in rows)])


def exit_code(rows: list[Row]) -> int:
    """1 if any case failed or raised, else 0 (skipped and not-built rows do not fail it)."""
    unknown = [r.result for r in rows if r.result not in FAILED + PASSED_OR_NOT_RUN]
    if unknown:
        raise ValueError(f"unknown results {unknown}")
    return 1 if any(r.result in FAILED for r in rows) else 0


def environment(device: str) -> dict[str, Any]:
    """What the check ran on: the GPU (or CPU), Python, torch, triton, and the date (UTC)."""
    import torch

    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": device, "gpus": [],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write_json(path: str | None, env: dict[str, Any], rows: list[Row], done: bool) -> None:
    if not path:
        return
    body = {"environment": env, "rows": [asdict(r) for r in rows], "finished": done,
            "exit_code": exit_code(rows) if done else None}
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


def _cuda_count() -> int | None:
    """CUDA devices visible; None where torch is not installed."""
    from mqinfer.layout import cuda_available

    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count() if cuda_available() else 0


def run_all(setup: Any, only: list[str] | None, json_path: str | None) -> int:
    cases = case_list()
    if only:
        names = [name for name, _ in cases]
        missing = [o for o in only if o not in names]
        if missing:
            raise SystemExit(f"gpu_check: no case named {', '.join(map(repr, missing))}; cases: {', '.join(names)}")
        cases = [(name, fn) for name, fn in cases if name in only]
    env = environment(setup.device)
    print(f"gpu_check on {setup.device} ({', '.join(env['gpus']) or env.get('cpu')}); python {env['python']}, "
          f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}; {env['date_utc']} UTC", flush=True)
    print(format_table([]), flush=True)
    rows: list[Row] = []
    for name, fn in cases:
        rows.append(run_case(name, fn, setup))
        print(format_row(rows[-1]), flush=True)
        write_json(json_path, env, rows, done=False)
    code = exit_code(rows)
    write_json(json_path, env, rows, done=True)
    print("\n" + format_table(rows))
    failed = [r.case for r in rows if r.result in FAILED]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows passed or did not need to run"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.gpu.check",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Exit status: 0 when every case passed (or had nothing to run), "
                                            "1 on any mismatch or error.")
    parser.add_argument("--json", metavar="FILE", help="also write the table and the environment as JSON")
    parser.add_argument("--model", metavar="CHECKPOINT",
                        help="a real checkpoint (folder or .gguf) for the end-to-end row (default: a random-weight "
                             "Llama written by loadgen/checkpoint.py)")
    parser.add_argument("--only", metavar="NAME,...", help="run only these cases (names as in the table)")
    parser.add_argument("--workdir", metavar="DIR", help="where checkpoints and run outputs go (default: a temporary "
                                                          "folder, removed at the end)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model and not Path(args.model).exists():
        parser.error(f"--model {args.model}: no such file or folder")
    only = [o.strip() for o in args.only.split(",") if o.strip()] if args.only else None
    if args.device == "cpu":
        # Before triton is first imported: @triton.jit picks the interpreter when it decorates.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        count = 0
    else:
        count = _cuda_count()
        if not count:
            why = "torch is not installed" if count is None else "no CUDA device"
            print(f"gpu_check: {why}: nothing run (it checks what needs an NVIDIA GPU)")
            write_json(args.json, {"device": None, "reason": why}, [], done=True)
            return 0
    from mqinfer.loadgen.gpu.check_cases import Setup

    with tempfile.TemporaryDirectory(prefix="mqinfer-gpu-check-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        setup = Setup(device=args.device or "cuda", small=args.small, workdir=workdir, gpu_count=count,
                      model=args.model)
        return run_all(setup, only, args.json)


if __name__ == "__main__":
    sys.exit(main())
