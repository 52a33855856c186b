"""Which device each worker and each tensor-parallel rank runs on.

``--device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ``--devices 0,1,...`` names the CUDA
devices a command may use. ``mqinfer run --workers N`` gives worker ``i`` the ``T`` devices
``pool[(i * T + r) % len(pool)]`` for ranks ``r = 0..T-1`` (``T`` = ``--tensor-parallel-size``,
``pool`` = ``--devices``, else every CUDA device), so with ``T = 1`` worker ``i`` runs on
``cuda:(i mod count)``. Within one worker, rank ``r`` runs on the ``r``-th entry of its
``--devices``, else on ``cuda:(N + r)`` for ``--device cuda:N`` (``N = 0`` for ``cuda``).

The number of CUDA devices comes from :func:`cuda_device_count` only (``torch.cuda.device_count()``),
looked up through this module at each call, so a test can set it. No torch import at module
level: the command line checks flags without loading torch.
"""

from __future__ import annotations

import os
import re

_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not every core of the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads(requested: int | None, ranks: int = 1) -> int:
    """Model threads per process on a CPU: ``requested``, else OMP_NUM_THREADS, else the usable
    cores shared out between the ``ranks`` processes of a tensor-parallel worker."""
    if requested is not None:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    # Every core this process may run on (torch's default counts physical cores only). Note
    # that on a CPU shared with other busy processes, fewer threads can be much faster.
    return max(1, usable_cores() // ranks)


def cpu_device_share(threads: int, ranks: int = 1, cores: int | None = None) -> float:
    """The share of a CPU machine (one priced device) that a worker occupies: all its ranks'
    threads over the usable cores, at most the whole machine."""
    cores = cores or usable_cores()
    return min(1.0, threads * ranks / cores)


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_device(text: str) -> str:
    """A ``--device`` value checked for its form: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    value = str(text).strip().lower()
    if value in ("auto", "cpu", "cuda") or _CUDA_INDEX.fullmatch(value):
        return value
    raise ValueError(f"expected auto, cpu, cuda or cuda:N (N a device index), got {text!r}")


def parse_devices(text: str) -> str | None:
    """A ``--devices`` value: comma-separated CUDA device indices, written back as ``0,1``;
    empty: None (every device). ValueError names a bad or repeated entry."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        return None
    indices: list[int] = []
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"expected CUDA device indices like 0,1,2, got {part!r} in {text!r}")
        if int(part) in indices:
            raise ValueError(f"device {part} is named twice in {text!r}")
        indices.append(int(part))
    return ",".join(str(i) for i in indices)


def device_list(devices: str | None) -> list[int] | None:
    return None if devices is None else [int(p) for p in devices.split(",")]


def _no_such_device(index: int, count: int) -> ValueError:
    if count == 0:
        return ValueError(f"device cuda:{index} requested but CUDA is not available (no CUDA device found)")
    names = ", ".join(f"cuda:{i}" for i in range(count))
    return ValueError(f"device cuda:{index} does not exist: this machine has {count} CUDA "
                      f"device{'s' if count != 1 else ''} ({names})")


def uses_cuda(device: str, count: int) -> bool:
    """Whether ``device`` resolves to CUDA here (``auto`` does where a device exists)."""
    return device.startswith("cuda") or (device == "auto" and count > 0)


def rank_devices(device: str, devices: str | None, tensor_parallel_size: int, count: int) -> list[str]:
    """The device of each rank of one worker, rank order (one entry when not tensor parallel).

    ValueError, naming what exists, when a named device does not or there are too few."""
    t = tensor_parallel_size
    if not uses_cuda(device, count):
        if devices is not None and device == "cpu":
            raise ValueError(f"--devices {devices} names CUDA devices, but --device is cpu")
        return ["cpu"] * t
    if count == 0:
        raise ValueError(f"device {device!r} requested but CUDA is not available (no CUDA device found)")
    indices = device_list(devices)
    if indices is not None:
        if len(indices) < t:
            raise ValueError(f"--tensor-parallel-size {t} needs {t} CUDA devices, --devices names {len(indices)}")
        chosen = indices[:t]
    else:
        m = _CUDA_INDEX.fullmatch(device)
        base = int(m.group(1)) if m else 0
        chosen = [base + r for r in range(t)]
        if t > 1 and base + t > count and base < count:
            raise ValueError(f"--tensor-parallel-size {t} from {device} needs cuda:{base}..cuda:{base + t - 1}; "
                             f"this machine has {count} CUDA device{'s' if count != 1 else ''}")
    for index in chosen:
        if index >= count:
            raise _no_such_device(index, count)
    return [f"cuda:{i}" for i in chosen]


def engine_rank_devices(config) -> list[str]:
    """The device of each rank of a worker with ``EngineConfig`` ``config``; ValueError for a
    device that does not exist, naming those that do."""
    count = 0 if config.device == "cpu" else cuda_device_count()
    # A pipeline stage's ranks follow the stage before's.
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    return rank_devices(config.device, config.devices, ranks, count)


def worker_devices(num_workers: int, device: str, devices: str | None, tensor_parallel_size: int,
                   count: int) -> list[tuple[str, str | None]]:
    """``(--device, --devices)`` for each worker of ``mqinfer run``: on CUDA, worker ``i`` gets
    the ``T`` devices ``pool[(i * T + r) % len(pool)]``; an explicit ``cuda:N`` pins every
    worker there (its ranks on ``N, N+1, ...``); on CPU every worker gets ``cpu``.

    ValueError when a device does not exist or a worker's ranks would share a device."""
    t = tensor_parallel_size
    if not uses_cuda(device, count) or _CUDA_INDEX.fullmatch(device):
        rank_devices(device, devices, t, count)  # refuses what does not exist
        return [(device, devices)] * num_workers
    if count == 0:
        raise ValueError(f"device {device!r} requested but CUDA is not available (no CUDA device found)")
    pool = device_list(devices) or list(range(count))
    for index in pool:
        if index >= count:
            raise _no_such_device(index, count)
    if t > len(pool):
        raise ValueError(f"--tensor-parallel-size {t} needs {t} CUDA devices per worker; "
                         f"{len(pool)} {'are' if len(pool) != 1 else 'is'} available ({', '.join(map(str, pool))})")
    out = []
    for i in range(num_workers):
        mine = [pool[(i * t + r) % len(pool)] for r in range(t)]
        out.append((f"cuda:{mine[0]}", ",".join(map(str, mine)) if t > 1 or devices is not None else None))
    return out


__all__ = ["cpu_device_share", "cpu_threads", "cuda_device_count", "device_list", "engine_rank_devices", "parse_device", "parse_devices", "rank_devices", "uses_cuda",
           "usable_cores", "worker_devices"]
