"""The 8-bit KV cache: quantization bounds, the quantizing store, and every CPU attention backend
reading int8 / fp8 caches, held to the float64 reference over the same stored values."""

from __future__ import annotations

import random

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels.attention import (
    build_attention_metadata,
    native_attention_available,
    paged_attention,
    reference_paged_attention,
    store_kv,
)
from mqinfer.kernels.kv_quant import (
    KV_CACHE_DTYPES,
    LayerKVCache,
    dequantize_kv,
    kv_bytes_per_token,
    kv_storage_dtype,
    quantize_kv,
)
from mqinfer.workers.config import KV_CACHE_DTYPES as CONFIG_KV_CACHE_DTYPES
from tests.helpers import on_one_thread

INT8, FP8 = torch.int8, torch.float8_e4m3fn
NUM_KV_HEADS = 2

needs_native = pytest.mark.skipif(
    not native_attention_available(), reason="no C compiler for the native CPU attention kernel"
)


def test_choices_and_storage():
    assert KV_CACHE_DTYPES == CONFIG_KV_CACHE_DTYPES == ("auto", "int8", "fp8")
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("int8", torch.float32) == INT8 and kv_storage_dtype("fp8", torch.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, got 'int4'"):
        kv_storage_dtype("int4", torch.float32)
    # 4 layers, 2 KV heads of 64: float32 4096 bytes per token, bfloat16 2048, 8-bit with a
    # bfloat16 scale per row 2 * 4 * 2 * (64 + 2) = 1056: 1.94x the tokens of bfloat16.
    assert kv_bytes_per_token(4, 2, 64, 4) == 4096 and kv_bytes_per_token(4, 2, 64, 2) == 2048
    assert kv_bytes_per_token(4, 2, 64, 4, "int8") == kv_bytes_per_token(4, 2, 64, 2, "fp8") == 1056


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_round_trip_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, NUM_KV_HEADS, 64, generator=g) * torch.logspace(-3, 3, 300)[:, None, None]
    x[7] = 0.0  # an all-zero row: scale 0, reads back as zeros
    x[9, 1, :3] = torch.tensor([5.0, -5.0, 1e-30])  # ties of max |x| on both signs
    values, scale = quantize_kv(x, dtype)
    assert values.dtype == dtype and scale.dtype == torch.bfloat16 and scale.shape == x.shape[:2]
    back = dequantize_kv(values, scale)
    assert torch.equal(scale[7].float(), torch.zeros(NUM_KV_HEADS)) and torch.equal(back[7], torch.zeros_like(back[7]))
    qmax = 127.0 if dtype == INT8 else 448.0
    amax = x.abs().amax(-1)
    exact = amax / qmax
    # The scale is max|x| / QMAX rounded up to the next bfloat16: never below it, less than one
    # bfloat16 step (2^-7 relative) above, and the nearest bfloat16 at or above it.
    s32 = scale.float()
    assert bool((s32 >= exact).all()) and bool((s32 <= exact * (1 + 2**-7)).all())
    below = (scale.view(torch.int16) - 1).view(torch.bfloat16).float()  # the bfloat16 just below
    assert bool((below < exact)[amax > 0].all())
    # No stored magnitude passes QMAX, and each row's largest is within one step of it.
    stored_max = values.float().abs().amax(-1)[amax > 0]
    assert bool((stored_max <= qmax).all())
    # (x / scale >= QMAX / (1 + 2^-7): 126.02 rounds to 126 or 127; 444.5 to e4m3's 416 or 448.)
    assert bool((stored_max >= (126.0 if dtype == INT8 else 416.0)).all())
    err = (back - x).abs()
    s = s32[..., None]
    if dtype == INT8:
        # Rounding to the nearest step of `scale`: at most half a step, plus float32 rounding of
        # the division and of the product (a few ulps of |x|).
        bound = s / 2 + x.abs() * 4e-7
    else:
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of |x| in the normal range; below
        # 2^-6 (subnormals) the step is 2^-9, so half a step is 2^-10 scale units.
        bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) + x.abs() * 4e-7
    assert bool((err <= bound).all()), float((err - bound).max())


def test_fp8_quantization_rounds_like_torch_and_saturates():
    # Rows whose max is 448 store every value as torch's own float32 -> e4m3 conversion does.
    x = torch.tensor([[448.0, -448.0, 17.0, 0.3, 1e-3, -2.0**-8, 2.0**-10, 240.0]])
    values, scale = quantize_kv(x, FP8)
    assert float(scale) == 1.0 and scale.dtype == torch.bfloat16
    assert torch.equal(values.view(torch.uint8), x.to(FP8).view(torch.uint8))


def _step(query_lens, seq_lens, block_size, g, head_dim, dtype, seed, q_dtype=torch.float32):
    """An 8-bit cache filled through store_kv (every context token), shuffled block tables with a
    spare block here and there, this step's metadata and queries."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) + 1 for s in seq_lens) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-s // block_size) + rng.randint(0, 1))] for s in seq_lens]
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    cache = LayerKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                         torch.zeros(shape[:3], dtype=torch.bfloat16), torch.zeros(shape[:3], dtype=torch.bfloat16))
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size, g)
    num_ctx = sum(seq_lens)
    k = torch.randn(num_ctx, NUM_KV_HEADS, head_dim, generator=gen) * 3
    v = torch.randn(num_ctx, NUM_KV_HEADS, head_dim, generator=gen)
    store_kv(k, v, cache.k, cache.v, whole.slot_mapping, cache.k_scale, cache.v_scale)
    md = build_attention_metadata(query_lens, seq_lens, tables, block_size, g)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * g, head_dim, generator=gen).to(q_dtype)
    return cache, md, q, tables


# Decodes and prefill chunks in one step, contexts over several blocks, ending mid-block and on a
# block boundary, and a chunk continuing an earlier prefill.
QUERY_LENS = [1, 7, 1, 20, 1, 5]
SEQ_LENS = [1, 7, 40, 33, 32, 5 + 16]
BACKENDS = ["torch", pytest.param("native", marks=needs_native)]


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim, g", [(16, 1), (16, 3), (64, 4), (64, 3), (128, 4), (128, 3), (128, 2), (64, 8)])
def test_attention_over_8bit_cache_matches_reference(dtype, backend, head_dim, g):
    # head 16: the native kernel's portable loops; 64 / 128: its AVX-512 versions for int8 where
    # the CPU has them; float8, and CPUs without AVX-512: its AVX2 versions.
    cache, md, q, tables = _step(QUERY_LENS, SEQ_LENS, 16, g, head_dim, dtype, seed=head_dim + g)
    scale = head_dim**-0.5
    out = paged_attention(q, cache.k, cache.v, md, scale, backend=backend, k_scale=cache.k_scale,
                          v_scale=cache.v_scale)
    ref = on_one_thread(reference_paged_attention, q, cache.k, cache.v, QUERY_LENS, SEQ_LENS, tables, scale,
                        cache.k_scale, cache.v_scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # The same dequantized values in float32 against float64: only float32 rounding differs.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_native_kernel_decodes_every_stored_value_exactly(dtype, head_dim):
    # One key per sequence: its softmax weight is exactly 1, so the output is its value row as the
    # kernel decodes it, which must be value * scale exactly (one float32 rounding, like dequantize_kv).
    codes = torch.arange(256, dtype=torch.uint8)
    if dtype == FP8:
        codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are never stored
    rows = -(-codes.numel() // head_dim)
    flat = torch.cat([codes, codes[: rows * head_dim - codes.numel()]]).view(rows, 1, head_dim)
    stored = flat.view(torch.int8) if dtype == INT8 else flat.view(FP8)
    cache_v = stored.expand(rows, NUM_KV_HEADS, head_dim).reshape(rows, 1, NUM_KV_HEADS, head_dim).contiguous()
    cache_k = torch.zeros_like(cache_v)
    v_scale = torch.full((rows, 1, NUM_KV_HEADS), 0.37, dtype=torch.bfloat16)
    k_scale = torch.ones(rows, 1, NUM_KV_HEADS, dtype=torch.bfloat16)
    md = build_attention_metadata([1] * rows, [1] * rows, [[b] for b in range(rows)], 1, 1)
    q = torch.randn(rows, NUM_KV_HEADS, head_dim)
    out = paged_attention(q, cache_k, cache_v, md, 1.0, backend="native", k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out, dequantize_kv(cache_v.view(rows, NUM_KV_HEADS, head_dim), v_scale.view(rows, NUM_KV_HEADS)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_bfloat16_queries_over_int8_cache(backend, head_dim):
    cache, md, q, tables = _step(QUERY_LENS, SEQ_LENS, 16, 2, head_dim, INT8, seed=3, q_dtype=torch.bfloat16)
    scale = head_dim**-0.5
    ref = on_one_thread(reference_paged_attention, q.float(), cache.k, cache.v, QUERY_LENS, SEQ_LENS, tables, scale,
                        cache.k_scale, cache.v_scale)
    out = paged_attention(q, cache.k, cache.v, md, scale, backend=backend, k_scale=cache.k_scale,
                          v_scale=cache.v_scale)
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa: outputs of magnitude ~1 are within a few 2^-8.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_native
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim, g", [(16, 1), (16, 3), (64, 4), (64, 3), (128, 4), (128, 3), (128, 2), (64, 8)])
def test_native_bfloat16_activations_over_8bit_cache_round_the_float32_result_once(dtype, head_dim, g):
    # Over an 8-bit cache the native kernel widens bfloat16 queries exactly, computes in float32
    # and rounds the output once, to nearest even: bit for bit its float32 result rounded by
    # torch. Head 16: the portable loops; 64 / 128: the AVX-512 versions for int8 where the CPU
    # has them; float8, and CPUs without AVX-512: the AVX2 versions.
    cache, md, q, _ = _step(QUERY_LENS, SEQ_LENS, 16, g, head_dim, dtype, seed=head_dim * g, q_dtype=torch.bfloat16)
    scale = head_dim**-0.5
    out = paged_attention(q, cache.k, cache.v, md, scale, backend="native", k_scale=cache.k_scale,
                          v_scale=cache.v_scale)
    wide = paged_attention(q.float(), cache.k, cache.v, md, scale, backend="native", k_scale=cache.k_scale,
                           v_scale=cache.v_scale)
    assert out.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(out, wide.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_store_writes_values_and_scales_at_the_mapped_slots_only(dtype):
    shape = (4, 8, NUM_KV_HEADS, 16)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_scale = torch.full(shape[:3], -1.0, dtype=torch.bfloat16)
    v_scale = torch.full(shape[:3], -1.0, dtype=torch.bfloat16)
    k, v = torch.randn(3, NUM_KV_HEADS, 16), torch.randn(3, NUM_KV_HEADS, 16)
    slots = torch.tensor([9, 0, 31])
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    kq, ks = quantize_kv(k, dtype)
    vq, vs = quantize_kv(v, dtype)
    raw = lambda t: t.view(torch.uint8).reshape(32, NUM_KV_HEADS, 16)  # noqa: E731
    assert torch.equal(raw(k_cache)[slots], kq.view(torch.uint8)) and torch.equal(raw(v_cache)[slots], vq.view(torch.uint8))
    assert torch.equal(k_scale.view(32, -1)[slots], ks) and torch.equal(v_scale.view(32, -1)[slots], vs)
    others = [i for i in range(32) if i not in (0, 9, 31)]
    assert bool((raw(k_cache)[others] == 0).all()) and bool((k_scale.view(32, -1)[others] == -1).all())


def test_scales_are_checked():
    shape = (2, 4, NUM_KV_HEADS, 16)
    k_cache, v_cache = torch.zeros(shape, dtype=INT8), torch.zeros(shape, dtype=INT8)
    k, slots = torch.randn(1, NUM_KV_HEADS, 16), torch.tensor([0])
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        store_kv(k, k, k_cache, v_cache, slots, torch.zeros(shape[:3], dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match=r"k_scale must be a contiguous bfloat16 \[2, 4, 2\]"):
        store_kv(k, k, k_cache, v_cache, slots, torch.zeros(2, 4, dtype=torch.bfloat16),
                 torch.zeros(shape[:3], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got torch.float32"):
        store_kv(k, k, k_cache, v_cache, slots, torch.zeros(shape[:3]), torch.zeros(shape[:3]))
    md = build_attention_metadata([1], [1], [[0]], 4, 1)
    with pytest.raises(ValueError, match="needs both"):
        paged_attention(torch.randn(1, NUM_KV_HEADS, 16), k_cache, v_cache, md, 1.0, backend="native")


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_fused_rotary_store_into_8bit_cache_matches_the_reference(dtype):
    # The native rotary kernel (when built) quantizes as it stores: the same bits as the PyTorch
    # rotary followed by store_kv.
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, n = 4, NUM_KV_HEADS, 64, 11
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=gen)
    qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
    pos = torch.arange(n) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1).contiguous(), torch.cat([freqs.sin()] * 2, -1).contiguous()
    slots = torch.randperm(24, generator=gen)[:n]
    shape = (3, 8, hkv, d)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
               torch.zeros(shape[:3], dtype=torch.bfloat16), torch.zeros(shape[:3], dtype=torch.bfloat16))
              for _ in range(2)]
    q_fused = cpu_ops.rotary_store_kv(qk.clone(), v, hq, cos, sin, pos, caches[0][0], caches[0][1], slots,
                                      k_scale=caches[0][2], v_scale=caches[0][3])
    q_ref = cpu_ops.reference_rotary_store_kv(qk.clone(), v, hq, cos, sin, pos, caches[1][0], caches[1][1], slots,
                                              k_scale=caches[1][2], v_scale=caches[1][3])
    assert torch.equal(q_fused, q_ref)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
