"""GPU check of the Triton attention kernels: correctness against the PyTorch path, and timings.

``python -m mqinfer.loadgen.gpu.kernels`` (one command, under two minutes on one GPU):

- *check*: on every case below, in float32 and bfloat16, the Triton KV store must write exactly
  what the PyTorch store writes, and Triton paged attention must agree with the PyTorch path
  (``mqinfer.kernels.attention``) within the stated tolerance. Float32 is compared with the
  PyTorch path in float32 (both compute in IEEE float32: ``FLOAT32_TOL``); bfloat16 is compared
  with the PyTorch path run in float32 on the same bf16-rounded inputs (``BF16_TOL``, five times
  bf16's spacing at 1), and the PyTorch path's own bf16 error against that
  is printed beside it. One small mixed case is also held to the float64 definition
  (``reference_paged_attention``).
- *time*: median GPU time of each kernel and of the PyTorch path on the same inputs, and the ratio.

Without a CUDA device it prints "no CUDA device" and exits 0. ``--compile-only`` needs no GPU:
it compiles every kernel variant for a GPU architecture (``--arch 90``: Hopper) with Triton's
bundled toolchain and prints registers, spilled bytes and shared memory per variant; it exits 1
if a default tile configuration spills registers (the tests run it, so a kernel edit that
no longer fits is caught on machines without a GPU). ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mqinfer.kernels.attention import (
    build_attention_metadata,
    paged_attention as torch_paged_attention,
    reference_paged_attention,
    store_kv as torch_store_kv,
)

# Max absolute difference allowed, float32 Triton vs float32 PyTorch path (both IEEE fp32;
# they differ only in summation order), and bf16 Triton vs the float32 PyTorch path on the
# same bf16 inputs (bf16 keeps 8 bits: an output near 1 is rounded by up to 2**-9 and the
# probabilities are rounded to bf16 before the P @ V product).
FLOAT32_TOL = 1e-4
BF16_TOL = 2e-2
# Against the float64 definition on the small case.
FLOAT32_REF_TOL = 2e-5


@dataclass(frozen=True)
class Case:
    """One step's shape: per-sequence new tokens and context lengths, heads and page size."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _spread(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


# Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128) unless named.
GPU_CASES = (
    Case("decode B=1 ctx=8192 (kv split)", (1,), (8192,)),
    Case("decode B=32 ctx~2k", (1,) * 32, _spread(32, 1024, 3072, 1)),
    Case("decode B=256 ctx~1k", (1,) * 256, _spread(256, 512, 1536, 2)),
    Case("prefill 1x2048", (2048,), (2048,)),
    Case("prefill 4x512 chunk @1.5k", (512,) * 4, (1536, 1600, 2048, 1000)),
    Case("mixed 512 chunk + 127 decodes", (512,) + (1,) * 127, (1024,) + _spread(127, 256, 2048, 3)),
    Case("decode B=64 ctx~1k g=1 bs=32", (1,) * 64, _spread(64, 512, 1536, 4), 32, 32, 128, 32),
    Case("prefill 2x1024 g=1 bs=32", (1024, 1024), (1024, 1500), 32, 32, 128, 32),
)
# The CI matrix's mixed step (contexts ending mid-block, a chunk continuing a prefill), small
# enough for the float64 token-by-token reference.
REFERENCE_CASE = Case(
    "mixed small vs float64", (1, 7, 1, 33, 1, 16, 5), (1, 7, 40, 33, 64, 50, 37), 8, 2, 64, 16
)


def make_inputs(case: Case, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> dict[str, Any]:
    """Random caches with shuffled, disjoint block tables, this step's K/V and the queries.

    q, k and v are views of one fused QKV tensor, strided as the model hands them over.
    """
    rng = random.Random(seed)
    device = torch.device(device)
    # Drawn where they are used: a gigabyte of cache made on the host would dominate the run.
    gen = torch.Generator(device).manual_seed(seed)
    bs = case.block_size
    num_blocks = sum(-(-s // bs) for s in case.seq_lens) + 4
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-s // bs))] for s in case.seq_lens]
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    hq, hkv, d = case.num_heads, case.num_kv_heads, case.head_dim
    qkv = torch.randn(case.num_tokens, hq + 2 * hkv, d, generator=gen, device=device).to(dtype)
    metadata = build_attention_metadata(
        list(case.query_lens), list(case.seq_lens), tables, bs, hq // hkv, device=device
    )
    return {
        "q": qkv[:, :hq],
        "k": qkv[:, hq : hq + hkv],
        "v": qkv[:, hq + hkv :],
        "k_cache": k_cache,
        "v_cache": v_cache,
        "metadata": metadata,
        "tables": tables,
        "scale": d**-0.5,
    }


def check_case(case: Case, dtype: torch.dtype, device: str | torch.device) -> dict[str, Any]:
    """Run both paths on one case; returns the errors, the tolerance and whether it passed."""
    from mqinfer.kernels import triton_attention

    x = make_inputs(case, dtype, device)
    md = x["metadata"]
    k_torch, v_torch = x["k_cache"].clone(), x["v_cache"].clone()
    torch_store_kv(x["k"], x["v"], k_torch, v_torch, md.slot_mapping)
    k_tri, v_tri = x["k_cache"], x["v_cache"]
    triton_attention.store_kv(x["k"], x["v"], k_tri, v_tri, md.slot_mapping)
    store_ok = bool(torch.equal(k_torch, k_tri) and torch.equal(v_torch, v_tri))

    out = triton_attention.paged_attention(x["q"], k_tri, v_tri, md, x["scale"])
    exact = torch_paged_attention(x["q"].float(), k_tri.float(), v_tri.float(), md, x["scale"])
    err = (out.float() - exact).abs().max().item()
    result: dict[str, Any] = {"case": case.name, "dtype": _dtype_name(dtype), "store_exact": store_ok}
    if dtype == torch.float32:
        result.update(err=err, tol=FLOAT32_TOL)
    else:
        torch_low = torch_paged_attention(x["q"], k_tri, v_tri, md, x["scale"])
        result.update(err=err, tol=BF16_TOL, torch_err=(torch_low.float() - exact).abs().max().item())
    if case is REFERENCE_CASE:
        ref = reference_paged_attention(
            x["q"].double().cpu(), k_tri.double().cpu(), v_tri.double().cpu(),
            case.query_lens, case.seq_lens, x["tables"], x["scale"],
        )
        ref_err = (out.double().cpu() - ref).abs().max().item()
        result["ref_err"] = ref_err
        if dtype == torch.float32:
            result["tol"] = FLOAT32_REF_TOL
            result["err"] = max(err, ref_err)
    result["ok"] = store_ok and result["err"] <= result["tol"]
    return result


def _median_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_case(case: Case, dtype: torch.dtype, device: str | torch.device, reps: int = 20) -> dict[str, Any]:
    """Median milliseconds of the attention and the store, Triton vs PyTorch, same inputs."""
    from mqinfer.kernels import triton_attention

    device = torch.device(device)
    x = make_inputs(case, dtype, device)
    md, q, kc, vc, scale = x["metadata"], x["q"], x["k_cache"], x["v_cache"], x["scale"]
    k, v, slots = x["k"], x["v"], md.slot_mapping
    paths = {
        "attn_torch_ms": lambda: torch_paged_attention(q, kc, vc, md, scale),
        "attn_triton_ms": lambda: triton_attention.paged_attention(q, kc, vc, md, scale),
        "store_torch_ms": lambda: torch_store_kv(k, v, kc, vc, slots),
        "store_triton_ms": lambda: triton_attention.store_kv(k, v, kc, vc, slots),
    }
    row: dict[str, Any] = {"case": case.name, "dtype": _dtype_name(dtype)}
    for key, fn in paths.items():
        row[key] = _median_ms(fn, device, reps)
    return row


def _print_check_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':34} {'dtype':9} {'store':6} {'max|err|':>10} {'tol':>8} {'torch bf16 err':>15}  result")
    for r in rows:
        torch_err = f"{r['torch_err']:.2e}" if "torch_err" in r else "-"
        extra = f"  (vs float64: {r['ref_err']:.2e})" if "ref_err" in r else ""
        print(
            f"{r['case']:34} {r['dtype']:9} {'exact' if r['store_exact'] else 'DIFF':6} "
            f"{r['err']:10.2e} {r['tol']:8.0e} {torch_err:>15}  {'ok' if r['ok'] else 'FAIL'}{extra}"
        )


def _print_time_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'case':34} {'dtype':9} {'attn torch':>11} {'attn triton':>12} {'speedup':>8} "
        f"{'store torch':>12} {'store triton':>13} {'speedup':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:34} {r['dtype']:9} {r['attn_torch_ms']:9.3f}ms {r['attn_triton_ms']:10.3f}ms "
            f"{r['attn_torch_ms'] / r['attn_triton_ms']:7.2f}x {r['store_torch_ms']:10.4f}ms "
            f"{r['store_triton_ms']:11.4f}ms {r['store_torch_ms'] / r['store_triton_ms']:7.2f}x"
        )


def run_checks_and_timings(
    device: str | torch.device,
    cases: tuple[Case, ...] = GPU_CASES,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    reps: int = 20,
    json_path: str | None = None,
) -> int:
    """Check every case in every dtype, then time them; print both tables. 0 if all passed."""
    started = time.perf_counter()
    checks = [check_case(case, dtype, device) for dtype in dtypes for case in (REFERENCE_CASE, *cases)]
    print(
        f"\ncorrectness (max |err| tolerances: float32 {FLOAT32_TOL:.0e} vs the PyTorch path in "
        f"float32, {FLOAT32_REF_TOL:.0e} vs float64 on the small case; bf16 {BF16_TOL:.0e} vs the "
        "PyTorch path in float32 on the same bf16 inputs)"
    )
    _print_check_table(checks)
    timings = [time_case(case, dtype, device, reps) for dtype in dtypes for case in cases]
    print(f"\ntimings (median of {reps}; PyTorch path = gather + masked SDPA per group)")
    _print_time_table(timings)
    print(f"\ntotal {time.perf_counter() - started:.1f}s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": str(device), "checks": checks, "timings": timings}, f, indent=2)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        print(f"{len(failed)} check(s) FAILED", file=sys.stderr)
        return 1
    return 0


def run_gpu(json_path: str | None) -> int:
    import triton

    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    return run_checks_and_timings(torch.device("cuda", 0), json_path=json_path)


# ---- ahead-of-time compilation (no GPU needed) ----------------------------------------------


def compile_launch(launch: Any, arch: int) -> Any:
    """Compile one planned launch for ``cuda:sm_<arch>`` as Triton would at run time.

    Specialisation (argument types, 16-byte alignment and divisibility) is computed from the
    planned arguments by Triton's own binder, so the code is the code a GPU run would get.
    Uses Triton internals (``create_function_from_signature``, ``_pack_args``) of triton 3.x.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers, spilled (local) bytes and shared memory of a compiled kernel, from its cubin."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", dump)
    if found is None:
        raise RuntimeError(f"cannot read the resource usage from cuobjdump's output:\n{dump}")
    return {
        "registers": int(found.group(1)),
        "stack": int(found.group(2)),
        "local": int(found.group(3)),
        "shared": int(compiled.metadata.shared),
    }


# (heads, KV heads, head_dim, block size): Llama 3 8B, Llama 2 7B with 32-token pages, Qwen2
# 7B (g = 7, not a power of two), and a small head_dim.
COMPILE_SHAPES = ((32, 8, 128, 16), (32, 32, 128, 32), (28, 4, 128, 16), (16, 8, 64, 16))


def _planned_variants(shape: tuple[int, int, int, int], dtype: torch.dtype) -> list[tuple[str, Any]]:
    """Every launch the module plans for one attention shape: store, decode, split decode and
    its merge, prefill (built on small CPU tensors with the real strides)."""
    from mqinfer.kernels import triton_attention, triton_store

    hq, hkv, d, bs = shape
    variants = []
    for label, query_lens, seq_lens, splits in (
        ("decode", (1, 1), (40, 70), 1),
        ("decode split", (1, 1), (400, 700), 2),
        ("prefill", (20, 3), (40, 3), None),
    ):
        case = Case(label, query_lens, seq_lens, hq, hkv, d, bs)
        x = make_inputs(case, dtype, "cpu")
        md = x["metadata"]
        if label == "decode":
            store = triton_store.plan_store_kv(x["k"], x["v"], x["k_cache"], x["v_cache"], md.slot_mapping)
            variants.append(("store", store))
        _, launches = triton_attention.plan_paged_attention(
            x["q"], x["k_cache"], x["v_cache"], md.query_start_loc, md.seq_lens, md.block_tables,
            x["scale"], num_kv_splits=splits,
        )
        variants.append((label, launches[0]))
        if len(launches) > 1:
            variants.append(("merge", launches[1]))
    return variants


def run_compile_only(arch: int, quick: bool, json_path: str | None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("--compile-only needs compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    shapes = COMPILE_SHAPES[:1] if quick else COMPILE_SHAPES
    rows = []
    print(
        f"{'shape (Hq/Hkv/D/bs)':20} {'dtype':9} {'kernel':13} {'regs':>5} {'spilled B':>10} "
        f"{'shared B':>9} {'compile':>8}"
    )
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            for label, launch in _planned_variants(shape, dtype):
                t0 = time.perf_counter()
                usage = resource_usage(compile_launch(launch, arch))
                row = {
                    "shape": "/".join(map(str, shape)),
                    "dtype": _dtype_name(dtype),
                    "kernel": label,
                    **usage,
                    "compile_s": time.perf_counter() - t0,
                }
                rows.append(row)
                print(
                    f"{row['shape']:20} {row['dtype']:9} {label:13} {usage['registers']:5} "
                    f"{usage['local']:10} {usage['shared']:9} {row['compile_s']:7.1f}s",
                    flush=True,
                )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"arch": arch, "variants": rows}, f, indent=2)
    spilled = [r for r in rows if r["local"] > 0]
    if spilled:
        print(f"{len(spilled)} variant(s) spill registers to local memory", file=sys.stderr)
        return 1
    print(f"all {len(rows)} variants compiled for sm_{arch} without register spills")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.gpu.kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="compile for --arch without a GPU and report resources"
    )
    parser.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability for --compile-only (90 = Hopper)"
    )
    parser.add_argument("--quick", action="store_true", help="--compile-only: one attention shape, not all")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.compile_only:
        return run_compile_only(args.arch, args.quick, args.json)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (try --compile-only)")
        return 0
    return run_gpu(args.json)


if __name__ == "__main__":
    sys.exit(main())
