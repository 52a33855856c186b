"""The KV tiers' blob format: a block comes back bit for bit, and a blob that is torn, corrupt, of
another model or of other tokens is refused with its reason."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mqinfer.workers.engine import kv_codec
from mqinfer.workers.engine.kv_codec import BlockGeometry, BlockRejected, decode, encode

GEOMETRY = BlockGeometry(layers=3, block_size=16, kv_heads=2, head_dim=64)
IDENTITY = hashlib.blake2b(b"model-a", digest_size=16).digest()
BLOCK_HASH = hashlib.blake2b(b"block", digest_size=16).digest()
TOKENS = list(range(100, 116))


def block(seed: int = 0, spread: bool = False):
    """8-bit values and bfloat16 scale bits; ``spread``: columns of very different magnitudes, as in a
    trained model's KV (outlier channels), which the column layout compresses apart."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 40, GEOMETRY.values_shape)
    if spread:
        values *= rng.choice([0.05, 0.2, 1.0], size=(*GEOMETRY.values_shape[:1], 1, *GEOMETRY.values_shape[2:]))
    values = np.clip(np.round(values), -127, 127).astype(np.int8)
    scales = (0x3C00 + rng.integers(0, 200, GEOMETRY.scales_shape)).astype(np.int16)
    return values, scales


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("compress", [False, True])
def test_a_block_comes_back_bit_for_bit(spread, compress):
    values, scales = block(1, spread)
    blob = encode(IDENTITY, BLOCK_HASH, TOKENS, values, scales, kv_codec.INT8, GEOMETRY, compress=compress)
    out = decode(blob, IDENTITY, BLOCK_HASH, TOKENS, GEOMETRY)
    assert out.fmt == kv_codec.INT8
    assert np.array_equal(out.values.view(np.int8), values)
    assert np.array_equal(out.scales, scales)
    if compress and spread:
        # Magnitude groups compress apart: well under the raw 8-bit bytes.
        assert len(blob) < 0.8 * GEOMETRY.raw_bytes
    if not compress:
        assert len(blob) > GEOMETRY.raw_bytes


def test_column_layout_is_chosen_only_where_magnitudes_differ():
    flat = encode(IDENTITY, BLOCK_HASH, TOKENS, *block(2), kv_codec.INT8, GEOMETRY)
    spread = encode(IDENTITY, BLOCK_HASH, TOKENS, *block(2, spread=True), kv_codec.INT8, GEOMETRY)
    codec_byte = 5  # after the 4-byte magic and the version byte
    assert flat[codec_byte] & 0xF == kv_codec.PLAIN
    assert spread[codec_byte] & 0xF == kv_codec.COLUMNS


def test_every_kind_of_bad_blob_is_refused_with_its_reason():
    values, scales = block(3)
    blob = encode(IDENTITY, BLOCK_HASH, TOKENS, values, scales, kv_codec.INT8, GEOMETRY)

    def reason(data, identity=IDENTITY, block_hash=BLOCK_HASH, tokens=TOKENS, geometry=GEOMETRY):
        with pytest.raises(BlockRejected) as info:
            decode(data, identity, block_hash, tokens, geometry)
        return info.value.reason

    assert reason(blob[: len(blob) // 2]) == "torn"
    assert reason(b"") == "torn"
    assert reason(blob + b"x") == "torn"
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x01
    assert reason(bytes(flipped)) == "corrupt"
    other = hashlib.blake2b(b"model-b", digest_size=16).digest()
    assert reason(blob, identity=other) == "foreign"
    assert reason(blob, block_hash=hashlib.blake2b(b"other", digest_size=16).digest()) == "foreign"
    assert reason(blob, geometry=BlockGeometry(3, 16, 2, 32)) == "foreign"
    assert reason(blob, tokens=[*TOKENS[:-1], 7]) == "tokens"
    # A blob written for another model under this key (a file copied or renamed) is foreign.
    foreign = encode(other, BLOCK_HASH, TOKENS, values, scales, kv_codec.INT8, GEOMETRY)
    assert reason(foreign) == "foreign"


def test_fp8_values_are_kept_as_their_bytes():
    rng = np.random.default_rng(4)
    values = rng.integers(0, 256, GEOMETRY.values_shape, dtype=np.uint8)
    scales = rng.integers(0, 0x7F00, GEOMETRY.scales_shape).astype(np.int16)
    blob = encode(IDENTITY, BLOCK_HASH, TOKENS, values, scales, kv_codec.FP8, GEOMETRY)
    out = decode(blob, IDENTITY, BLOCK_HASH, TOKENS, GEOMETRY)
    assert out.fmt == kv_codec.FP8
    assert np.array_equal(out.values, values) and np.array_equal(out.scales, scales)


def test_a_block_of_the_wrong_shape_is_an_error():
    values, scales = block(5)
    with pytest.raises(ValueError, match="does not match"):
        encode(IDENTITY, BLOCK_HASH, TOKENS, values[:2], scales, kv_codec.INT8, GEOMETRY)


@pytest.mark.parametrize("fmt, dtype", [(kv_codec.FLOAT32, np.float32), (kv_codec.FLOAT16, np.float16)])
@pytest.mark.parametrize("compress", [False, True])
def test_a_float_block_comes_back_bit_for_bit(fmt, dtype, compress):
    rng = np.random.default_rng(6)
    floats = rng.normal(0, 2, GEOMETRY.values_shape).astype(dtype)
    raw = floats.view(np.uint8).reshape(GEOMETRY.float_shape(fmt))
    blob = encode(IDENTITY, BLOCK_HASH, TOKENS, raw, None, fmt, GEOMETRY, compress=compress)
    out = decode(blob, IDENTITY, BLOCK_HASH, TOKENS, GEOMETRY, fmt=fmt)
    assert out.fmt == fmt and out.scales is None
    assert np.array_equal(out.values.view(dtype).reshape(floats.shape), floats)
    if compress:  # the byte planes: the sign and exponent bytes compress
        assert len(blob) < 0.95 * raw.size
    # A reader expecting 8-bit blocks (another storage setting) refuses it.
    with pytest.raises(BlockRejected) as info:
        decode(blob, IDENTITY, BLOCK_HASH, TOKENS, GEOMETRY, fmt=kv_codec.INT8)
    assert info.value.reason == "foreign"
