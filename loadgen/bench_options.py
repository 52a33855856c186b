"""The flags of `mqinfer bench` and the argparse types the load generators share.

Kept apart from the benchmark itself so that building the `mqinfer` command line imports nothing
heavy (no numpy, no torch): `mqinfer --help` works on a producer-only install.
"""

from __future__ import annotations

import argparse
import math

from mqinfer.layout import parse_workers

HALF = "half"  # --rate: half the throughput of an offline run of the same requests
AUTO = "auto"  # --max-wait-ms: the adaptive batcher
WORKLOADS = ("standard", "uniform", "lognormal", "shared-prefix", "fixed")
HF = "hf"  # --compare: transformers on the same checkpoint
LLAMACPP = "llamacpp"  # --compare: llama.cpp's llama-batched-bench on a GGUF of the same weights
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
PEERS = (HF, LLAMACPP, UNQUANTIZED, INPUT_ORDER, UNSPECULATIVE, OTHER_LAYOUT)
# The --compare entries that rerun mqinfer with one thing changed, and their systems' names.
VARIANTS = {UNQUANTIZED: "mqinfer offline, unquantized", UNSPECULATIVE: "mqinfer offline, unspeculative",
            INPUT_ORDER: "mqinfer offline, input order", OTHER_LAYOUT: "mqinfer offline, other layout"}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _workers(text: str) -> int | str:
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


def _wait_ms(text: str) -> float | str:
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
        value = _wait_ms(item)
        if value not in values:
            values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated waits (milliseconds or auto), got {text!r}")
    return values


def _length_range(text: str) -> tuple[int, int]:
    values = positive_int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return values[0], values[1]


def _length_or_range(text: str) -> int | tuple[int, int]:
    """One length (the fixed workload's) or a LO,HI range (the others'); which one a workload
    needs is checked once the workload is known."""
    if "," not in text:
        return positive_int(text.strip())
    return _length_range(text)


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


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` flags, on ``parser`` (a subcommand parser of the mqinfer CLI, or our own)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="standard",
                   help="Length distribution of the requests (default: standard = prompts uniform "
                        "16..256 tokens, outputs uniform 16..128). fixed: every request exactly --prompt-len P "
                        "random prompt tokens and --output-len G generated, like llama-batched-bench -npp P "
                        "-ntg G -npl N.")
    g.add_argument("--num-requests", type=positive_int, default=256, metavar="N", help="Requests (default: 256).")
    g.add_argument("--prompt-len", type=_length_or_range, default=None, metavar="P|LO,HI",
                   help="Prompt lengths: one length for fixed, the uniform range or the log-normal bounds "
                        "(not for standard).")
    g.add_argument("--output-len", type=_length_or_range, default=None, metavar="G|LO,HI",
                   help="Output lengths (max_tokens): one length for fixed, the uniform range or the log-normal "
                        "bounds (not for standard).")
    g.add_argument("--num-prefixes", type=positive_int, default=None, metavar="N",
                   help="shared-prefix: distinct prefixes (default: one per 16 requests).")
    g.add_argument("--prefix-len", type=_length_range, default=None, metavar="LO,HI",
                   help="shared-prefix: prefix lengths, uniform in LO..HI tokens (default: 256,1024). Its "
                        "suffixes are 8..64 tokens and its outputs 16..64 unless --output-len says otherwise; the "
                        "requests come shuffled, as a bulk job's rows do when nobody sorted them.")
    g.add_argument("--seed", type=int, default=0, help="Workload seed (default: 0).")
    g.add_argument("--model", default=None, metavar="M",
                   help="Hugging Face checkpoint folder (config.json and safetensors; a tokenizer is optional, "
                        "prompts are token ids), `tiny`, or a shape of random weights: 0.5b or 1.5b (Qwen2.5's "
                        "shapes as Llamas, written once under ~/.cache/mqinfer with a bf16 GGUF of the same "
                        "weights for --compare llamacpp) (default: the standard benchmark checkpoint, created "
                        "once under ~/.cache/mqinfer/standard-llama).")

    g = parser.add_argument_group("run")
    g.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline: submit everything at once; online: Poisson arrivals at --rate (default: offline).")
    g.add_argument("--rate", type=_rate_list, default=None, metavar="R[,R...]",
                   help="Online mode: requests per second; several values run a sweep (latency against offered "
                        "load). `half` runs the offline mode first and offers half its measured request rate "
                        "(the online latency goal), e.g. --rate half or --rate 2,half.")
    g.add_argument("--compare-wait", type=_wait_list, default=None, metavar="W[,W...]",
                   help="Online mode: run the rates once per batcher wait (milliseconds or auto, e.g. 10,auto), "
                        "each with fresh workers, and print p99/p50 TTFT and throughput side by side.")
    g.add_argument("--workers", type=_workers, default="auto", metavar="N|auto",
                   help="Worker processes (default: auto = what `mqinfer run` starts: on a CPU one "
                        "single-threaded worker per core, as many as half the free memory holds, or one worker with "
                        "every core for a model of 512 MiB or more in half precision; one on a GPU).")
    g.add_argument("--order", choices=("prefix", "input"), default="prefix",
                   help="Offline mode: the order requests enter the stream, as `mqinfer run --order` (default: "
                        "prefix = requests sharing a prompt prefix next to each other; input = the workload's).")
    g.add_argument("--shards", type=positive_int, default=1, metavar="N",
                   help="Offline mode: spread requests over N shard streams, worker i reading shard i mod N "
                        "(default: 1, every worker reads one stream).")
    g.add_argument("--route", choices=("prefix", "id"), default="prefix",
                   help="With --shards N: send requests to shards by their leading prompt (prefix, default) or "
                        "by a hash of their id (id).")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="Keep the workers' output (results/, costs/, logs) here (default: a temporary folder, "
                        "removed afterwards).")
    g.add_argument("--timeout-s", type=float, default=3600.0, metavar="S",
                   help="Give up on a run after this long (default: 3600).")
    g.add_argument("--idle-exit-s", type=float, default=120.0, metavar="S",
                   help="Passed to the workers, so that none outlives an interrupted bench (default: 120).")
    g.add_argument("--skip-engine", action="store_true",
                   help="Run only the --compare baselines and the matrix rate, not mqinfer.")

    g = parser.add_argument_group("comparison and output")
    g.add_argument("--compare", type=_peer_list, default=None, metavar="PEER[,PEER]",
                   help="Also run peers: hf = transformers on the same checkpoint and requests (static batching "
                        "at --hf-batch-sizes, the best counts, and its continuous batching); llamacpp = "
                        "llama-batched-bench on --gguf (--workload fixed only); unquantized = mqinfer again "
                        "with --quantization none --kv-cache-dtype auto (to measure either); input-order = "
                        "mqinfer again with --order input --route id (what prefix order and routing are worth); "
                        "unspeculative = mqinfer again with --speculative none (what --speculative gains or costs); "
                        "other-layout = mqinfer again with one worker of every core where it ran single-threaded "
                        "workers, else with one single-threaded worker per core (CPU); e.g. hf,llamacpp.")
    g.add_argument("--rounds", type=positive_int, default=1, metavar="R",
                   help="With --compare unquantized, unspeculative, input-order or other-layout (offline): run mqinfer "
                        "and each "
                        "such variant R times, alternating which goes first (round 1 mqinfer first, round 2 the "
                        "variant first, ...), and report every round's ratio and their median: on a shared or "
                        "noisy machine one pair of runs can differ by more than the effect measured. The table "
                        "shows round 1 (default: 1).")
    g.add_argument("--hf-batch-sizes", type=positive_int_list, default=[16, 64, 256], metavar="B[,B...]",
                   help="Static batch sizes for --compare hf (default: 16,64,256).")
    g.add_argument("--hf-max-batch-tokens", type=positive_int, default=None, metavar="T",
                   help="Tokens per step of transformers' continuous batching (default: its own choice).")
    g.add_argument("--llamacpp-bin", default=None, metavar="DIR",
                   help="Folder with llama.cpp's llama-batched-bench (build it with loadgen/peers.sh).")
    g.add_argument("--gguf", default=None, metavar="FILE",
                   help="The model for llama.cpp, the same weights as --model (e.g. bf16 from "
                        "convert_hf_to_gguf.py --outtype bf16; default for a --model shape or a folder holding "
                        "model-bf16.gguf: that file).")
    g.add_argument("--llamacpp-threads", type=positive_int_list, default=None, metavar="T[,T...]",
                   help="llama.cpp thread counts, one run each; the ratio is against the fastest (default: 1 and "
                        "the number of cores).")
    g.add_argument("--matrix-size", type=positive_int, default=2048, metavar="N",
                   help="Side of the square matmul that measures the matrix rate (default: 2048).")
    g.add_argument("--plot", default=None, metavar="DIR", help="Write PNG charts here (needs matplotlib).")
    g.add_argument("--json", default=None, metavar="FILE", help="Write every figure of the run as JSON.")

    g = parser.add_argument_group("engine flags passed to the workers")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="Weights and activations, for mqinfer and transformers alike (default: auto = the "
                        "checkpoint's own, or float32 on a CPU without native bfloat16/float16 matmul).")
    g.add_argument("--quantization", default="none", choices=("none", "w8a8", "w8a16"),
                   help="8-bit weights for mqinfer's workers (see `mqinfer worker --help`); transformers and "
                        "llama.cpp are not affected (default: none).")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="Where the workers run the model; transformers runs on cuda when this is cuda "
                        "(default: auto).")
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
                   help="KV cache storage of the workers: auto (the model's dtype), int8 or fp8 (default: auto).")
    g.add_argument("--speculative", default="none", choices=("none", "ngram", "self", "draft"),
                   help="Speculative decoding of the workers (see `mqinfer worker --help`; default: none).")
    g.add_argument("--draft-layers", type=positive_int, default=None, metavar="L",
                   help="With --speculative self: the draft's layers (default: the worker's, half the model's).")
    g.add_argument("--draft-model", default=None, metavar="M",
                   help="With --speculative draft: the draft checkpoint, a folder or .gguf file with the model's "
                        "tokenizer (see loadgen/draft_checkpoint.py).")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="With --speculative: tokens proposed per request and step (default: the worker's).")
    g.add_argument("--speculative-max-batched-tokens", type=int, default=None, metavar="T",
                   help="With --speculative: propose only while a step holds at most this many tokens (default: "
                        "the worker's).")
    g.add_argument("--speculative-policy", default=None, choices=("adaptive", "fixed"),
                   help="With --speculative: how many proposals each request runs (see `mqinfer worker "
                        "--help`; default: the worker's, adaptive).")
    for flag, meta, text in (
        ("--max-num-seqs", "S", "Requests running at once, at most."),
        ("--max-num-batched-tokens", "T", "Token budget of one engine step."),
        ("--num-kv-blocks", "K", "KV cache blocks."),
        ("--block-size", "B", "Tokens per KV cache block."),
        ("--max-batch", "N", "Dual-threshold batcher: batch size threshold."),
        ("--num-threads", "N", "CPU threads of each worker's model (with --workers N on N cores: 1)."),
    ):
        g.add_argument(flag, type=positive_int, default=None, metavar=meta, help=f"{text} (default: the worker's).")
    g.add_argument("--max-wait-ms", type=_wait_ms, default=None, metavar="T",
                   help="Dual-threshold batcher: wait threshold in milliseconds, or auto (default: the worker's).")
