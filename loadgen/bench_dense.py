"""Dense-layer kernels against each other on one thread: the float32 kernel
(``kernels.linear``), w8a16 (``kernels.linear_w8a16``: int8 weights, float32 activations) and
w8a8 (``kernels.linear_int8``), at the model's shapes and a range of row counts.

Each kernel cycles through copies of its weight adding up to ``--weights-mb`` (default 96 MB,
three times this machine's L3), so that every call reads its weight from memory as a decode
step does (each layer's weights are evicted by the other layers'); ``--weights-mb 0`` keeps one
copy, hot in the cache. Prints GFLOP/s (2 x rows x K x N per call, best of ``--repeats`` timed
runs) and the ratios to the float32 kernel measured in the same run.

With ``--dtype bfloat16`` (CPUs with AVX-512 VNNI, where the w8a8 kernel takes bfloat16 rows and
the float32 kernels are not built) it compares the w8a8 kernel on bfloat16 rows with bfloat16
``torch.mm``, what the unquantized model runs there (its LM head in vocabulary slices, as
``LMHead`` does).

    python -m mqinfer.loadgen.bench_dense [--rows 1 4 16 64 256] [--repeats 5] [--weights-mb 96]
    python -m mqinfer.loadgen.bench_dense --dtype bfloat16 --shapes 512x32000 --rows 16 37 64 128
"""

from __future__ import annotations

import argparse
import time

import torch

from mqinfer.kernels import linear as dense
from mqinfer.kernels import linear_int8 as q8
from mqinfer.kernels import linear_w8a16 as w16

# (K, N): SmolLM2-135M's gate/up (576 -> 2 x 1536), down, q/k/v, and a wider layer.
SHAPES = ((576, 1536), (1536, 576), (576, 960), (512, 2816))


def _copies(bytes_per_weight: int, weights_mb: float) -> int:
    return max(1, int(weights_mb * 2**20 // bytes_per_weight) + 1) if weights_mb > 0 else 1


def _rates(kernels: list[tuple], x: torch.Tensor, flops: float, repeats: int) -> list[float]:
    """Best GFLOP/s of each (call, weight copies) over ``repeats`` timed passes, each pass at
    least 20 ms of calls cycling over the copies. The kernels take turns within each repeat,
    so that other load on the machine falls on all of them alike."""
    for call, weights in kernels:
        for w in weights[:4]:
            call(x, w)  # warm up the code and the allocator
    best = [float("inf")] * len(kernels)
    for _ in range(repeats):
        for i, (call, weights) in enumerate(kernels):
            calls, start = 0, time.perf_counter()
            while True:
                for w in weights:
                    call(x, w)
                calls += len(weights)
                elapsed = time.perf_counter() - start
                if elapsed >= 0.02:
                    break
            best[i] = min(best[i], elapsed / calls)
    return [flops / t / 1e9 for t in best]


def _shape(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KxN (input x output features), got {text!r}") from None
    if k < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"K and N must be positive, got {text!r}")
    return k, n


def _bf16_main(args: argparse.Namespace) -> int:
    """bfloat16 ``torch.mm`` against the w8a8 kernel on bfloat16 rows."""
    from mqinfer.workers.engine.models.layers import LMHead

    if not q8.native_takes_bf16():
        print("the w8a8 kernel does not take bfloat16 rows here (it needs AVX-512 VNNI)")
        return 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"one thread, weights {'hot (one copy)' if args.weights_mb <= 0 else f'cycled over {args.weights_mb:g} MB'}, "
          f"best of {args.repeats}")
    print(f"{'K x N':>11} {'rows':>5} | {'bf16':>8} {'w8a8':>8} | {'w8a8/bf16':>9}   (GFLOP/s)")
    for k, n in args.shapes or SHAPES:
        weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        qweight, scale = q8.quantize_weight(weight)
        # LMHead: torch.mm over vocabulary slices, the unquantized model's head (and one mm for
        # the narrower layers, where one slice covers every row).
        b16 = [LMHead(torch.nn.Parameter(weight.clone(), requires_grad=False))
               for _ in range(_copies(2 * k * n, args.weights_mb))]
        a8 = [q8.pack(qweight, scale) for _ in range(_copies(k * n, args.weights_mb))]
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            out = torch.empty(rows, n, dtype=torch.bfloat16)
            flops = 2.0 * rows * k * n
            rb, r8 = _rates([(lambda x, w: w(x, out), b16), (lambda x, w: q8.linear(x, w, out), a8)],
                            x, flops, args.repeats)
            print(f"{k:>5} x {n:<5}{rows:>5} | {_gflops(rb)} {_gflops(r8)} | {r8 / rb:8.2f}x", flush=True)
        del b16, a8
    return 0


def _gflops(rate: float) -> str:
    """A rate in 8 characters: one decimal from 100 up, three significant digits below (a small
    shape on a busy machine runs at a fraction of a GFLOP/s, which one decimal would print as 0)."""
    return f"{rate:8.1f}" if rate >= 100 else f"{rate:8.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weights-mb", type=float, default=96.0)
    parser.add_argument("--shapes", type=_shape, nargs="+", default=None, metavar="KxN",
                        help="Layer shapes, input x output features (default: SmolLM2-135M's gate/up, down and "
                             "q/k/v, and 512x2816; the standard benchmark model's LM head is 512x32000).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32: the float32, w8a16 and w8a8 kernels (CPUs with AVX2 and no AVX-512); "
                             "bfloat16: bfloat16 torch.mm against w8a8 on bfloat16 rows (AVX-512 VNNI).")
    args = parser.parse_args(argv)
    if args.dtype == "bfloat16":
        return _bf16_main(args)
    if not (dense.native_linear_available() and w16.native_available() and q8.native_available()):
        print("the native dense kernels do not run here (they need AVX2 and FMA without AVX-512)")
        return 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"one thread, weights {'hot (one copy)' if args.weights_mb <= 0 else f'cycled over {args.weights_mb:g} MB'}, "
          f"best of {args.repeats}")
    print(f"{'K x N':>11} {'rows':>5} | {'float32':>8} {'w8a16':>8} {'w8a8':>8} | {'w8a16/f32':>9} {'w8a8/f32':>9}"
          "   (GFLOP/s)")
    for k, n in args.shapes or SHAPES:
        weight = torch.randn(n, k) * 0.05
        qweight, scale = q8.quantize_weight(weight)
        f32 = [dense.pack(weight) for _ in range(_copies(4 * k * n, args.weights_mb))]
        a16 = [w16.pack(qweight, scale) for _ in range(_copies(k * n, args.weights_mb))]
        a8 = [q8.pack(qweight, scale) for _ in range(_copies(k * n, args.weights_mb))]
        for rows in args.rows:
            x = torch.randn(rows, k)
            out = torch.empty(rows, n)
            flops = 2.0 * rows * k * n
            r32, r16, r8 = _rates([(lambda x, w: dense.linear(x, w, None, out), f32),
                                   (lambda x, w: w16.linear(x, w, out), a16),
                                   (lambda x, w: q8.linear(x, w, out), a8)], x, flops, args.repeats)
            print(f"{k:>5} x {n:<5}{rows:>5} | {_gflops(r32)} {_gflops(r16)} {_gflops(r8)} | {r16 / r32:8.2f}x {r8 / r32:8.2f}x",
                  flush=True)
        del f32, a16, a8
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
