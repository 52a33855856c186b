"""How the KV tiers store a cache in the model's dtype: by default its own bytes, so a block copied
down to the host and disk tiers and back is bit for bit what was computed; int8 only when asked."""

from __future__ import annotations

import hashlib

import pytest
import torch

from mqinfer.kernels.kv_quant import LayerKVCache
from mqinfer.workers.engine.kv_tiers import build_tiers, model_identity

LAYERS, BLOCKS, BLOCK, HEADS, HEAD_DIM = 2, 8, 16, 2, 32


def caches(dtype: torch.dtype, seed: int | None) -> list[LayerKVCache]:
    """Per layer K and V ``[blocks, block_size, kv_heads, head_dim]``: random, or zeros (seed None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (BLOCKS, BLOCK, HEADS, HEAD_DIM)

    def one():
        return torch.randn(shape, generator=gen).to(dtype) if seed is not None else torch.zeros(shape, dtype=dtype)

    return [LayerKVCache(one(), one()) for _ in range(LAYERS)]


def blocks(n: int) -> list[tuple[int, bytes, tuple[int, ...]]]:
    return [(i, hashlib.blake2b(bytes([i]), digest_size=16).digest(), tuple(range(i * BLOCK, (i + 1) * BLOCK)))
            for i in range(n)]


def tiers(folder, device, storage=None, host=True):
    identity = model_identity("tiny", "float32", "auto", BLOCK, "none", 0.5, None,
                              **({} if storage is None else {"storage": storage}))
    extra = {} if storage is None else {"storage": storage}
    return build_tiers(host_bytes=(1 << 24) if host else 0, disk_dir=str(folder), disk_bytes=1 << 28,
                       shared_dir=None, shared_bytes=0, identity=identity, device_caches=device, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_come_back_from_host_and_disk_bit_for_bit_by_default(tmp_path, dtype):
    source = caches(dtype, seed=1)
    written = tiers(tmp_path / "kv", source)
    try:
        written.store(blocks(4))
        assert written.flush()
        # From the host tier, into other device blocks of the same cache.
        moved = [(4 + i, h, t) for i, h, t in blocks(4)]
        assert written.load(moved) == ["host"] * 4
        for layer in source:
            assert torch.equal(layer.k[4:8], layer.k[:4]) and torch.equal(layer.v[4:8], layer.v[:4])
    finally:
        written.close()
    # From disk, into a fresh engine's empty cache.
    target = caches(dtype, seed=None)
    restarted = tiers(tmp_path / "kv", target, host=False)
    try:
        assert restarted.load(blocks(4)) == ["disk"] * 4
    finally:
        restarted.close()
    for got, want in zip(target, source):
        assert torch.equal(got.k[:4], want.k[:4]) and torch.equal(got.v[:4], want.v[:4])


def test_int8_storage_is_asked_for_and_rounds(tmp_path):
    source = caches(torch.float32, seed=2)
    target = caches(torch.float32, seed=None)
    written = tiers(tmp_path / "kv", source, storage="int8", host=False)
    try:
        written.store(blocks(2))
        assert written.flush()
    finally:
        written.close()
    restarted = tiers(tmp_path / "kv", target, storage="int8", host=False)
    try:
        assert restarted.load(blocks(2)) == ["disk"] * 2
    finally:
        restarted.close()
    error = (target[0].k[:2] - source[0].k[:2]).abs()
    # Close (int8 with a scale per token and head) but not exact.
    assert 0 < error.max().item() < 0.05 * source[0].k[:2].abs().max().item()
    # The two storages never read each other's blocks: they are of different identities.
    lossless = tiers(tmp_path / "kv", caches(torch.float32, seed=None), storage="lossless", host=False)
    try:
        assert lossless.load(blocks(2)) == []
    finally:
        lossless.close()


def test_an_unknown_storage_is_refused(tmp_path):
    from mqinfer.workers.config import EngineConfig

    with pytest.raises(ValueError, match="kv_tier_storage must be one of lossless, int8"):
        EngineConfig(kv_tier_storage="fp4")
    with pytest.raises(ValueError, match="kv_tier_storage"):
        tiers(tmp_path / "kv", caches(torch.float32, seed=3), storage="bf16")
