"""The native fused CPU ops (kernels/cpu_ops.py), held bit for bit to their PyTorch references
in float32 and bfloat16, at odd sizes, on strided views, with edge values and several threads."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels.cpu_ops import (
    add_rms_norm,
    apply_token_bitmask,
    cpu_ops_available,
    greedy_argmax,
    gumbel_argmax,
    gumbel_tables,
    reference_add_rms_norm,
    reference_apply_token_bitmask,
    reference_greedy_argmax,
    reference_gumbel_argmax,
    reference_rotary_store_kv,
    reference_silu_mul,
    rotary_store_kv,
    silu_mul,
    unpack_bitmask,
)
from mqinfer.kernels.draws import gumbel_noise, row_keys, uniforms_of_draws

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="no C compiler for the native CPU ops")

DTYPES = [torch.float32, torch.bfloat16]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so the sign of zero counts), NaN where the other is NaN (payloads
    are not compared: PyTorch's own conversions do not agree on them)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a[~nan].view(view), b[~nan].view(view))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


# ------------------------------------------------------------------ token bitmask
def _masks(n: int, words: int, seed: int) -> torch.Tensor:
    """Packed masks with the words structured output makes: all allowed, none, and mixed."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 3, (n, words), generator=g)
    return torch.where(kind == 0, torch.full_like(mask, -1), torch.where(kind == 1, torch.zeros_like(mask), mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cols", "words"), [(1, 1), (31, 1), (32, 1), (33, 2), (264, 9), (49152, 1536),
                                             (1000, 20)])  # the last: columns past the mask's words
def test_token_bitmask_matches_the_reference(dtype, cols, words):
    torch.manual_seed(cols)
    logits = (torch.randn(9, cols) * 3).to(dtype)
    logits[0, 0] = float("nan")  # a NaN where allowed stays, where forbidden becomes -inf
    mask = _masks(5, words, cols)
    rows = torch.tensor([7, 0, 3, 8, 2])
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask(got, mask, rows)
    reference_apply_token_bitmask(want, mask, rows)
    assert _same_bits(got, want)
    untouched = [1, 4, 5, 6]
    assert _same_bits(got[untouched], logits[untouched])
    allowed = unpack_bitmask(mask, cols)
    assert torch.equal(got[rows].isneginf() & ~logits[rows].isneginf(), ~allowed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bitmask_strided_rows_threads_and_bad_rows(dtype, threads):
    wide = torch.randn(70, 3000).to(dtype)
    view = wide[:, 5:2005]
    mask = _masks(64, 63, 1)
    rows = torch.randperm(70)[:64]
    want = view.clone()
    reference_apply_token_bitmask(want, mask, rows)
    for n in (1, 3):
        threads(n)
        got = wide.clone()[:, 5:2005]
        apply_token_bitmask(got, mask, rows)
        assert _same_bits(got, want)
    with pytest.raises(ValueError):
        apply_token_bitmask(view.clone(), mask, rows[:3])
    with pytest.raises(ValueError):
        apply_token_bitmask(view.clone(), mask[:1], torch.tensor([70]))
    half = view.half()
    expected = half.clone()
    reference_apply_token_bitmask(expected, mask, rows)
    apply_token_bitmask(half, mask, rows)  # float16: the PyTorch path
    assert torch.equal(half, expected)


def test_unpack_bitmask_reads_least_significant_bit_first():
    mask = torch.tensor([[0b101, -1]], dtype=torch.int32)
    assert torch.nonzero(unpack_bitmask(mask, 40)[0]).flatten().tolist() == [0, 2, *range(32, 40)]
    assert unpack_bitmask(mask, 70)[0, 64:].tolist() == [False] * 6


# ------------------------------------------------------------------ greedy argmax
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 5, 15, 16, 17, 33, 1000, 32003])
def test_argmax_matches_max_indices(dtype, cols):
    torch.manual_seed(cols)
    logits = (torch.randn(37, cols) * 4).to(dtype)  # bfloat16 rounding makes ties common
    assert torch.equal(greedy_argmax(logits), reference_greedy_argmax(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_nan_and_infinities(dtype):
    cols = 100
    rows = torch.zeros(7, cols)
    rows[0, [3, 40, 99]] = 5.0  # ties: the first
    rows[1, 57] = float("nan")  # a NaN is the maximum (torch's rule)
    rows[2, [20, 90]] = float("nan")  # the first NaN
    rows[2, 10] = float("inf")
    rows[3] = float("-inf")  # all -inf: index 0
    rows[4, 98:] = float("inf")  # in the scalar tail
    rows[5, 99] = float("nan")  # NaN in the tail only
    rows[6, 0] = -0.0
    rows[6, 1:] = -1.0
    x = rows.to(dtype)
    got = greedy_argmax(x)
    assert torch.equal(got, reference_greedy_argmax(x))
    assert got.tolist() == [3, 57, 20, 0, 98, 99, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_strided_rows_and_threads(dtype, threads):
    torch.manual_seed(1)
    wide = torch.randn(300, 5000).to(dtype)
    view = wide[:, 7:4007]  # row stride 5000, 4000 columns
    threads(1)
    one = greedy_argmax(view)
    threads(3)
    three = greedy_argmax(view)
    assert torch.equal(one, reference_greedy_argmax(view)) and torch.equal(one, three)


def test_argmax_falls_back_for_other_dtypes_and_empty():
    x = torch.randn(4, 9).half()
    assert torch.equal(greedy_argmax(x), reference_greedy_argmax(x))
    assert greedy_argmax(torch.empty(0, 9)).shape == (0,)


# ------------------------------------------------------------------ Gumbel-max draw
def _keys(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return row_keys(torch.randint(0, 1 << 62, (rows,), generator=g), torch.randint(0, 9000, (rows,), generator=g))


@pytest.mark.parametrize("cols", [1, 7, 15, 16, 17, 100, 4097, 49152])
@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 8.0, 40.0])
def test_gumbel_argmax_matches_reference(cols, scale):
    # scale 0: flat rows, every column passes the first bound; 40: peaked rows, few do.
    torch.manual_seed(cols)
    x = torch.randn(33, cols) * scale
    keys = _keys(33, cols)
    assert torch.equal(gumbel_argmax(x, keys), reference_gumbel_argmax(x, keys))


def test_gumbel_argmax_masked_rows_ties_and_non_finite_values():
    cols = 300
    x = torch.randn(9, cols)
    x[0, torch.randperm(cols)[:250]] = float("-inf")  # top-k / top-p masks
    x[1] = float("-inf")
    x[1, 123] = 2.0  # one token left: it
    x[2] = float("-inf")  # nothing left: index 0, as torch's argmax
    x[3, [10, 299]] = float("inf")  # the first +inf
    x[4, [50, 7]] = float("nan")  # the first NaN
    x[5, 296] = float("nan")  # NaN in the scalar tail
    x[6] = 0.5  # flat
    x[7, :] = float("-inf")
    x[7, 290:] = 1.0  # survivors in the tail only
    x[8] = 1e30  # huge logits: the noise rounds away, ties everywhere
    keys = _keys(9, 1)
    got = gumbel_argmax(x, keys)
    assert torch.equal(got, reference_gumbel_argmax(x, keys))
    assert got[1] == 123 and got[2] == 0 and got[3] == 10 and got[4] == 7 and got[5] == 296 and got[8] == 0


def test_gumbel_argmax_model_like_rows_strided_and_threads(threads):
    torch.manual_seed(2)
    wide = torch.randn(64, 5000) * 3 + torch.randn(64, 1)
    view = wide[:, 11:4111]  # row stride 5000
    keys = _keys(64, 2)
    threads(1)
    one = gumbel_argmax(view, keys)
    threads(3)
    three = gumbel_argmax(view, keys)
    assert torch.equal(one, reference_gumbel_argmax(view, keys)) and torch.equal(one, three)


def test_gumbel_tables_hold_every_draws_noise_and_bucket_bounds():
    noise, bucket_max = gumbel_tables()
    assert noise.shape == (1 << 23,) and bucket_max.shape == (1 << 11,)
    # Every draw's noise, bit for bit as the reference makes it from the draw's integer bits.
    assert _same_bits(noise, gumbel_noise(uniforms_of_draws(torch.arange(1 << 23, dtype=torch.int64))))
    assert bool((noise.view(1 << 11, -1) <= bucket_max[:, None]).all())


def test_gumbel_argmax_falls_back_for_other_dtypes_and_empty():
    x = torch.randn(4, 9).to(torch.bfloat16)
    keys = _keys(4, 3)
    assert torch.equal(gumbel_argmax(x, keys), reference_gumbel_argmax(x, keys))
    assert gumbel_argmax(torch.empty(0, 9), keys[:0]).shape == (0,)


# ------------------------------------------------------------------ residual add + RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 3, 7, 8, 15, 17, 64, 100, 512, 513, 1000, 4101])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_bit_for_bit(dtype, hidden, with_delta):
    torch.manual_seed(hidden)
    residual = (torch.randn(19, hidden) * 3).to(dtype)
    delta = torch.randn(19, hidden).to(dtype) if with_delta else None
    weight = torch.empty(hidden).uniform_(0.5, 1.5).to(dtype)
    ref_sum, ref_out = reference_add_rms_norm(residual, delta, weight, 1e-6)
    new_sum, out = add_rms_norm(residual.clone(), delta, weight, 1e-6)
    assert _same_bits(new_sum, ref_sum)
    assert _same_bits(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_a_strided_residual_in_place(dtype, threads):
    torch.manual_seed(0)
    big = torch.randn(400, 600).to(dtype)
    delta_big = torch.randn(400, 700).to(dtype)
    weight = torch.empty(512).uniform_(0.5, 1.5).to(dtype)
    ref_sum, ref_out = reference_add_rms_norm(big[:, 10:522], delta_big[:, 100:612], weight, 1e-5)
    threads(3)
    residual = big.clone()[:, 10:522]
    new_sum, out = add_rms_norm(residual, delta_big[:, 100:612], weight, 1e-5)
    assert new_sum.data_ptr() == residual.data_ptr()  # the sum went into the residual itself
    assert _same_bits(new_sum, ref_sum) and _same_bits(out, ref_out)


# ------------------------------------------------------------------ SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 7, 16, 17, 31, 33, 63, 65, 100, 1408, 2000])
def test_silu_mul_bit_for_bit(dtype, inter, threads):
    torch.manual_seed(inter)
    scales = torch.tensor([0.01, 1.0, 5.0, 30.0, 120.0])[torch.randint(0, 5, (41, 1))]
    gate_up = (torch.randn(41, 2 * inter) * scales).to(dtype)
    # The reference on one thread: PyTorch on several cuts its work at arbitrary elements, and
    # the few values next to a cut inside a row take its scalar exponential instead of the
    # vectorised one. The kernel computes every row as one-thread PyTorch does.
    threads(1)
    expected = reference_silu_mul(gate_up)
    threads(3)
    assert _same_bits(silu_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_edge_values_and_strided_rows(dtype):
    edges = [-200.0, -104.5, -100.0, -88.8, -88.72283935546875, -87.5, -0.0, 0.0, 1e-30, 87.0,
             88.8, 104.5, 200.0, float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(edges * 8).view(2, 64)  # 64 per row: the vector path and the tail
    up = torch.linspace(-2, 2, 128).view(2, 64)
    wide = torch.cat([gate, up, torch.ones(2, 10)], dim=1).to(dtype)
    gate_up = wide[:, :128]  # rows strided by 138
    assert _same_bits(silu_mul(gate_up), reference_silu_mul(gate_up))


# ------------------------------------------------------------------ rotary + KV store
def _rope_tables(max_len, head_dim):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 8, 2, 64), (37, 3, 1, 6), (19, 32, 8, 128), (1, 1, 1, 2)])
def test_rotary_store_kv_bit_for_bit(dtype, shape, threads):
    num_tokens, hq, hkv, d = shape
    torch.manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d).to(dtype)  # the fused projection's output
    qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    cos, sin = _rope_tables(300, d)
    positions = torch.randint(0, 300, (num_tokens,))
    num_blocks, block_size = 9, 16
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    k_ref = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
    v_ref = torch.zeros_like(k_ref)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q_ref = reference_rotary_store_kv(qk.clone(), v.clone(), hq, cos, sin, positions, k_ref, v_ref, slots)
    threads(2)
    q_got = rotary_store_kv(qk, v, hq, cos, sin, positions, k_got, v_got, slots)
    assert q_got.data_ptr() == qkv.data_ptr()  # q rotated in place
    assert _same_bits(q_got, q_ref)
    assert _same_bits(k_got, k_ref) and _same_bits(v_got, v_ref)  # untouched slots stay zero


def _tie_row(cache_dtype, d):
    """A row whose max |x| stores as QMAX (scale exactly 1), the rest halfway between two
    neighbouring stored values (int8: x.5; e4m3: midpoints of consecutive codes, subnormals
    included), both signs: every one a round-half-to-even case."""
    if cache_dtype == torch.int8:
        qmax, mids = 127.0, torch.arange(126) + 0.5
    else:
        values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        qmax, mids = 448.0, (values[:-1] + values[1:]) / 2
    picks = mids[torch.linspace(0, mids.numel() - 1, d - 1).long()]
    signs = torch.where(torch.arange(d - 1) % 2 == 0, 1.0, -1.0)
    return torch.cat([torch.tensor([qmax]), picks * signs])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 9, 3, 64), (6, 4, 2, 128), (7, 3, 1, 22), (300, 9, 3, 64)])
def test_rotary_store_into_8bit_cache_bit_for_bit(cache_dtype, dtype, shape, threads):
    # The native kernel quantizes the rotated k and v itself: the same bytes and scales as the
    # PyTorch rotary followed by the quantizing store_kv, and q rotated as with a float cache.
    num_tokens, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(num_tokens * d)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    qk = qkv[:, : (hq + hkv) * d].view(num_tokens, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    cos, sin = _rope_tables(300, d)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen)
    positions[0] = 0  # cos 1, sin 0: k is stored as given, so its ties stay ties
    qk[0, hq:] = v[0] = _tie_row(cache_dtype, d).to(dtype)
    qk[1, hq:] = 0.0  # all-zero rows: scale 0
    v[1] = -0.0
    qk[2, -1, 3] *= 1e4  # an outlier in a k row and in a v row
    v[2, 0, -1] = -3e5
    qk[3, hq:] *= 1e-38  # subnormal scales, and (v) rows whose scale underflows to 0
    v[3] = torch.where(torch.arange(d) % 3 == 0, 1e-44, 0.0).to(dtype)
    num_blocks = num_tokens // 16 + 2
    num_slots = num_blocks * 16
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]

    def cache():
        shape_ = (num_blocks, 16, hkv, d)
        return (torch.full(shape_, 5, dtype=torch.uint8).view(cache_dtype), torch.zeros(shape_, dtype=cache_dtype),
                torch.full(shape_[:3], -1.0, dtype=torch.bfloat16), torch.full(shape_[:3], -1.0, dtype=torch.bfloat16))

    ref, got = cache(), cache()
    q_ref = reference_rotary_store_kv(qk.clone(), v.clone(), hq, cos, sin, positions, *ref[:2], slots,
                                      k_scale=ref[2], v_scale=ref[3])
    threads(2)
    q_got = rotary_store_kv(qk, v, hq, cos, sin, positions, *got[:2], slots, k_scale=got[2], v_scale=got[3])
    assert q_got.data_ptr() == qkv.data_ptr()  # the native kernel ran: q rotated in place
    assert _same_bits(q_got, q_ref)
    for a, b in zip(got[:2], ref[:2]):  # every slot: the untouched ones keep their bytes
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(got[2:], ref[2:]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    k_scale = got[2].view(num_slots, hkv)[slots]
    assert bool((k_scale[1] == 0).all()) and bool((k_scale[0] == 1).all())  # the rows meant as such


def test_rotary_store_kv_checks_untrusted_indices():
    qk, v = torch.randn(2, 3, 4), torch.randn(2, 1, 4)
    cos, sin = _rope_tables(10, 4)
    caches = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    with pytest.raises(ValueError, match="rotary table"):
        rotary_store_kv(qk, v, 2, cos, sin, torch.tensor([0, 10]), *caches, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="outside the cache"):
        rotary_store_kv(qk, v, 2, cos, sin, torch.tensor([0, 1]), *caches, torch.tensor([0, 8]))


@pytest.mark.parametrize("trusted", [False, True])
def test_rotary_store_kv_refuses_indices_shorter_or_longer_than_the_tokens(trusted):
    # The kernel reads positions[t] and slots[t] for every token t: a short index would be read
    # past its end (trusted or not, the values may be fine and the length wrong).
    qk, v = torch.randn(3, 3, 4), torch.randn(3, 1, 4)
    cos, sin = _rope_tables(10, 4)
    caches = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    ok = torch.tensor([0, 1, 2])
    for positions, slots, name in ((torch.tensor([0, 1]), ok, "positions"), (ok, torch.tensor([0, 1]), "slot_mapping"),
                                   (ok, torch.tensor([0, 1, 2, 3]), "slot_mapping"),
                                   (ok.view(3, 1), ok, "positions")):
        with pytest.raises(ValueError, match=f"{name} must hold one entry per token \\(3\\)"):
            rotary_store_kv(qk, v, 2, cos, sin, positions, *caches, slots, trusted=trusted)


# ------------------------------------------------------------------ switches
def test_env_switch_forces_the_pytorch_path(monkeypatch):
    monkeypatch.setenv("MQINFER_CPU_OPS", "torch")
    assert not cpu_ops_available()
    assert not cpu_ops.native_for(torch.zeros(2))
    x = torch.randn(3, 40)
    assert torch.equal(greedy_argmax(x), reference_greedy_argmax(x))
    monkeypatch.setenv("MQINFER_CPU_OPS", "sometimes")
    with pytest.raises(ValueError, match="MQINFER_CPU_OPS"):
        cpu_ops_available()
