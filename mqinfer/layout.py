"""How many worker processes, and how many model threads each, when ``--workers auto``.

Shared by ``mqinfer run`` and ``mqinfer bench`` so that the benchmark measures the layout a user
gets. The rule, measured in BENCHMARKS.md: small models on a CPU run fastest as one
single-threaded worker per core (each thread streams its own copy of small weight matrices, where
two threads on one worker split every matmul and wait for each other on every layer); a GPU gets
one worker; half the available memory bounds how many copies of the model are loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mqinfer.workers.devices import usable_cores


def parse_workers(text: str) -> int | str:
    """A ``--workers`` value: ``auto`` or an integer >= 1 (ValueError otherwise)."""
    text = str(text).strip().lower()
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected auto or an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected auto or an integer >= 1, got {value}")
    return value


def model_bytes(model: str) -> int:
    """About what one worker's copy of the weights takes in memory: float32 where stored smaller
    (a CPU without native half precision computes in float32); a GGUF file's quantized blocks
    grow up to 4 times when dequantized."""
    if model == "tiny":
        return 16 << 20
    path = Path(model)
    if path.is_file():
        return 4 * path.stat().st_size
    return 2 * sum(f.stat().st_size for f in path.glob("*.safetensors"))


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cuda_available() -> bool:
    """Without an NVIDIA driver there is no CUDA device: no need to import torch to find out."""
    if not Path("/proc/driver/nvidia").exists() or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_layout(opts: dict, *, cores: int | None = None, gpu: bool | None = None,
                  memory: int | None = None) -> tuple[int, int | None, str]:
    """(workers, threads per worker, why) for ``opts`` (``workers``: a count or "auto",
    ``num_threads``, ``device``, ``shards``, ``model``, optionally ``tensor_parallel_size``). An
    explicit worker count wins."""
    if opts["workers"] != "auto":
        return opts["workers"], opts["num_threads"], "--workers"
    if gpu is None:
        gpu = opts["device"] in ("auto", "cuda") and cuda_available()
    if gpu:
        return max(1, opts["shards"]), opts["num_threads"], "a GPU: one worker"
    cores = cores or usable_cores()
    threads = opts["num_threads"] or 1
    ranks = opts.get("tensor_parallel_size") or 1  # each rank of a tensor-parallel worker is a process
    workers = max(1, cores // (threads * ranks))
    memory = available_memory() if memory is None else memory
    why = f"{cores} cores, {threads} thread{'s' if threads > 1 else ''} per worker"
    if ranks > 1:
        why = f"{cores} cores, {ranks} ranks of {threads} thread{'s' if threads > 1 else ''} per worker"
    if memory:
        fits = max(1, (memory // 2) // max(1, model_bytes(opts["model"])))
        if fits < workers:
            workers, why = fits, why + f", {fits} model copies fit in half the free memory"
            threads = opts["num_threads"] or max(1, cores // workers)
    return max(workers, opts["shards"]), threads, why


__all__ = ["available_memory", "choose_layout", "cuda_available", "model_bytes", "parse_workers", "usable_cores"]
