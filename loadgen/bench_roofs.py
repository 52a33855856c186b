"""The memory roof of `mqinfer bench`: the machine's copy bandwidth and the bytes a workload must read.

Owns ``measure_copy_bandwidth`` (a STREAM-like copy of arrays larger than the last-level cache,
best of N, all of this process's threads) and ``workload_bytes`` (the least a decoder-only model
must read from memory to serve a workload). Beside the compute ceiling (``matrix_rate``: the
matrix work at the measured matmul rate) it gives the second roof: no system can serve the
workload faster than ``bytes / bandwidth``. A system's share of a roof is that least time over
the time it took.

Bytes counted (the least any engine reads, all requests running at once): every step reads each
decoder weight and the LM head once, whatever its batch; the fewest steps are as many as the
longest output (the prompts' prefill can share the first step); a sequence's step reads the KV
cache of its context so far (its prompt once for the prefill, then prompt + j tokens at its j-th
decoding step). Requests beyond ``max_num_seqs`` run in later waves, each wave reading the weights
again. The embedding lookup reads one row per token and activations stay in cache: neither is
counted. Copy bandwidth is counted as STREAM counts it: bytes read plus bytes written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqinfer.loadgen.matrix_rate import ModelShape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CopyBandwidth:
    bytes_per_s: float  # best run: (read + written bytes) / seconds
    median_bytes_per_s: float
    array_bytes: int
    threads: int


@dataclass(frozen=True)
class WorkloadBytes:
    weight_bytes: int  # one read of the decoder weights and the LM head
    steps: int  # the fewest forward passes: the longest output per wave of requests
    kv_bytes: int  # KV cache reads over the workload
    kv_bytes_per_token: int

    @property
    def total(self) -> int:
        return self.steps * self.weight_bytes + self.kv_bytes


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of cpu0 (sysfs), None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def copy_array_bytes(cache_bytes: int | None) -> int:
    """Each array of the copy: four times the last-level cache, within 256 MiB .. 1 GiB (two such
    arrays are more than any cache a VM reports holds, and leave the machine's memory to others)."""
    target = 4 * cache_bytes if cache_bytes else 1 << 30
    return max(256 << 20, min(1 << 30, target))


def measure_copy_bandwidth(array_bytes: int | None = None, *, best_of: int = 5, repeats: int = 3,
                           threads: int | None = None) -> CopyBandwidth:
    """Bytes per second of ``dst.copy_(src)`` over two arrays of ``array_bytes`` (default: larger
    than the last-level cache, ``copy_array_bytes``), ``repeats`` copies back to back, best of
    ``best_of``: the rate at which this machine streams memory through its cores."""
    import torch

    size = array_bytes or copy_array_bytes(last_level_cache_bytes())
    if size < 4 or best_of < 1 or repeats < 1:
        raise ValueError("array_bytes must be >= 4, best_of and repeats >= 1")
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(size // 4, dtype=torch.float32)
        dst = torch.zeros_like(src)
        dst.copy_(src)  # both arrays faulted in before timing
        rates = []
        for _ in range(best_of):
            t0 = time.perf_counter()
            for _ in range(repeats):
                dst.copy_(src)
            rates.append(2.0 * src.numel() * 4 * repeats / (time.perf_counter() - t0))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    rates.sort()
    return CopyBandwidth(rates[-1], rates[len(rates) // 2], src.numel() * 4, used)


def weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """One read of the decoder layers' matrices and the LM head: 8-bit weights take a byte each
    (w8a8 quantizes the head as well), otherwise ``dtype``'s size."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    size = _DTYPE_BYTES[dtype]
    layer = 1 if quantization in ("w8a8", "w8a16") else size
    head = 1 if quantization == "w8a8" else size
    return shape.layer_params * layer + shape.head_params * head


def workload_bytes(config: Mapping[str, Any], requests: Sequence[Mapping[str, Any]], *, dtype: str,
                   quantization: str = "none", kv_cache_dtype: str = "auto", max_num_seqs: int = 256) -> WorkloadBytes:
    """The least bytes read from memory to serve ``requests`` (``prompt_token_ids``, ``max_tokens``)."""
    from mqinfer.kernels.kv_quant import kv_bytes_per_token

    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    shape = ModelShape.from_config(config)
    kv_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, _DTYPE_BYTES[dtype],
                                  kv_cache_dtype)
    steps = 0
    kv_tokens = 0
    for start in range(0, len(requests), max_num_seqs):
        wave = requests[start:start + max_num_seqs]
        steps += max(int(r["max_tokens"]) for r in wave)
        for r in wave:
            p, n = len(r["prompt_token_ids"]), int(r["max_tokens"])
            # The prefill reads the prompt's KV once; decoding step j (1..n-1) reads p + j tokens.
            kv_tokens += p + (n - 1) * p + (n - 1) * n // 2
    return WorkloadBytes(weight_bytes(shape, dtype, quantization), steps, kv_tokens * kv_token, kv_token)


__all__ = ["CopyBandwidth", "WorkloadBytes", "copy_array_bytes", "last_level_cache_bytes",
           "measure_copy_bandwidth", "weight_bytes", "workload_bytes"]
