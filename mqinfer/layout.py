"""How many worker processes, and how many model threads each, when ``--workers auto``.

Shared by ``mqinfer run`` and ``mqinfer bench`` so that the benchmark measures the layout a user
gets. The rule, measured in BENCHMARKS.md: small models on a CPU run fastest as one
single-threaded worker per core (each thread streams its own copy of small weight matrices, where
two threads on one worker split every matmul and wait for each other on every layer); half the
available memory bounds how many copies of the model are loaded. On CUDA a worker owns whole
devices: one worker per group of T x P devices (T = ``--tensor-parallel-size``, P =
``--pipeline-parallel-size`` where that option exists) among the devices it may use
(``--devices``, else every visible one); ``--device cuda:N`` pins the run to one group starting
at device N, so it gets one worker. ``mqinfer run`` then places worker ``i`` on its group
(``mqinfer.workers.devices.worker_devices``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mqinfer.cpu_layout import cpu_layout_for_model
from mqinfer.workers import devices as device_rules
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
    """Whether torch sees a CUDA device. Without an NVIDIA driver there is none, and torch is not
    imported just to find that out; where torch is already loaded, asking it costs nothing."""
    if "torch" not in sys.modules and (
        not Path("/proc/driver/nvidia").exists() or importlib.util.find_spec("torch") is None
    ):
        return False
    import torch

    return torch.cuda.is_available()


def ranks_per_worker(opts: dict) -> int:
    """Processes (and on CUDA devices) one worker takes: tensor-parallel x pipeline-parallel ranks."""
    return (opts.get("tensor_parallel_size") or 1) * (opts.get("pipeline_parallel_size") or 1)


def wants_cuda(opts: dict) -> bool:
    """Whether the workers run on CUDA: ``cuda``, ``cuda:N``, ``--devices`` (which names CUDA
    devices), or ``auto`` where a CUDA device is visible."""
    device = str(opts.get("device") or "auto")
    if device == "cpu":
        return False
    return device.startswith("cuda") or bool(opts.get("devices")) or cuda_available()


def gpu_layout(opts: dict, count: int) -> tuple[int, str]:
    """(workers, why) on CUDA with ``count`` visible devices: one worker per group of T x P devices
    of the pool (``--devices``, else all of them); ``cuda:N`` is one group. A pool smaller than a
    group still gets one worker, which ``mqinfer run`` then refuses, naming the devices."""
    group = ranks_per_worker(opts)
    size = f"{group} devices (tensor x pipeline ranks)" if group > 1 else "one device"
    device = str(opts.get("device") or "auto")
    if device.startswith("cuda:"):
        return 1, f"--device {device}: one worker on {size}"
    pool = device_rules.device_list(opts.get("devices"))
    if pool is not None:
        usable, where = len(pool), f"--devices {opts['devices']}"
    else:
        usable, where = count, f"{count} visible CUDA device{'s' if count != 1 else ''}"
    return max(1, usable // group), f"{where}, a worker per {size}"


def choose_layout(opts: dict, *, cores: int | None = None, gpu: bool | None = None,
                  memory: int | None = None, gpus: int | None = None) -> tuple[int, int | None, str]:
    """(workers, threads per worker, why) for ``opts`` (``workers``: a count or "auto",
    ``num_threads``, ``device``, ``shards``, ``model``, optionally ``devices``,
    ``tensor_parallel_size`` and ``pipeline_parallel_size``). An explicit worker count wins.
    ``gpu``: whether the workers run on CUDA (default: from ``device`` and ``devices``);
    ``gpus``: how many CUDA devices are visible (default: ``torch.cuda.device_count()``)."""
    if opts["workers"] != "auto":
        return opts["workers"], opts["num_threads"], "--workers"
    if gpu is None:
        gpu = wants_cuda(opts)
    if gpu:
        count = device_rules.cuda_device_count() if gpus is None else gpus
        workers, why = gpu_layout(opts, count)
        return max(workers, opts["shards"]), opts["num_threads"], why
    cores = cores or usable_cores()
    threads = opts["num_threads"] or 1
    ranks = ranks_per_worker(opts)  # each rank of a tensor- or pipeline-parallel worker is a process
    workers = max(1, cores // (threads * ranks))
    memory = available_memory() if memory is None else memory
    why = f"{cores} cores, {threads} thread{'s' if threads > 1 else ''} per worker"
    if ranks > 1:
        why = f"{cores} cores, {ranks} ranks of {threads} thread{'s' if threads > 1 else ''} per worker"
    by_size = cpu_layout_for_model(cores, opts["model"]) if opts["num_threads"] is None and ranks == 1 else None
    if by_size is not None:  # a model too large for a copy per core (mqinfer/cpu_layout.py)
        workers, threads, why = by_size
    if memory:
        fits = max(1, (memory // 2) // max(1, model_bytes(opts["model"])))
        if fits < workers:
            workers, why = fits, why + f", {fits} model copies fit in half the free memory"
            threads = opts["num_threads"] or max(1, cores // workers)
    return max(workers, opts["shards"]), threads, why


__all__ = ["available_memory", "choose_layout", "cuda_available", "gpu_layout", "model_bytes", "parse_workers",
           "ranks_per_worker", "usable_cores", "wants_cuda"]
