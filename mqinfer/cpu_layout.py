"""How a CPU's cores go to workers under ``--workers auto`` by the model's size: one single-threaded
worker per core for small models, one worker with every core for models whose weights stream
from memory at every step.

Why (BENCHMARKS.md, measured on 2 cores). A decoding step reads every weight once, whatever its
batch. Workers of one thread each read their own copy for their own share of the sequences, so
W workers read the weights W times for one token of every sequence; one worker of W threads reads
them once. While the weights fit in the caches beside each other that costs nothing and
single-threaded workers win (no thread waits for another at every layer: SmolLM2-135M, 269 MB in
bfloat16); once a copy is larger than that, the memory bus is the bottleneck and one worker with
every core wins (the 0.5B shape, 988 MB). ``WEIGHTS_STREAMED_BYTES`` sits between the two.
"""

from __future__ import annotations

from pathlib import Path

# A model copy at least this large (its weights in half precision) gets one worker with every core.
WEIGHTS_STREAMED_BYTES = 512 << 20


def half_precision_bytes(model: str) -> int:
    """About what one copy of ``model``'s weights takes in bfloat16: a checkpoint folder's
    safetensors as stored (benchmark and published checkpoints are half precision), a GGUF
    file's quantized blocks about twice their size once dequantized; the built-in tiny model 8 MB."""
    if model == "tiny":
        return 8 << 20
    path = Path(model)
    if path.is_file():
        return 2 * path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def cpu_layout_for_model(cores: int, model: str) -> tuple[int, int, str] | None:
    """(workers, threads per worker, why) for a model too large for a copy per core: one worker
    with all ``cores``; None where one single-threaded worker per core is the better layout."""
    size = half_precision_bytes(model)
    if cores < 2 or size < WEIGHTS_STREAMED_BYTES:
        return None
    return 1, cores, (f"{cores} cores, one worker with {cores} threads: its weights ({size / 2**20:.0f} MiB) "
                      f"stream from memory at every step, once for all its sequences")


__all__ = ["WEIGHTS_STREAMED_BYTES", "cpu_layout_for_model", "half_precision_bytes"]
