"""Each op of the forward pass held against its own roof, measured on the machine in the same run
(``python -m mqinfer.loadgen.profile_engine --ops``).

- **Dense layers** (FLOP-bound): the multiply-add rate PyTorch's matmul (oneDNN: AMX tiles where
  the CPU has them, else AVX-512 / VNNI) reaches on this machine at the engine's own shapes: for each
  dense op, a ``[rows, K] @ [K, N]`` matmul in the engine's dtype with the op's weight shape and its
  rows per call averaged by each call's work, best of a few. An op's share is its achieved rate over that roof, both over
  CPU time of the same threads, so the share says how well the kernel uses the cores it has.
- **Attention, rotary + KV store, residual + RMSNorm, SwiGLU's elementwise part** (bandwidth-bound):
  the bytes each call must move (attention: every key and value of every sequence's context, plus
  queries and outputs; the others: what they read and write) over a STREAM-like copy bandwidth
  measured in the same run (``bench_roofs.measure_copy_bandwidth``).
- **Outside the ops**: the forward pass's time in no timed op, and the step's phases outside the
  forward pass (schedule, prepare, sample, postprocess: Python and bookkeeping), as lines of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Bandwidth-bound ops, by the names op_timer gives them.
BANDWIDTH_OPS = ("attention", "rotary + KV store", "residual + RMSNorm", "SwiGLU (silu * up)")


@dataclass
class Roofs:
    """What the ops are held against: the copy bandwidth (bytes/s) and, per dense op, the matmul
    rate (FLOP/s) at its shape."""

    copy_bytes_per_s: float
    dense_flops_per_s: dict[str, float] = field(default_factory=dict)
    dense_shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # op -> (rows, K, N)


def matmul_rate(rows: int, k: int, n: int, dtype: str, *, repeats: int = 0, best_of: int = 3) -> float:
    """FLOP/s of ``[rows, k] @ [k, n]`` in ``dtype`` on this process's threads, best of ``best_of``
    timings of enough back-to-back products to take about 20 ms."""
    import torch

    torch_dtype = getattr(torch, dtype)
    a = torch.randn(rows, k).to(torch_dtype)
    b = torch.randn(k, n).to(torch_dtype)
    out = torch.empty(rows, n, dtype=torch_dtype)
    torch.mm(a, b, out=out)
    if not repeats:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        repeats = max(1, min(2000, int(0.02 / max(time.perf_counter() - t, 1e-7))))
    best = float("inf")
    for _ in range(best_of):
        t = time.process_time()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        best = min(best, time.process_time() - t)
    return 2.0 * rows * k * n * repeats / best if best > 0 else 0.0


def measure_roofs(times, dtype: str) -> Roofs:
    """The roofs for the ops in ``times`` (an ``op_timer.OpTimes`` after a run)."""
    from mqinfer.loadgen.bench_roofs import measure_copy_bandwidth

    bandwidth = measure_copy_bandwidth()
    roofs = Roofs(copy_bytes_per_s=bandwidth.bytes_per_s)
    for name, shape in times.shapes.items():
        # Rows weighted by the work of each call (a call's FLOPs grow with its rows): a few long
        # prefill chunks among many short decodes set the rate the op's time is mostly spent at.
        rows = max(1, round(times.rows_squared[name] / times.rows[name])) if times.rows[name] else 1
        k, n = shape
        roofs.dense_shapes[name] = (rows, k, n)
        roofs.dense_flops_per_s[name] = matmul_rate(rows, k, n, dtype)
    return roofs


def roof_table(times, roofs: Roofs, forward_s: float, phases: dict[str, float]) -> str:
    """Ops by wall time: their share of the forward pass, what they achieved (GFLOP/s or GB/s over
    CPU time) and the share of their roof; then the time outside the ops."""
    lines = [f"{'op':<30} {'calls':>7} {'seconds':>9} {'of fwd':>7} {'CPU s':>8} {'achieved':>12} "
             f"{'roof':>12} {'of roof':>8}", "-" * 99]
    for name in sorted(times.seconds, key=times.seconds.get, reverse=True):
        s, cpu = times.seconds[name], times.cpu_seconds[name]
        achieved = roof = ""
        share = ""
        if times.flops[name] and cpu > 0 and name in roofs.dense_flops_per_s:
            rate, top = times.flops[name] / cpu, roofs.dense_flops_per_s[name]
            achieved, roof = f"{rate / 1e9:8.1f} GF/s", f"{top / 1e9:8.1f} GF/s"
            share = f"{rate / top:8.1%}" if top > 0 else ""
        elif times.bytes[name] and s > 0:
            rate, top = times.bytes[name] / s, roofs.copy_bytes_per_s
            achieved, roof = f"{rate / 1e9:8.2f} GB/s", f"{top / 1e9:8.2f} GB/s"
            share = f"{rate / top:8.1%}" if top > 0 else ""
        lines.append(f"{name:<30} {times.calls[name]:>7} {s:>9.3f} {s / forward_s:>7.1%} {cpu:>8.3f} "
                     f"{achieved:>12} {roof:>12} {share:>8}")
    rest = forward_s - sum(times.seconds.values())
    lines.append(f"{'forward, outside the ops':<30} {'':>7} {rest:>9.3f} {rest / forward_s:>7.1%}")
    for phase in ("schedule", "prepare", "sample", "postprocess"):
        if phase in phases:
            lines.append(f"{'step: ' + phase:<30} {'':>7} {phases[phase]:>9.3f}")
    lines.append("dense roofs: PyTorch's matmul at each op's work-weighted mean rows and weight shape, CPU time "
                 "of the same threads; bandwidth roofs: a copy of arrays larger than the last-level cache, wall time.")
    for name, (rows, k, n) in sorted(roofs.dense_shapes.items()):
        lines.append(f"  {name}: [{rows} x {k}] @ [{k} x {n}]")
    return "\n".join(lines)


__all__ = ["BANDWIDTH_OPS", "Roofs", "matmul_rate", "measure_roofs", "roof_table"]
