"""Per-call time of the CPU rotary + KV store (``cpu_ops.rotary_store_kv``) for each cache dtype,
against two peers measured in the same run: the store into a float32 cache, and the two-pass
8-bit store (the native rotary into a scratch tensor, then the PyTorch quantizing ``store_kv``).

One layer's call at SmolLM2-135M's attention shape by default (9 q heads, 3 KV heads, head_dim
64), float32 activations, best of ``--repeats`` timings of ``--calls`` calls each.

    python -m mqinfer.loadgen.rotary_store_bench --tokens 64 512
"""

from __future__ import annotations

import argparse
import time

import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels.attention import store_kv
from mqinfer.kernels.kv_quant import SCALE_DTYPE

BLOCK_SIZE = 16


def _best_us(fn, calls: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _case(tokens: int, hq: int, hkv: int, d: int, cache_dtype: torch.dtype, two_pass: bool = False):
    """A call of rotary_store_kv (or the two-pass 8-bit store) on fresh tensors, as a closure."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    qk = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    max_len = 4096
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(max_len).float(), inv)] * 2, -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    num_blocks = -(-tokens // BLOCK_SIZE) * 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens]
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    scales = {}
    if cache_dtype in (torch.int8, torch.float8_e4m3fn):
        scales = {"k_scale": torch.zeros(shape[:3], dtype=SCALE_DTYPE),
                  "v_scale": torch.zeros(shape[:3], dtype=SCALE_DTYPE)}
    if two_pass:
        k_rot, v_copy = torch.empty(tokens, hkv, d), torch.empty(tokens, hkv, d)
        rows = torch.arange(tokens)

        def call():
            cpu_ops.rotary_store_kv(qk, v, hq, cos, sin, positions, k_rot, v_copy, rows, trusted=True)
            store_kv(k_rot, v, k_cache, v_cache, slots, scales["k_scale"], scales["v_scale"])
        return call
    return lambda: cpu_ops.rotary_store_kv(qk, v, hq, cos, sin, positions, k_cache, v_cache, slots,
                                           trusted=True, **scales)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"native cpu ops: {cpu_ops.cpu_ops_available()}, threads {args.threads}, "
          f"{args.q_heads} q heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, float32 activations")
    print(f"{'tokens':>6} {'cache':>8} {'us/call':>9} {'vs float32':>10} {'vs two-pass':>11}")
    for tokens in args.tokens:
        shape = (tokens, args.q_heads, args.kv_heads, args.head_dim)
        f32 = _best_us(_case(*shape, torch.float32), args.calls, args.repeats)
        print(f"{tokens:>6} {'float32':>8} {f32:>9.1f} {1.0:>10.2f} {'':>11}")
        for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            two = _best_us(_case(*shape, dtype, two_pass=True), args.calls, args.repeats)
            one = _best_us(_case(*shape, dtype), args.calls, args.repeats)
            print(f"{tokens:>6} {name + ' 2p':>8} {two:>9.1f} {two / f32:>10.2f} {1.0:>11.2f}")
            print(f"{tokens:>6} {name:>8} {one:>9.1f} {one / f32:>10.2f} {one / two:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
