"""Device placement: which CUDA device each worker and each tensor-parallel rank gets, and the
refusal of devices that do not exist. This machine has no GPU: the device count is set through
``workers.devices.cuda_device_count``, the one place it is read."""

from __future__ import annotations

import os

import pytest

from mqinfer.config import ConfigError
from mqinfer.workers import devices
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.devices import rank_devices, worker_devices
from tests import zygote
from tests.helpers import mqinfer_cmd


def test_workers_spread_over_the_devices():
    # Worker i on cuda:(i mod count).
    assert [d for d, _ in worker_devices(6, "cuda", None, 1, 4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3",
                                                                     "cuda:0", "cuda:1"]
    assert [d for d, _ in worker_devices(3, "auto", None, 1, 2)] == ["cuda:0", "cuda:1", "cuda:0"]
    # --devices: the pool, in its order.
    assert worker_devices(3, "cuda", "3,1", 1, 4) == [("cuda:3", "3"), ("cuda:1", "1"), ("cuda:3", "3")]
    # Tensor parallel: T consecutive devices of the pool per worker.
    assert worker_devices(3, "cuda", None, 2, 4) == [("cuda:0", "0,1"), ("cuda:2", "2,3"), ("cuda:0", "0,1")]
    assert worker_devices(2, "cuda", None, 2, 3) == [("cuda:0", "0,1"), ("cuda:2", "2,0")]
    # An explicit device pins every worker; no GPU or cpu: every worker as asked.
    assert worker_devices(2, "cuda:1", None, 1, 2) == [("cuda:1", None)] * 2
    assert worker_devices(2, "auto", None, 1, 0) == [("auto", None)] * 2
    assert worker_devices(2, "cpu", None, 2, 4) == [("cpu", None)] * 2


def test_ranks_of_one_worker():
    assert rank_devices("cuda:1", None, 2, 4) == ["cuda:1", "cuda:2"]
    assert rank_devices("cuda", "3,1", 2, 4) == ["cuda:3", "cuda:1"]
    assert rank_devices("auto", None, 1, 0) == ["cpu"]
    assert rank_devices("cpu", None, 2, 0) == ["cpu", "cpu"]


@pytest.mark.parametrize("call,message", [
    (lambda: rank_devices("cuda:3", None, 1, 2),
     r"device cuda:3 does not exist: this machine has 2 CUDA devices \(cuda:0, cuda:1\)"),
    (lambda: rank_devices("cuda:1", None, 1, 0), "CUDA is not available"),
    (lambda: rank_devices("cuda", None, 1, 0), "CUDA is not available"),
    (lambda: rank_devices("cuda:1", None, 2, 2), r"needs cuda:1..cuda:2; this machine has 2 CUDA devices"),
    (lambda: rank_devices("cuda", "0", 2, 2), "--tensor-parallel-size 2 needs 2 CUDA devices, --devices names 1"),
    (lambda: rank_devices("cpu", "0,1", 1, 2), "--devices 0,1 names CUDA devices, but --device is cpu"),
    (lambda: worker_devices(2, "cuda", "0,5", 1, 2), "device cuda:5 does not exist"),
    (lambda: worker_devices(2, "cuda", None, 3, 2), r"needs 3 CUDA devices per worker; 2 are available \(0, 1\)"),
])
def test_devices_that_do_not_exist_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_flags_take_cuda_n_and_refuse_other_forms():
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    assert EngineConfig(devices="2, 0").devices == "2, 0"
    for bad, message in [({"device": "tpu"}, "expected auto, cpu, cuda or cuda:N"),
                         ({"device": "cuda:x"}, "expected auto, cpu, cuda or cuda:N"),
                         ({"devices": "0,0"}, "named twice"),
                         ({"devices": "a"}, "expected CUDA device indices"),
                         ({"tensor_parallel_size": 0}, "at least 1"),
                         ({"tensor_parallel_size": 2, "quantization": "w8a8"}, "does not combine")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)


def test_the_engine_and_run_read_the_device_count_through_the_seam(monkeypatch, tmp_path):
    from mqinfer.cli import build_parser
    from mqinfer.config import resolve
    from mqinfer.run import placement, worker_argv
    from mqinfer.workers.engine.core import LLMEngine

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"cuda:2 does not exist: this machine has 2 CUDA devices"):
        LLMEngine(EngineConfig(device="cuda:2"))

    def opts(*flags):
        args = build_parser().parse_args(["run", "in.jsonl", "--out", str(tmp_path), "--workers", "3", *flags])
        return resolve(args, args._options, {}, args._required)

    places = placement(opts("--device", "cuda"))
    assert [d for d, _ in places] == ["cuda:0", "cuda:1", "cuda:0"]
    argv = worker_argv(opts("--device", "cuda"), tmp_path, 1, "requests", places[1])
    assert argv[argv.index("--device") + 1] == "cuda:1" and "--devices" not in argv
    with pytest.raises(ConfigError, match="cuda:4 does not exist"):
        placement(opts("--device", "cuda:4"))


def test_a_worker_refuses_a_missing_device_before_it_waits_for_redis(tmp_path):
    # Nothing listens on port 1: a worker that got as far as Redis would wait a minute for it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MQINFER_")}
    proc = zygote.run(mqinfer_cmd("worker", "--redis", "redis://127.0.0.1:1", "--out", str(tmp_path),
                                  "--device", "cuda:999"),
                      capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    # This machine without CUDA, or one with fewer than 1000 devices.
    assert ("device 'cuda:999' requested but CUDA is not available" in proc.stderr
            or "device cuda:999 does not exist: this machine has" in proc.stderr), proc.stderr


def test_a_cpu_worker_holds_its_ranks_threads_over_the_usable_cores(monkeypatch):
    assert devices.cpu_device_share(1, cores=2) == 0.5
    assert devices.cpu_device_share(1, ranks=2, cores=8) == 0.25  # tensor parallel: every rank's threads
    assert devices.cpu_device_share(4, cores=2) == 1.0  # at most the machine, one device
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert devices.cpu_threads(None) == 3 and devices.cpu_threads(2) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert devices.cpu_threads(None, ranks=2) == max(1, devices.usable_cores() // 2)
