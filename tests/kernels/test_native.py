"""The native library's loader (kernels/native.py) and thread pool: it builds wherever there is
a compiler, its calls are typed, its records match the C ones, the pool is started once per
thread count and survives fork(), and without a compiler every caller falls back to PyTorch."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from mqinfer.kernels import native
from mqinfer.kernels.attention import build_attention_metadata, paged_attention
from mqinfer.kernels.cpu_ops import greedy_argmax, reference_greedy_argmax
from tests.helpers import wait_until

HAS_COMPILER = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_library = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


@needs_library
def test_library_builds_wherever_there_is_a_compiler():
    # The kernel tests skip when the library is missing: a broken build must not pass as that.
    assert native.load() is not None, native.build_error()
    assert native.library_path().exists()


@needs_library
def test_calls_and_records_are_typed():
    lib = native.load()
    with pytest.raises(ctypes.ArgumentError):
        lib.mqinfer_silu_mul(ctypes.byref(native.ArgmaxArgs()), 1)  # another function's record
    with pytest.raises(ctypes.ArgumentError):
        lib.mqinfer_argmax(12345, 1)  # a bare address instead of a record
    with pytest.raises(ctypes.ArgumentError):
        lib.mqinfer_argmax(ctypes.byref(native.ArgmaxArgs()), "4")
    with pytest.raises(TypeError):
        native.AttentionArgs(num_tokens=1.5)


@needs_library
def test_a_record_that_differs_from_its_c_layout_is_refused(monkeypatch):
    class ShortArgmaxArgs(ctypes.Structure):  # is_bf16 forgotten
        _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("rows", ctypes.c_int64),
                    ("cols", ctypes.c_int64), ("row_stride", ctypes.c_int64)]

    class SwappedArgmaxArgs(ctypes.Structure):  # same size, two fields swapped
        _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("rows", ctypes.c_int64),
                    ("cols", ctypes.c_int64), ("is_bf16", ctypes.c_int32),
                    ("row_stride", ctypes.c_int64)]

    lib = native.load()
    native._check_layouts(lib)  # the real mirrors pass
    for bad in (ShortArgmaxArgs, SwappedArgmaxArgs):
        monkeypatch.setattr(native, "_RECORDS", {bad: "mqinfer_layout_argmax_args"})
        with pytest.raises(RuntimeError, match=bad.__name__):
            native._check_layouts(lib)



def test_every_function_and_record_of_the_header_is_typed_and_checked():
    # A function the header declares is called through its ctypes signature, and a record it
    # declares has a mirror whose layout the loader checks: none is declared by a caller alone.
    header = (native.CSRC / "mqinfer_native.h").read_text()
    functions = set(re.findall(r"^(?:int|int64_t|void) (mqinfer_\w+)\(", header, re.MULTILINE))
    records = set(re.findall(r"^\} (mqinfer_\w+_args);", header, re.MULTILINE))
    assert {"mqinfer_amx_linear", "mqinfer_amx_swiglu", "mqinfer_amx_qlinear"} <= functions
    assert {"mqinfer_amx_linear_args", "mqinfer_amx_swiglu_args"} <= records
    assert functions == set(native._SIGNATURES)
    assert {f"mqinfer_layout_{name.removeprefix('mqinfer_')}" for name in records} == set(native._RECORDS.values())
    abi = (native.CSRC / "abi.c").read_text()
    for record, table in native._RECORDS.items():
        # The table lists every field of its record, in the mirror's order.
        body = abi[abi.index(f"{table}[] = {{"):]
        body = body[:body.index("};")]
        c_name = table.replace("mqinfer_layout_", "mqinfer_")
        assert re.findall(rf"AT\({c_name}, (\w+)\)", body) == [name for name, _ in record._fields_], table

@needs_library
def test_extra_flags_get_their_own_cache_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("MQINFER_CACHE_DIR", str(tmp_path))
    plain = native.library_path()
    monkeypatch.setenv(native.EXTRA_FLAGS_ENV, "-DMQINFER_EXTRA=1 -g")
    assert native.build_flags()[-2:] == ("-DMQINFER_EXTRA=1", "-g")
    extra = native.library_path()
    assert plain.parent == extra.parent == tmp_path / "kernels"
    assert plain != extra
    assert "-ffp-contract=off" in native.build_flags()  # the one FMA rule, for every build


def test_builders_starting_together_compile_the_library_once(monkeypatch, tmp_path):
    # Processes lock a file beside the library; two threads opening it separately contend the same
    # way, so two threads stand in for two workers starting at once on a fresh machine.
    monkeypatch.setenv("MQINFER_CACHE_DIR", str(tmp_path))
    compiled = []

    def slow_compile(library, flags):
        compiled.append(library)
        time.sleep(0.3)  # the other builder arrives while this one compiles
        library.write_bytes(b"built")

    monkeypatch.setattr(native, "_compile_library", slow_compile)
    results: list[Path] = []
    builders = [threading.Thread(target=lambda: results.append(native.build())) for _ in range(2)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert len(compiled) == 1 and results == [compiled[0]] * 2 and compiled[0].read_bytes() == b"built"


def _big_logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(64, 4096)  # well above the size that goes parallel


@needs_library
def test_pool_is_started_once_per_thread_count(threads):
    x = _big_logits()
    expected = reference_greedy_argmax(x)
    threads(3)
    assert torch.equal(greedy_argmax(x), expected)
    starts = native.pool_starts()
    assert native.pool_workers() == 2  # the calling thread is the third
    md = build_attention_metadata([1] * 8, [40] * 8, [[b, b + 8, b + 16] for b in range(8)], 16, 4)
    k_cache = torch.randn(24, 16, 2, 64)
    q = torch.randn(8, 8, 64)
    os_threads = None
    for _ in range(20):  # the fused ops and attention share the one pool
        assert torch.equal(greedy_argmax(x), expected)
        paged_attention(q, k_cache, k_cache, md, 0.125, backend="native")
        # From the first round on (PyTorch may start its own threads in it), no new thread. (A
        # thread of an earlier test in this process may end meanwhile: ids, not a count.)
        os_threads = os_threads or set(os.listdir("/proc/self/task"))
        assert set(os.listdir("/proc/self/task")) <= os_threads
    assert native.pool_starts() == starts
    threads(1)  # one thread: the caller does the work, the pool is left alone
    assert torch.equal(greedy_argmax(x), expected)
    assert native.pool_starts() == starts and native.pool_workers() == 2
    threads(2)
    assert torch.equal(greedy_argmax(x), expected)
    assert native.pool_starts() == starts + 1 and native.pool_workers() == 1


@needs_library
@pytest.mark.parametrize("spin_us", ["0", "200", "5000"])
def test_workers_that_watch_for_the_next_call_then_sleep(threads, monkeypatch, spin_us):
    """After a call the pool's workers watch for the next one for MQINFER_POOL_SPIN_US before they
    sleep: back-to-back calls give the same results with any setting, and once the calls stop the
    workers stop taking CPU (a worker that never slept would take a core for the whole pause)."""
    monkeypatch.setenv("MQINFER_POOL_SPIN_US", spin_us)
    x = _big_logits()
    expected = reference_greedy_argmax(x)
    threads(3)
    md = build_attention_metadata([1] * 8, [40] * 8, [[b, b + 8, b + 16] for b in range(8)], 16, 4)
    k_cache = torch.randn(24, 16, 2, 64)
    q = torch.randn(8, 8, 64)
    reference = paged_attention(q, k_cache, k_cache, md, 0.125, backend="native")
    for _ in range(200):
        assert torch.equal(greedy_argmax(x), expected)
        assert torch.equal(paged_attention(q, k_cache, k_cache, md, 0.125, backend="native"), reference)
    time.sleep(0.05)  # longer than the longest spin here: every worker is asleep or about to be
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1


@needs_library
def test_a_forked_child_gets_its_own_pool(threads):
    # The parent's workers do not exist in a child: the child must start its own rather than
    # wait for them forever.
    x = _big_logits()
    expected = reference_greedy_argmax(x).tolist()
    threads(3)
    greedy_argmax(x)
    assert native.pool_workers() == 2
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running
        pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, report and leave
        status = 1
        try:
            got = greedy_argmax(x).tolist()
            os.write(write_end, json.dumps([got, native.pool_workers()]).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)

    def exited():
        done, status = os.waitpid(pid, os.WNOHANG)
        return (done, status) if done else None

    try:
        _, status = wait_until(exited, timeout=60, what="the forked child to exit")
    except AssertionError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in a parallel kernel")
    with os.fdopen(read_end, "rb") as f:
        report = f.read()
    assert os.waitstatus_to_exitcode(status) == 0
    got, child_workers = json.loads(report)
    assert got == expected
    assert child_workers == 2
    assert native.pool_workers() == 2  # the parent's pool is untouched


_FALLBACK_SCRIPT = r"""
import json, torch
from mqinfer.kernels import attention, cpu_ops
report = {"attention": attention.native_attention_available(), "ops": cpu_ops.cpu_ops_available()}
torch.manual_seed(0)
x = torch.randn(5, 300)
report["argmax_ok"] = torch.equal(cpu_ops.greedy_argmax(x), x.max(dim=-1).indices)
md = attention.build_attention_metadata([1, 3], [20, 3], [[2, 0], [1]], 16, 2)
k, v, q = torch.randn(3, 16, 1, 8), torch.randn(3, 16, 1, 8), torch.randn(4, 2, 8)
out = attention.paged_attention(q, k, v, md, 0.3)
ref = attention.reference_paged_attention(q, k, v, [1, 3], [20, 3], [[2, 0], [1]], 0.3)
report["attention_ok"] = bool(torch.allclose(out, ref, atol=1e-5))
try:
    attention.native_paged_attention(q, k, v, md, 0.3)
except RuntimeError as exc:
    report["native_error"] = str(exc)
print(json.dumps(report))
"""


def _run_python(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter, the switches at their default unless ``env`` sets them."""
    switches = {"MQINFER_CPU_ATTENTION": "auto", "MQINFER_CPU_OPS": "auto"}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, **switches, **env},
    )


def test_without_a_compiler_every_caller_falls_back_to_pytorch(tmp_path):
    result = _run_python(_FALLBACK_SCRIPT, CC=str(tmp_path / "no-such-cc"),
                         MQINFER_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"attention": False, "ops": False, "argmax_ok": True, "attention_ok": True,
                      "native_error": "the native CPU attention kernel is not available"}
    assert "native CPU kernels unavailable" in result.stderr


def test_native_switch_makes_a_missing_library_an_error(tmp_path):
    script = "from mqinfer.kernels import cpu_ops\ncpu_ops.cpu_ops_available()"
    result = _run_python(script, CC=str(tmp_path / "no-such-cc"), MQINFER_CACHE_DIR=str(tmp_path),
                         MQINFER_CPU_OPS="native")
    assert result.returncode != 0
    assert "MQINFER_CPU_OPS=native but the native CPU kernels could not be built" in result.stderr
    assert "no-such-cc" in result.stderr


@needs_library
def test_build_command_prints_the_library_or_the_compiler_error(tmp_path):
    command = "from mqinfer.kernels.native import main; raise SystemExit(main())"
    ok = _run_python(command)  # this process's cache and flags: already built
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(native.library_path())
    bad = _run_python(command, MQINFER_CACHE_DIR=str(tmp_path),
                      MQINFER_NATIVE_CFLAGS=f"-include {tmp_path / 'missing.h'}")
    assert bad.returncode == 1
    assert "native CPU kernels: build failed" in bad.stderr and "missing.h" in bad.stderr
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_attention_switch_forces_the_pytorch_path_and_rejects_bad_values(monkeypatch):
    from mqinfer.kernels.attention import native_attention_available

    monkeypatch.setenv("MQINFER_CPU_ATTENTION", "torch")
    assert not native_attention_available()
    monkeypatch.setenv("MQINFER_CPU_ATTENTION", "sometimes")
    with pytest.raises(ValueError, match="MQINFER_CPU_ATTENTION must be auto, native or torch"):
        native_attention_available()
