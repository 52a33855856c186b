"""Stand-ins for llama.cpp in tests: a GGUF file with metadata only, and a script in the place of
llama-batched-bench that prints a table of the real layout for the shape it is asked for."""

from __future__ import annotations

import stat
import struct
import sys
from pathlib import Path

from mqinfer.loadgen import llamacpp


def write_gguf(path: Path, metadata: dict) -> Path:
    """A GGUF file holding ``metadata`` (strings, ints, lists of strings) and no tensors."""
    def string(s: str) -> bytes:
        data = s.encode()
        return struct.pack("<Q", len(data)) + data

    out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(metadata))]
    for key, value in metadata.items():
        out.append(string(key))
        if isinstance(value, str):
            out.append(struct.pack("<I", 8) + string(value))
        elif isinstance(value, int):
            out.append(struct.pack("<II", 4, value))
        else:  # an array of strings, like the tokenizer's tokens
            out.append(struct.pack("<IIQ", 9, 8, len(value)) + b"".join(string(v) for v in value))
    path.write_bytes(b"".join(out))
    return path


def tiny_llama_gguf(path: Path, config: dict) -> Path:
    return write_gguf(path, {
        "general.architecture": "llama", "general.name": "test",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(50)],
        "llama.block_count": config["num_hidden_layers"], "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"], "llama.context_length": 2048})


# Prints a table for the -npp/-ntg/-npl it is given, S = 40 tok/s per thread (the best is the
# most threads), after writing its arguments and OMP_WAIT_POLICY next to itself.
STAND_IN = """#!{python}
import json, os, sys
args = sys.argv[1:]
flag = dict(zip(args[::2], args[1::2]))
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": args, "omp": os.environ.get("OMP_WAIT_POLICY")}}) + "\\n")
if os.environ.get("STAND_IN_FAIL"):
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
pp, tg, b, t = int(flag["-npp"]), int(flag["-ntg"]), int(flag["-npl"]), int(flag["-t"])
if os.environ.get("STAND_IN_SMALL_CONTEXT"):
    b += 1  # a row for another shape only
s = 40.0 * t
total = b * (pp + tg) / s
print("llama_batched_bench: n_kv_max = %d, n_batch = 2048, n_ubatch = 512, flash_attn = 1, n_threads = %d" % (
    int(flag["-c"]), t))
print("")
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
print("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |" % (
    pp, tg, b, b * (pp + tg), total / 2, 2 * b * pp / total, total / 2, 2 * b * tg / total, total, s))
"""


def make_stand_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / llamacpp.BINARY
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder
