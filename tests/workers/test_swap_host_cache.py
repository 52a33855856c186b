"""The host-memory KV pool for swap preemption: block copies out and back, on both copy paths.

The CPU path (index copies) is what runs on a CPU engine; the device path (a gather on the
device, then one copy per run of consecutive host blocks) is what runs on CUDA. Both are
exercised here on CPU tensors, which is the same code with the device being the host.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mqinfer.workers.engine.swap import HostKVCache, _gather_to_host, _runs, _scatter_from_host, num_swap_blocks_for

BLOCK = (4, 2, 8)  # block_size, num_kv_heads, head_dim


def device_caches(num_blocks: int, num_layers: int = 3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    def block():
        return torch.randn((num_blocks, *BLOCK), generator=g).to(dtype)

    return [(block(), block()) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_go_out_and_come_back_bit_for_bit(dtype):
    caches = device_caches(10, dtype=dtype)
    original = [(k.clone(), v.clone()) for k, v in caches]
    host = HostKVCache(6, 3, BLOCK, dtype)
    assert host.nbytes == 3 * 2 * 6 * 4 * 2 * 8 * (4 if dtype == torch.float32 else 2)
    out_pairs = [(7, 2), (1, 0), (4, 5)]
    host.swap_out(caches, out_pairs)
    for layer, (host_layer, (k, v)) in enumerate(zip(host.caches, original)):
        hk, hv = host_layer.k, host_layer.v
        for d, h in out_pairs:
            assert torch.equal(hk[h], k[d]) and torch.equal(hv[h], v[d]), f"layer {layer} block {d}"
    # The device blocks are reused by others, then the request comes back into other blocks.
    for k, v in caches:
        k.fill_(-1.0)
        v.fill_(-1.0)
    host.swap_in(caches, [(2, 0), (0, 9), (5, 3)])
    for (k, v), (ok, ov) in zip(caches, original):
        assert torch.equal(k[0], ok[7]) and torch.equal(k[9], ok[1]) and torch.equal(k[3], ok[4])
        assert torch.equal(v[0], ov[7]) and torch.equal(v[9], ov[1]) and torch.equal(v[3], ov[4])
        untouched = [i for i in range(10) if i not in (0, 9, 3)]
        assert bool((k[untouched] == -1.0).all()) and bool((v[untouched] == -1.0).all())
    host.swap_out(caches, [])  # nothing to do
    host.swap_in(caches, [])


def test_device_path_gathers_and_copies_by_runs():
    src = torch.arange(10 * 4 * 2 * 8, dtype=torch.float32).view(10, *BLOCK)
    host = torch.zeros((8, *BLOCK))
    pairs = sorted([(3, 0), (9, 1), (0, 2), (5, 6), (6, 7)], key=lambda p: p[1])
    runs = _runs([h for _, h in pairs])
    assert runs == [(0, 0, 3), (6, 3, 2)]
    _gather_to_host(src, host, torch.tensor([d for d, _ in pairs]), runs)
    for d, h in pairs:
        assert torch.equal(host[h], src[d])
    assert host[3:6].abs().sum() == 0
    back = torch.zeros_like(src)
    _scatter_from_host(host, back, torch.tensor([d for d, _ in pairs]), runs)
    for d, _ in pairs:
        assert torch.equal(back[d], src[d])
    assert back[[1, 2, 4, 7, 8]].abs().sum() == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), unique=True, max_size=30))
def test_runs_cover_each_id_once_in_order(ids):
    ids = sorted(ids)
    runs = _runs(ids)
    rebuilt = [start + j for start, _, length in runs for j in range(length)]
    assert rebuilt == ids
    assert [offset for _, offset, _ in runs] == [sum(r[2] for r in runs[:i]) for i in range(len(runs))]
    # Runs are maximal: two neighbours never continue each other.
    for (s1, _, l1), (s2, _, _) in zip(runs, runs[1:]):
        assert s1 + l1 < s2


def test_bad_pairs_and_shapes_are_refused():
    caches = device_caches(4, num_layers=2)
    host = HostKVCache(2, 2, BLOCK, torch.float32)
    with pytest.raises(ValueError, match=r"block pair \(1, 2\) out of range \(4 device blocks, 2 host blocks\)"):
        host.swap_out(caches, [(1, 2)])
    with pytest.raises(ValueError, match="out of range"):
        host.swap_in(caches, [(0, 4)])
    with pytest.raises(ValueError, match="got 3 device layers"):
        host.swap_out(device_caches(4, num_layers=3), [(0, 0)])
    with pytest.raises(ValueError, match="do not match host blocks"):
        host.swap_out(device_caches(4, num_layers=2, dtype=torch.bfloat16), [(0, 0)])
    with pytest.raises(ValueError, match="at least one block"):
        HostKVCache(0, 2, BLOCK, torch.float32)


def test_swap_space_sizing():
    assert num_swap_blocks_for(4 << 30, 1 << 20) == 4096
    assert num_swap_blocks_for(1000, 1001) == 0
    with pytest.raises(ValueError):
        num_swap_blocks_for(1000, 0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_8bit_blocks_and_scales_go_out_and_come_back_bit_for_bit(dtype):
    from mqinfer.kernels.kv_quant import LayerKVCache

    g = torch.Generator().manual_seed(1)

    def layer():
        values = lambda: torch.randint(0, 256, (10, *BLOCK), dtype=torch.uint8, generator=g)  # noqa: E731
        k, v = values(), values()
        if dtype == torch.float8_e4m3fn:  # no NaN codes: compare by bytes anyway
            k[(k & 0x7F) == 0x7F] = 0
            v[(v & 0x7F) == 0x7F] = 0
        return LayerKVCache(k.view(dtype), v.view(dtype), torch.rand(10, *BLOCK[:2], generator=g).bfloat16(),
                            torch.rand(10, *BLOCK[:2], generator=g).bfloat16())

    caches = [layer() for _ in range(3)]
    raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    original = [[raw(t).clone() for t in c.tensors()] for c in caches]
    host = HostKVCache(6, 3, BLOCK, dtype, quantized=True)
    # Values (1 byte) and the bfloat16 scales of each (slot, KV head).
    assert host.nbytes == 3 * 2 * 6 * 4 * 2 * (8 + 2)
    host.swap_out(caches, [(7, 2), (1, 0), (4, 5)])
    for c in caches:
        for t in c.tensors():
            raw(t).fill_(7)
    host.swap_in(caches, [(2, 0), (0, 9), (5, 3)])
    for c, orig in zip(caches, original):
        for t, o in zip(c.tensors(), orig):
            assert torch.equal(raw(t)[0], o[7]) and torch.equal(raw(t)[9], o[1]) and torch.equal(raw(t)[3], o[4])
            assert bool((raw(t)[[1, 2, 4, 5, 6, 7, 8]] == 7).all())
    # The device path (gather on the device, copies by runs) moves the same bytes.
    staged = torch.zeros((8, *BLOCK), dtype=raw(caches[0].k).dtype)
    _gather_to_host(raw(caches[0].k), staged, torch.tensor([0, 9]), _runs([3, 4]))
    assert torch.equal(staged[3], original[0][0][7]) and torch.equal(staged[4], original[0][0][1])
    # A host pool without scales refuses an 8-bit device cache, and the other way round.
    with pytest.raises(ValueError, match="device cache has scales but the host cache has none"):
        HostKVCache(2, 3, BLOCK, dtype).swap_out(caches, [(0, 0)])
    with pytest.raises(ValueError, match="device cache has no scales but the host cache has"):
        HostKVCache(2, 3, BLOCK, torch.float32, quantized=True).swap_out(device_caches(4), [(0, 0)])
