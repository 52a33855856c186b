"""llama.cpp as a peer of `mqinfer bench`: ``llama-batched-bench`` on the fixed workload's shape.

``llama-batched-bench -npp P -ntg G -npl N`` decodes N sequences of P random prompt tokens at once,
then generates G tokens for each, one token per sequence per step, and prints one row of a
Markdown table: PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s, where
S = (N*P + N*G) / T is every token over the total time. ``mqinfer bench --workload fixed`` runs
the same shape, so its (prompt + generated) tokens over its span compare with S.

Owns the command line (``batched_bench_argv``), one run (``run_batched_bench``, with
``OMP_WAIT_POLICY=passive`` so that llama.cpp's idle OpenMP threads sleep instead of spinning on a
shared machine), the parsers of its table and model lines, and the bench's side: its flags
(``check_flags``) and one run per thread count beside mqinfer's figure (``compare``). Nothing here
builds llama.cpp: ``loadgen/peers.sh`` does, from source.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_model import ModelSpec
from mqinfer.loadgen.bench_options import LLAMACPP
from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.metrics import RequestTiming, RunSummary

BINARY = "llama-batched-bench"
DEFAULT_BATCH = 2048  # llama.cpp's own -b and -ub defaults
DEFAULT_UBATCH = 512

# Header cell -> field, in the order llama-batched-bench prints them.
_COLUMNS = {"PP": "pp", "TG": "tg", "B": "b", "N_KV": "n_kv", "T_PP s": "t_pp_s", "S_PP t/s": "s_pp_tok_s",
            "T_TG s": "t_tg_s", "S_TG t/s": "s_tg_tok_s", "T s": "t_s", "S t/s": "s_tok_s"}
_INT_FIELDS = ("pp", "tg", "b", "n_kv")


@dataclass(frozen=True)
class BatchedBenchRow:
    pp: int  # prompt tokens per sequence
    tg: int  # generated tokens per sequence
    b: int  # sequences decoded together
    n_kv: int  # KV cache cells the run needs
    t_pp_s: float  # prompt processing time
    s_pp_tok_s: float  # prompt tokens / t_pp_s
    t_tg_s: float  # generation time
    s_tg_tok_s: float  # generated tokens / t_tg_s
    t_s: float  # t_pp_s + t_tg_s
    s_tok_s: float  # (prompt + generated tokens) / t_s


@dataclass(frozen=True)
class LlamaCppRun:
    threads: int
    row: BatchedBenchRow
    argv: list[str]
    wall_s: float  # the whole process, model load included
    settings: dict[str, int]  # what the binary says it ran with: n_kv_max, n_batch, n_threads...

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, **asdict(self.row), "argv": self.argv, "wall_s": self.wall_s,
                "settings": self.settings}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """Every result row of ``llama-batched-bench``'s Markdown table in ``text`` (its whole output:
    log lines around the table are skipped). ValueError when there is no table or a row is broken."""
    lines = text.splitlines()
    header: list[str] | None = None
    rows: list[BatchedBenchRow] = []
    for number, line in enumerate(lines, 1):
        if not line.lstrip().startswith("|"):
            if header is not None and rows:
                break  # the table ended
            continue
        cells = _cells(line)
        if header is None:
            if set(_COLUMNS) <= set(cells):
                header = cells
            continue
        if all(set(c) <= {"-", ":"} for c in cells):
            continue  # the rule under the header
        if len(cells) != len(header):
            raise ValueError(f"llama-batched-bench output line {number} has {len(cells)} cells, the header "
                             f"{len(header)}: {line.strip()!r}")
        values: dict[str, Any] = {}
        for name, cell in zip(header, cells):
            field = _COLUMNS.get(name)
            if field is None:
                continue
            try:
                values[field] = int(cell) if field in _INT_FIELDS else float(cell)
            except ValueError:
                raise ValueError(f"llama-batched-bench output line {number}: {name} is {cell!r}, "
                                 "not a number") from None
        rows.append(BatchedBenchRow(**values))
    if header is None:
        raise ValueError("no llama-batched-bench result table (a | PP | TG | B | ... header) in its output")
    return rows


_SETTINGS_LINE = re.compile(r"^llama_batched_bench: (n_kv_max = .*)$")


def parse_settings(text: str) -> dict[str, int]:
    """The settings line above the table (``llama_batched_bench: n_kv_max = 1024, n_batch = 96,
    ...``) as a dict; the context it reports may be larger than asked (llama.cpp rounds it up)."""
    for line in text.splitlines():
        m = _SETTINGS_LINE.match(line.strip())
        if m:
            return {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+)", m.group(1))}
    return {}


# GGUF metadata value types (the GGUF file format): fixed-size ones by struct code, then string,
# array, and the 64-bit ones.
_GGUF_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_SHAPE_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}


def gguf_shape(path: str | os.PathLike) -> dict[str, Any]:
    """The architecture and shape a GGUF file's metadata states (``general.architecture`` and
    ``<arch>.block_count``, ``embedding_length``, ``feed_forward_length``, ``attention.head_count``).
    ValueError when the file is not GGUF."""
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: the GGUF metadata ends early")
            return struct.unpack("<" + fmt, data)[0]

        def read_string() -> str:
            return f.read(read("Q")).decode("utf-8", errors="replace")

        def read_value(kind: int) -> Any:
            if kind in _GGUF_FIXED:
                return read(_GGUF_FIXED[kind])
            if kind == _GGUF_STRING:
                return read_string()
            if kind == _GGUF_ARRAY:
                item, count = read("I"), read("Q")
                if item in _GGUF_FIXED:  # skipped whole: token ids, scores
                    f.seek(count * struct.calcsize("<" + _GGUF_FIXED[item]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        read_value(item)
                return None
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I")  # version
        read("Q")  # tensor count
        found: dict[str, Any] = {}
        for _ in range(read("Q")):
            key = read_string()
            value = read_value(read("I"))
            if key == "general.architecture" or key.split(".", 1)[-1] in _SHAPE_KEYS:
                found[key] = value
    arch = found.get("general.architecture")
    shape = {name: found[f"{arch}.{name}"] for name in _SHAPE_KEYS if f"{arch}.{name}" in found}
    return {"architecture": arch, **shape}


def shape_mismatches(shape: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """Where a GGUF's shape (``gguf_shape``) differs from a Hugging Face config's."""
    return [f"{theirs} {config[theirs]} vs {name} {shape[name]}" for name, theirs in _SHAPE_KEYS.items()
            if name in shape and isinstance(config.get(theirs), int) and shape[name] != config[theirs]]


def check_same_model(gguf: str | os.PathLike, spec: ModelSpec) -> None:
    """ValueError when the GGUF's shape is not the checkpoint's: the two engines would not run the
    same model, and the comparison would mean nothing."""
    shape = gguf_shape(gguf)
    mismatches = shape_mismatches(shape, spec.config)
    if mismatches:
        raise ValueError(f"--gguf {gguf} is not the model {spec.arg} ({shape.get('architecture')}): "
                         f"{', '.join(mismatches)}")


def find_binary(bin_dir: str | os.PathLike) -> Path:
    """``bin_dir/llama-batched-bench`` (or ``bin_dir`` itself when it is that file), executable."""
    path = Path(bin_dir)
    if path.is_dir():
        path = path / BINARY
    if not path.is_file():
        raise FileNotFoundError(f"no {BINARY} at {path} (build it with loadgen/peers.sh DIR llamacpp)")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is not executable")
    return path.resolve()


def batched_bench_argv(binary: Path, gguf: Path, num_requests: int, prompt_len: int, output_len: int,
                       threads: int) -> list[str]:
    """The command for one run. The context holds every sequence whole (N_KV = N * (P + G));
    flash attention on, as mqinfer's attention is fused too."""
    ctx = num_requests * (prompt_len + output_len)
    batch = min(DEFAULT_BATCH, ctx)
    return [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", str(batch), "-ub", str(min(DEFAULT_UBATCH, batch)),
            "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(num_requests), "-t", str(threads),
            "-tb", str(threads), "-fa", "on"]


def run_batched_bench(binary: Path, gguf: Path, num_requests: int, prompt_len: int, output_len: int,
                      threads: int, timeout_s: float) -> LlamaCppRun:
    """One ``llama-batched-bench`` run and its row for (P, G, N); RuntimeError with the output's
    tail when it fails or prints no such row."""
    argv = batched_bench_argv(binary, gguf, num_requests, prompt_len, output_len, threads)
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"llama-batched-bench -t {threads} ran past {timeout_s:.0f}s (--timeout-s)") from None
    wall = time.monotonic() - started
    tail = proc.stdout[-2000:]
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench -t {threads} exited with {proc.returncode}; last output:\n{tail}")
    try:
        rows = parse_batched_bench(proc.stdout)
    except ValueError as exc:
        raise RuntimeError(f"{exc}; last output:\n{tail}") from None
    for row in rows:
        if (row.pp, row.tg, row.b) == (prompt_len, output_len, num_requests):
            return LlamaCppRun(threads, row, argv, wall, parse_settings(proc.stdout))
    raise RuntimeError(f"llama-batched-bench -t {threads} printed no row for PP {prompt_len}, TG {output_len}, "
                       f"B {num_requests} (it skips runs that do not fit its context); last output:\n{tail}")


def best_run(runs: list[LlamaCppRun]) -> LlamaCppRun:
    """The thread count with the most tokens per second."""
    return max(runs, key=lambda r: r.row.s_tok_s)


# ------------------------------------------------------------------ as a peer of `mqinfer bench`
def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's llama.cpp flags (None: nothing). Only the fixed workload
    has llama-batched-bench's shape, and only offline throughput compares with its S."""
    if LLAMACPP not in (args.compare or []):
        for flag, value in (("--llamacpp-bin", args.llamacpp_bin), ("--gguf", args.gguf),
                            ("--llamacpp-threads", args.llamacpp_threads)):
            if value is not None:
                return f"{flag} applies to --compare llamacpp only"
        return None
    if args.workload != "fixed":
        return (f"--compare llamacpp needs --workload fixed (llama-batched-bench runs N requests of exactly P "
                f"prompt and G generated tokens), not {args.workload}")
    if args.mode != "offline":
        return "--compare llamacpp compares offline throughput; leave out --mode online"
    if not args.llamacpp_bin or not (args.gguf or default_gguf(args.model)):
        return ("--compare llamacpp needs --llamacpp-bin DIR (with llama-batched-bench) and --gguf FILE (not needed "
                "for a --model shape such as 0.5b, written with its GGUF)")
    try:
        find_binary(args.llamacpp_bin)
    except FileNotFoundError as exc:
        return str(exc)
    if args.gguf and not Path(args.gguf).is_file():
        return f"--gguf {args.gguf}: no such file"
    return None


def default_gguf(model: str | None) -> str | None:
    """The GGUF that goes with ``--model``: a shape name's (``checkpoint.SHAPES``; written with its
    checkpoint), or the one a checkpoint folder holds beside its safetensors; None otherwise."""
    from mqinfer.loadgen.checkpoint import GGUF_NAME, SHAPES, shape_checkpoint_dir

    if model in SHAPES and model != "standard":
        return str(shape_checkpoint_dir(model) / GGUF_NAME)
    if model and (Path(model) / GGUF_NAME).is_file():
        return str(Path(model) / GGUF_NAME)
    return None


def thread_counts(args: argparse.Namespace) -> list[int]:
    """``--llamacpp-threads``, or 1 and the number of cores this process may run on."""
    if args.llamacpp_threads:
        return args.llamacpp_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sorted({1, cores})


def all_token_rate(timings: list[RequestTiming], span_s: float) -> float:
    """Prompt plus generated tokens of the requests that finished without error, per second of
    span: what llama-batched-bench's S column counts."""
    tokens = sum(t.prompt_tokens + t.counted_tokens for t in timings if t.ok)
    return tokens / span_s if span_s > 0 else 0.0


def compare(args: argparse.Namespace, spec: ModelSpec, timings: list[RequestTiming],
            ours: RunSummary | None) -> dict[str, Any]:
    """``llama-batched-bench`` once per thread count on the fixed workload's shape: its rows, the
    fastest thread count and, after an offline run of mqinfer (``ours``, ``timings``), mqinfer's
    prompt + generated tokens per second over its span beside them."""
    binary, gguf = find_binary(args.llamacpp_bin), Path(args.gguf).resolve()
    runs = []
    for threads in thread_counts(args):
        log(f"llama.cpp: llama-batched-bench -npp {args.prompt_len} -ntg {args.output_len} -npl "
            f"{args.num_requests} -t {threads}")
        run = run_batched_bench(binary, gguf, args.num_requests, args.prompt_len, args.output_len, threads,
                                args.timeout_s)
        log(f"llama.cpp -t {threads}: {run.row.s_tok_s:.1f} tok/s (prompt + generated) over {run.row.t_s:.2f}s")
        runs.append(run)
    best = best_run(runs)
    result: dict[str, Any] = {"binary": str(binary), "gguf": str(gguf), "gguf_shape": gguf_shape(gguf),
                              "num_requests": args.num_requests,
                              "prompt_len": args.prompt_len, "output_len": args.output_len,
                              "runs": [r.to_dict() for r in runs], "best_threads": best.threads, "mqinfer": None}
    if ours is not None:
        result["mqinfer"] = {"span_s": ours.span_s, "tok_s": all_token_rate(timings, ours.span_s),
                             "num_errors": ours.num_errors}
    return result
