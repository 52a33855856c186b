"""`--workers auto` on GPU machines: one worker per visible CUDA device, or per group of
tensor x pipeline ranks; `--device cuda:N` and `--devices` honoured. The device count is faked
by setting torch.cuda's answers, as on a machine with that many GPUs; `mqinfer run` then places
each worker on devices of its own."""

from __future__ import annotations

import pytest
import torch

from mqinfer.layout import choose_layout, cuda_available, ranks_per_worker
from mqinfer.run import placement

GIB = 1 << 30


@pytest.fixture
def gpus(monkeypatch):
    """Make torch report ``n`` CUDA devices (0: none)."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake


def _opts(**kw) -> dict:
    return {"workers": "auto", "num_threads": None, "shards": 1, "device": "auto", "devices": None,
            "model": "tiny", "tensor_parallel_size": 1, **kw}


def _layout(**kw) -> tuple[int, int | None, str]:
    return choose_layout(_opts(**kw), cores=16, memory=64 * GIB)


def _run_places(opts: dict) -> list[tuple[str, str | None]]:
    """Where `mqinfer run` puts the workers of the auto layout of ``opts``."""
    workers, threads, _ = choose_layout(opts, cores=16, memory=64 * GIB)
    return placement({**opts, "workers": workers, "num_threads": threads})


def test_auto_gives_one_worker_per_visible_gpu(gpus):
    gpus(8)
    assert cuda_available()
    workers, threads, why = _layout()
    assert (workers, threads) == (8, None)
    assert why == "8 visible CUDA devices, a worker per one device"
    assert _layout(device="cuda")[:2] == (8, None)
    # Each worker on a device of its own.
    assert _run_places(_opts()) == [(f"cuda:{i}", None) for i in range(8)]


def test_one_gpu_gives_one_worker(gpus):
    gpus(1)
    assert _layout()[:2] == (1, None)
    assert _run_places(_opts()) == [("cuda:0", None)]


def test_tensor_parallel_groups_share_out_the_gpus(gpus):
    gpus(8)
    workers, _, why = _layout(tensor_parallel_size=2)
    assert workers == 4 and "a worker per 2 devices" in why
    assert _run_places(_opts(tensor_parallel_size=2)) == [("cuda:0", "0,1"), ("cuda:2", "2,3"),
                                                        ("cuda:4", "4,5"), ("cuda:6", "6,7")]
    assert _layout(tensor_parallel_size=4)[0] == 2
    # Devices left over after the last whole group stay unused: 6 // 4.
    gpus(6)
    assert _layout(tensor_parallel_size=4)[0] == 1


def test_pipeline_stages_multiply_the_group(gpus):
    gpus(8)
    assert ranks_per_worker(_opts(tensor_parallel_size=2, pipeline_parallel_size=2)) == 4
    workers, _, why = _layout(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert workers == 2 and "a worker per 4 devices (tensor x pipeline ranks)" in why
    assert _layout(pipeline_parallel_size=2)[0] == 4
    # On a CPU every rank is a process: 16 cores, 4 ranks of one thread per worker.
    assert choose_layout(_opts(device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2), cores=16,
                         memory=64 * GIB)[:2] == (4, 1)


def test_device_cuda_n_pins_one_worker_there(gpus):
    gpus(4)
    workers, _, why = _layout(device="cuda:1")
    assert workers == 1 and why == "--device cuda:1: one worker on one device"
    assert _run_places(_opts(device="cuda:1")) == [("cuda:1", None)]
    # A tensor-parallel worker from cuda:2 takes cuda:2 and cuda:3.
    assert _layout(device="cuda:2", tensor_parallel_size=2)[0] == 1
    assert _run_places(_opts(device="cuda:2", tensor_parallel_size=2)) == [("cuda:2", None)]


def test_devices_limit_the_pool(gpus):
    gpus(8)
    workers, _, why = _layout(devices="1,3,5")
    assert workers == 3 and why == "--devices 1,3,5, a worker per one device"
    assert _run_places(_opts(devices="1,3,5")) == [("cuda:1", "1"), ("cuda:3", "3"), ("cuda:5", "5")]
    assert _layout(device="cuda", devices="0,1,2,3", tensor_parallel_size=2)[0] == 2
    # --devices means CUDA even where --device is left at auto.
    assert _layout(devices="0,1")[0] == 2


def test_cpu_device_keeps_the_cpu_layout_on_a_gpu_machine(gpus):
    gpus(8)
    workers, threads, why = _layout(device="cpu")
    assert (workers, threads) == (16, 1) and "16 cores" in why


def test_no_gpu_keeps_the_cpu_layout(gpus):
    gpus(0)
    assert not cuda_available()
    assert _layout()[:2] == (16, 1)


def test_a_missing_gpu_is_refused_by_run_naming_those_that_exist(gpus):
    from mqinfer.config import ConfigError

    gpus(2)
    opts = _opts(devices="0,5")
    assert _layout(devices="0,5")[0] == 2  # counted as asked; placement names what is wrong
    with pytest.raises(ConfigError, match=r"cuda:5 does not exist: this machine has 2 CUDA devices \(cuda:0, cuda:1\)"):
        _run_places(opts)
    gpus(0)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        _run_places(_opts(device="cuda:1"))


def test_shards_and_an_explicit_count_still_win(gpus):
    gpus(2)
    assert _layout(shards=3)[0] == 3  # a worker per shard, even beyond the devices
    assert _layout(workers=5, num_threads=2)[:3] == (5, 2, "--workers")


def test_benchmark_workers_spread_over_the_gpus_as_run_places_them(gpus):
    from mqinfer.loadgen.bench_pool import spread_over_gpus

    gpus(4)
    placed = []
    for i in range(_layout(device="cuda")[0]):
        argv = ["mqinfer", "worker", "--device", "cuda", "--stream", "bench"]
        spread_over_gpus(argv, i)
        placed.append(argv[3])
    assert placed == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    for device in ("cpu", "cuda:2"):  # an explicit choice is kept
        argv = ["--device", device]
        spread_over_gpus(argv, 3)
        assert argv == ["--device", device]
    gpus(1)
    argv = ["--device", "cuda"]
    spread_over_gpus(argv, 1)
    assert argv == ["--device", "cuda"]
