"""The memory roofs of ``gpu_bench``: the device's bandwidth and how near a decode step comes to it.

Owns ``device_bandwidth`` (on CUDA a timed device-to-device copy of arrays far larger than the
GPU's cache, on a CPU ``bench_roofs.measure_copy_bandwidth``; both count bytes read plus bytes
written, as STREAM does), ``decode_step_seconds`` (the median time of one decode-only engine
step at a given batch and context, the engine driven directly: no Redis, no workers) and
``decode_roof`` (the least time such a step can take: every weight and the batch's KV cache read
once at that bandwidth, and what share of it the measured step reached).

A decode step of ``batch`` sequences with ``context`` tokens each must read the decoder weights and
the LM head once (``bench_roofs.weight_bytes``) and ``batch * context`` tokens of KV cache; the
embedding rows and the activations are too small to count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping

from mqinfer.loadgen.bench_roofs import measure_copy_bandwidth, weight_bytes
from mqinfer.loadgen.matrix_rate import ModelShape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DeviceBandwidth:
    device: str
    bytes_per_s: float  # best of the timed copies: (read + written bytes) / seconds
    array_bytes: int
    method: str  # how it was measured


@dataclass(frozen=True)
class DecodeRoof:
    batch: int
    context: int  # tokens of KV cache each sequence reads in the step
    step_s: float  # median measured step
    bytes_read: int  # weights once + the batch's KV cache
    roof_s: float  # bytes_read / bandwidth
    bandwidth_share: float  # bytes_read / step_s / bandwidth (1.0 = at the roof)
    over_roof: float  # step_s / roof_s (1.0 = at the roof)


def cuda_copy_bandwidth(array_bytes: int = 1 << 30, best_of: int = 5, repeats: int = 10) -> DeviceBandwidth:
    """Device-to-device ``copy_`` of two ``array_bytes`` arrays on CUDA device 0, timed with CUDA
    events, best of ``best_of`` runs of ``repeats`` copies."""
    import torch

    src = torch.ones(array_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    rates = []
    for _ in range(best_of):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        rates.append(2.0 * src.numel() * 4 * repeats / seconds)
    del src, dst
    torch.cuda.empty_cache()
    return DeviceBandwidth("cuda", max(rates), array_bytes, f"cuda copy_ of 2 x {array_bytes >> 20} MiB, CUDA events")


def device_bandwidth(device: str, array_bytes: int | None = None) -> DeviceBandwidth:
    """The memory bandwidth of ``device`` (``cuda`` or ``cpu``) as a measured copy."""
    if device == "cuda":
        return cuda_copy_bandwidth(array_bytes or 1 << 30)
    measured = measure_copy_bandwidth(array_bytes)
    return DeviceBandwidth("cpu", measured.bytes_per_s, measured.array_bytes,
                           f"bench_roofs copy of 2 x {measured.array_bytes >> 20} MiB, {measured.threads} threads")


def step_bytes(config: Mapping[str, Any], dtype: str, batch: int, context: int) -> int:
    """Bytes one decode step must read: the weights once and ``batch * context`` tokens of KV cache
    (in ``dtype``: the engine's default KV cache)."""
    from mqinfer.kernels.kv_quant import kv_bytes_per_token

    shape = ModelShape.from_config(config)
    kv_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, _DTYPE_BYTES[dtype])
    return weight_bytes(shape, dtype) + batch * context * kv_token


def decode_roof(config: Mapping[str, Any], dtype: str, batch: int, context: int, step_s: float,
                bandwidth: DeviceBandwidth) -> DecodeRoof:
    """A measured decode step against its memory roof."""
    if step_s <= 0 or bandwidth.bytes_per_s <= 0:
        raise ValueError("step_s and the bandwidth must be > 0")
    need = step_bytes(config, dtype, batch, context)
    roof = need / bandwidth.bytes_per_s
    return DecodeRoof(batch, context, step_s, need, roof, roof / step_s, step_s / roof)


def build_engine(model: str, device: str, dtype: str, max_num_seqs: int, max_model_len: int):
    """An ``LLMEngine`` for timing steps directly: no prefix caching (every sequence reads its own
    KV), room for ``max_num_seqs`` sequences at once."""
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    defaults = EngineConfig()
    config = EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(defaults.max_num_batched_tokens, max_num_seqs),
                          max_model_len=max_model_len, enable_prefix_caching=False)
    return LLMEngine(config)


def decode_step_seconds(engine, batch: int, context: int, steps: int = 20) -> float:
    """Median seconds of a decode-only step of ``batch`` sequences whose prompts are ``context``
    tokens long (they are prefilled first, and those steps are not timed). Each step returns its
    sampled tokens to the host, so on CUDA the time is the device's, not just the launch's."""
    from mqinfer.scheduler.request import SamplingParams

    vocab = engine.info.vocab_size
    for b in range(batch):
        ids = [3 + (b * 31 + i * 7) % (vocab - 3) for i in range(context)]
        engine.add_request(f"roof-{batch}-{b}", ids,
                           SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    # Prefill (in as many chunks as the token budget needs) until every sequence has its first
    # token; those steps, and one decode step of warm-up, are not timed.
    started: set[str] = set()
    while len(started) < batch:
        result = engine.step()
        started.update(o.request_id for o in result.outputs if o.output_token_ids)
    engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)

