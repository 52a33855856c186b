"""How a CPU's cores go to workers under ``--workers auto`` by the model's size: one single-threaded
worker per core for small models, one worker with every core for models whose weights stream
from memory at every step.

Why (BENCHMARKS.md, measured on 2 cores). A decoding step reads every weight once, whatever its
batch. Workers of one thread each read their own copy for their own share of the sequences, so
W workers read the weights W times for one token of every sequence; one worker of W threads reads
them once. Where the arithmetic, not the memory, bounds a step, single-threaded workers win (no
thread waits for another at every layer); where reading the weights does, one worker with every
core wins. Which one bounds it depends on the CPU: with AMX tiles (bfloat16 at about 1 TFLOP/s a
core) a copy of SmolLM2-135M (269 MB) already streams (one worker of 2 threads 1.27x two workers
of one), the standard benchmark model (110 MB) does not (even, 0.94x); without them (an AMD EPYC
computing SmolLM2 in float32) two workers of one thread won at 135M (1.17x). So the threshold is
``WEIGHTS_STREAMED_BYTES_AMX`` on a CPU with AMX and ``WEIGHTS_STREAMED_BYTES`` elsewhere (the
0.5B and 1.5B shapes, 988 MB and 3.1 GB, are above both: 1.32x and 1.29x for one worker).
"""

from __future__ import annotations

from pathlib import Path

# A model copy at least this large (its weights in half precision) gets one worker with every core;
# on a CPU with AMX tiles, at least the second.
WEIGHTS_STREAMED_BYTES = 512 << 20
WEIGHTS_STREAMED_BYTES_AMX = 192 << 20


def cpu_has_amx() -> bool:
    """Whether the CPU has AMX bfloat16 tiles (``amx_bf16`` in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


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


def cpu_layout_for_model(cores: int, model: str, amx: bool | None = None) -> tuple[int, int, str] | None:
    """(workers, threads per worker, why) for a model too large for a copy per core: one worker
    with all ``cores``; None where one single-threaded worker per core is the better layout.
    ``amx``: whether the CPU has AMX tiles (default: /proc/cpuinfo says)."""
    size = half_precision_bytes(model)
    amx = cpu_has_amx() if amx is None else amx
    if cores < 2 or size < (WEIGHTS_STREAMED_BYTES_AMX if amx else WEIGHTS_STREAMED_BYTES):
        return None
    return 1, cores, (f"{cores} cores, one worker with {cores} threads: its weights ({size / 2**20:.0f} MiB) "
                      f"stream from memory at every step, once for all its sequences")


__all__ = ["WEIGHTS_STREAMED_BYTES", "WEIGHTS_STREAMED_BYTES_AMX", "cpu_has_amx", "cpu_layout_for_model",
           "half_precision_bytes"]
