"""The Triton KV store and paged attention, run by Triton's interpreter on the CPU in float32,
held to the float64 definition and to the PyTorch path (the interpreter has no bf16)."""

from __future__ import annotations

import os

# Before triton is imported anywhere in this process: @triton.jit picks the interpreter at
# decoration time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from mqinfer.kernels import attention, triton_attention, triton_attention_kernels, triton_store  # noqa: E402


def _ensure_interpreted():
    """Kernels decorated before TRITON_INTERPRET was set (another module imported them first)
    are compiled-GPU kernels; with no GPU here, decorate them again under the interpreter."""
    global triton_attention, triton_attention_kernels, triton_store
    if type(triton_attention_kernels.paged_attention_kernel).__name__ != "InterpretedFunction":
        triton_store = importlib.reload(triton_store)
        triton_attention_kernels = importlib.reload(triton_attention_kernels)
        triton_attention = importlib.reload(triton_attention)


_ensure_interpreted()

HEAD_DIM = 64
NUM_KV_HEADS = 2


def _make_step(query_lens, seq_lens, block_size, g, seed, head_dim=HEAD_DIM, num_kv_heads=NUM_KV_HEADS):
    """Random caches over shuffled, disjoint block tables (sometimes a spare block), and this
    step's q/k/v as views of one fused QKV tensor, strided as the model hands them over."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) + 1 for s in seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-s // block_size) + rng.randint(0, 1))] for s in seq_lens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    hq = num_kv_heads * g
    qkv = torch.randn(sum(query_lens), hq + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + num_kv_heads], qkv[:, hq + num_kv_heads :]
    md = attention.build_attention_metadata(query_lens, seq_lens, tables, block_size, g)
    return q, k, v, k_cache, v_cache, md, tables


def _check(query_lens, seq_lens, block_size, g, seed, num_kv_splits=None, **shape):
    q, k, v, k_cache, v_cache, md, tables = _make_step(query_lens, seq_lens, block_size, g, seed, **shape)
    k_torch, v_torch = k_cache.clone(), v_cache.clone()
    attention.store_kv(k, v, k_torch, v_torch, md.slot_mapping)
    triton_attention.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    # A store is a copy: bit for bit what the PyTorch path writes, nothing else touched.
    assert torch.equal(k_cache, k_torch) and torch.equal(v_cache, v_torch)

    scale = q.shape[2] ** -0.5
    out = triton_attention.paged_attention(q, k_cache, v_cache, md, scale, num_kv_splits=num_kv_splits)
    ref = attention.reference_paged_attention(q, k_cache, v_cache, query_lens, seq_lens, tables, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch_out = attention.paged_attention(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    return out, md


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("g", [1, 4])
def test_mixed_decode_and_prefill_match_reference(block_size, g):
    # Decodes and prefill chunks in one step; contexts ending mid-block and on a block
    # boundary; fresh prompts and chunks continuing an earlier prefill (query < context); a
    # chunk longer than one prefill tile.
    query_lens = [1, 7, 1, 40, 1, 16, 5]
    seq_lens = [1, 7, 45, 40, block_size * 2, 50, 5 + block_size]
    _, md = _check(query_lens, seq_lens, block_size, g, seed=block_size + g)
    assert md.num_tokens > len(query_lens)  # the prefill (packed tiles) path


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("g", [1, 4])
def test_pure_decode_step_matches_reference(block_size, g):
    # One query per sequence: the decode path (tile = sequence), contexts ending mid-block.
    _check([1] * 5, [1, 17, block_size + 3, 70, 2 * block_size], block_size, g, seed=g)


@pytest.mark.parametrize("num_kv_splits", [2, 3])
def test_decode_split_across_programs_merges_exactly(num_kv_splits):
    # Flash-decoding: the keys of each sequence split over programs, merged by a second
    # kernel. Short sequences leave later splits empty; those must weigh nothing.
    out, _ = _check([1] * 4, [5, 100, 130, 33], 16, 4, seed=num_kv_splits, num_kv_splits=num_kv_splits)
    whole, _ = _check([1] * 4, [5, 100, 130, 33], 16, 4, seed=num_kv_splits, num_kv_splits=1)
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)


def test_odd_group_and_head_dim():
    # g = 3 (rows per tile not a power of two) and head_dim 80 (padded lanes masked).
    _check([1, 9, 20], [30, 9, 41], 16, 3, seed=5, head_dim=80)


@pytest.mark.parametrize("slots", [[17, -1, 5], [17, 32, 5]], ids=["negative", "one-past-the-end"])
def test_store_refuses_slots_outside_the_cache_and_writes_nothing(slots):
    k_cache = torch.zeros(2, 16, 2, 8)
    v_cache = torch.zeros(2, 16, 2, 8)
    k = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"slot_mapping names slots outside the cache \(0\.\.31\)"):
        triton_attention.store_kv(k, k, k_cache, v_cache, torch.tensor(slots))
    assert k_cache.count_nonzero() == 0 and v_cache.count_nonzero() == 0


def test_store_checks_a_slot_mapping_again_once_it_is_written_or_the_cache_shrinks():
    k = torch.randn(2, 2, 8)
    slots = torch.tensor([3, 40])
    big = torch.zeros(4, 16, 2, 8)
    triton_attention.store_kv(k, k, big, big.clone(), slots)
    triton_attention.store_kv(k, k, big, big.clone(), slots)  # the same mapping, another layer
    assert torch.equal(big[2, 8], k[1])
    # A smaller cache: slot 40 is now outside it.
    small = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match=r"outside the cache \(0\.\.31\), got 3\.\.40"):
        triton_attention.store_kv(k, k, small, small.clone(), slots)
    # The same tensor written in place after it passed: checked again.
    triton_attention.store_kv(k, k, big, big.clone(), slots)
    slots[0] = -2
    with pytest.raises(ValueError, match=r"got -2\.\.40"):
        triton_attention.store_kv(k, k, big, big.clone(), slots)


def test_store_checks_slot_mappings_made_in_inference_mode():
    # The model runner builds each step's metadata under inference_mode: tensors without a
    # write counter. Each new mapping is still checked; the same one is checked once.
    k = torch.randn(2, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    with torch.inference_mode():
        good, bad = torch.tensor([3, 31]), torch.tensor([3, 32])
        for _ in range(2):
            triton_attention.store_kv(k, k, cache, cache.clone(), good)
        with pytest.raises(ValueError, match=r"outside the cache \(0\.\.31\), got 3\.\.32"):
            triton_attention.store_kv(k, k, cache, cache.clone(), bad)
    assert torch.equal(cache[1, 15], k[1])


def test_store_kernel_skips_slots_outside_the_cache_and_writes_the_rest():
    # The kernel's own guard, for a launch planned without store_kv's host check.
    k_cache = torch.zeros(2, 16, 2, 8)
    v_cache = torch.zeros(2, 16, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    triton_store.plan_store_kv(k, v, k_cache, v_cache, torch.tensor([17, -1, 32])).run()
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[1, 1], v[0])
    # Only slot 17 was written: -1 and 32 (one past the end) were skipped.
    assert k_cache.count_nonzero() == k[0].count_nonzero()
    assert v_cache.count_nonzero() == v[0].count_nonzero()


def _corrupt(md, name, index, value):
    """A copy of one of the metadata's index tensors with one entry replaced."""
    bad = getattr(md, name).clone()
    bad[index] = value
    setattr(md, name, bad)


@pytest.mark.parametrize(
    "name, index, value, message",
    [
        pytest.param("seq_of_token", 1, 2, r"seq_of_token names sequences outside the block tables \(0\.\.1\)",
                     id="sequence-past-the-tables"),
        pytest.param("seq_of_token", 0, -1, "seq_of_token names sequences outside", id="negative-sequence"),
        pytest.param("positions", 0, -1, r"token positions must lie in 0\.\.31", id="negative-position"),
        pytest.param("positions", 2, 32, r"token positions must lie in 0\.\.31", id="position-past-the-table"),
        pytest.param("positions", 2, 20, r"max_seq_len - 1 \(8\)", id="position-past-max-seq-len"),
        pytest.param("block_tables", (1, 0), 6, r"block tables name blocks outside the cache \(0\.\.5\)",
                     id="block-past-the-cache"),
        pytest.param("block_tables", (0, 1), -1, r"outside the cache \(0\.\.5\), got -1", id="negative-block"),
        pytest.param("seq_lens", 1, 33, r"seq_lens must lie within the block tables .*got up to 33",
                     id="context-past-the-table"),
        pytest.param("seq_lens", 0, 1, "seq_lens must be at least each sequence's number of query tokens",
                     id="context-shorter-than-its-queries"),
        pytest.param("query_start_loc", 2, 4, "query_start_loc must rise from 0 to the 3 query tokens",
                     id="queries-past-the-batch"),
        pytest.param("query_start_loc", 1, 0, "query_start_loc must rise", id="sequence-without-queries"),
    ],
)
def test_a_bad_index_is_refused_before_the_triton_kernels_read_it(name, index, value, message):
    # Two sequences (2 and 1 queries, contexts 5 and 9) over tables two blocks of 16 wide and a
    # cache of 6 blocks; one index made bad at a time. Only a clean ValueError may come out,
    # and the attention kernel must not have run (the output is never handed back).
    q, _, _, k_cache, v_cache, md, _ = _make_step([2, 1], [5, 9], 16, 2, seed=3)
    k_cache, v_cache = k_cache[:6], v_cache[:6]
    md.block_tables = torch.tensor([[0, 1], [2, 3]])
    _corrupt(md, name, index, value)
    with pytest.raises(ValueError, match=message):
        triton_attention.paged_attention(q, k_cache, v_cache, md, 0.1)


def test_indices_are_checked_once_per_step_and_again_for_another_cache():
    q, k, v, k_cache, v_cache, md, tables = _make_step([2, 1], [5, 9], 16, 2, seed=4)
    scale = HEAD_DIM**-0.5
    triton_attention.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    out = triton_attention.paged_attention(q, k_cache, v_cache, md, scale)
    assert md.triton_checked_blocks == k_cache.shape[0]
    torch.testing.assert_close(out, attention.reference_paged_attention(q, k_cache, v_cache, [2, 1], [5, 9], tables,
                                                                        scale), rtol=1e-5, atol=1e-5)
    # The same step over a cache too small for its block ids: checked again, refused.
    highest = max(b for t in tables for b in t)
    with pytest.raises(ValueError, match=rf"outside the cache \(0\.\.{highest - 1}\)"):
        triton_attention.paged_attention(q, k_cache[:highest], v_cache[:highest], md, scale)


def test_store_converts_to_the_cache_dtype():
    k_cache = torch.zeros(1, 16, 1, 16, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(2, 1, 16)
    triton_store.store_kv(k, k * 2, k_cache, v_cache, torch.tensor([3, 0]))
    assert torch.equal(k_cache[0, 3], k[0].double()) and torch.equal(v_cache[0, 0], (k[1] * 2).double())


def test_bad_inputs_are_named():
    q, k, v, k_cache, v_cache, md, _ = _make_step([2, 1], [5, 9], 16, 2, seed=0)
    with pytest.raises(ValueError, match="query heads do not match"):
        triton_attention.paged_attention(q[:, :3], k_cache, v_cache, md, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention.paged_attention(q[:, :, :32], k_cache, v_cache, md, 0.1)
    with pytest.raises(ValueError, match="v_cache is torch.float64"):
        triton_attention.paged_attention(q, k_cache, v_cache.double(), md, 0.1)
    with pytest.raises(ValueError, match="must be \\[T, 2, 64\\]"):
        triton_attention.store_kv(k[:, :1], v, k_cache, v_cache, md.slot_mapping)
    with pytest.raises(ValueError, match="one entry per packed token"):
        triton_attention.store_kv(k, v, k_cache, v_cache, md.slot_mapping[:2])
    with pytest.raises(ValueError, match="num_kv_splits"):
        triton_attention.paged_attention(q[:2], k_cache, v_cache, attention.build_attention_metadata(
            [1, 1], [5, 9], [[0], [1]], 16, 2), 0.1, num_kv_splits=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_8bit_cache_store_and_attention(dtype):
    # A whole context stored by the Triton kernel into 8-bit caches: the same bytes and scales as
    # the PyTorch quantizing store (zero rows and tiny values included). Then decode steps (with
    # and without a split) and a mixed step read it, against the reference over the same values.
    block_size, g, head_dim = 16, 2, 16
    seq_lens = [5, 35, 17]
    _, _, _, k_cache, _, _, tables = _make_step([1] * 3, seq_lens, block_size, g, seed=11, head_dim=head_dim)
    gen = torch.Generator().manual_seed(11)
    shape = k_cache.shape
    whole = attention.build_attention_metadata(seq_lens, seq_lens, tables, block_size, g)
    k = torch.randn(sum(seq_lens), NUM_KV_HEADS, head_dim, generator=gen) * 4
    v = torch.randn(sum(seq_lens), NUM_KV_HEADS, head_dim, generator=gen)
    k[3] = 0.0
    v[8, 1, :5] = 1e-3
    caches = []
    for store in (attention.store_kv, triton_attention.store_kv):
        cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                 torch.zeros(shape[:3], dtype=torch.bfloat16), torch.zeros(shape[:3], dtype=torch.bfloat16))
        store(k, v, *cache[:2], whole.slot_mapping, *cache[2:])
        caches.append(cache)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8) if a.dtype == dtype else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype == dtype else b.view(torch.int16))
    k_cache, v_cache, k_scale, v_scale = caches[1]
    scale = head_dim**-0.5
    for query_lens, splits in (([1] * 3, 2), ([1, 9, 17], None)):
        md = attention.build_attention_metadata(query_lens, seq_lens, tables, block_size, g)
        q = torch.randn(sum(query_lens), NUM_KV_HEADS * g, head_dim, generator=gen)
        out = triton_attention.paged_attention(q, k_cache, v_cache, md, scale, num_kv_splits=splits,
                                               k_scale=k_scale, v_scale=v_scale)
        ref = attention.reference_paged_attention(q, k_cache, v_cache, query_lens, seq_lens, tables, scale,
                                                  k_scale, v_scale)
        assert out.dtype == torch.float32
        # The same dequantized values, float32 (IEEE dots) against float64.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 45), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1, max_size=4,
    ),
    decode_every=st.integers(1, 3),
    block_size=st.sampled_from([16, 32]),
    g=st.sampled_from([1, 4]),
    seed=st.integers(0, 1000),
)
def test_random_steps_match_the_pytorch_path(data, decode_every, block_size, g, seed):
    query_lens = [1 if i % decode_every == 0 else q for i, (q, _) in enumerate(data)]
    seq_lens = [s for _, s in data]
    q, k, v, k_cache, v_cache, md, _ = _make_step(query_lens, seq_lens, block_size, g, seed)
    triton_attention.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = triton_attention.paged_attention(q, k_cache, v_cache, md, scale)
    torch_out = attention.paged_attention(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)


def test_engine_with_the_triton_kernels_generates_what_the_pytorch_path_does(monkeypatch):
    # The kernels as drop-ins inside the real model (fused-QKV views, rotary output, the
    # runner's metadata): the built-in tiny Llama (head_dim 64, g = 2), chunked prefill of
    # several prompts beside running decodes, greedy tokens compared one for one.
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine
    from mqinfer.workers.engine.models import llama

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 50))] for _ in range(3)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def generate():
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_threads=1, num_kv_blocks=64,
                                        max_num_batched_tokens=24, max_num_seqs=3))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy)
        done = {}
        while engine.has_unfinished():
            for out in engine.step().outputs:
                if out.finished:
                    done[out.request_id] = out.output_token_ids
        return done

    # Without the fused native ops the model writes K/V through store_kv itself (else the native
    # rotary kernel writes them on the CPU and the Triton store would never run).
    monkeypatch.setenv("MQINFER_CPU_OPS", "torch")
    expected = generate()
    slot_mappings = []

    def triton_store_kv(*args, **kwargs):
        slot_mappings.append(args[4])
        triton_attention.store_kv(*args, **kwargs)

    monkeypatch.setattr(llama, "store_kv", triton_store_kv)
    monkeypatch.setattr(llama, "paged_attention", triton_attention.paged_attention)
    assert generate() == expected
    assert len(expected) == 3 and all(len(t) == 4 for t in expected.values())
    # Every layer's store of a step got the same slot mapping (checked once, then trusted).
    assert len(slot_mappings) > len({id(s) for s in slot_mappings}) > 1
