"""The stored form of one KV block in the tiers below the device cache: the device cache's own
bytes (a float cache's values, or 8-bit values and their scales), compressed, framed with the
model's identity, the block's hash and tokens, and a checksum.

A blob is::

    header  magic "MQKV", format version, codec, value format, identity (16 bytes), block hash
            (16 bytes), number of tokens, raw length, payload length
    tokens  the block's token ids (uint32 each)
    payload the compressed block
    check   BLAKE2b-128 of everything before it

The identity is a digest of what makes two workers' KV for the same tokens interchangeable (the
model's weights, dtype, KV cache format, block size, rotary settings) and of the prefix cache
scope that wrote the blob (``workers/engine/kv_tiers.py`` builds it), so a blob of one scope is
``foreign`` to a worker of the other. :func:`decode` returns the block only when the blob is whole (lengths), unchanged
(checksum), of this identity and of exactly the tokens asked for; anything else raises
:class:`BlockRejected` with the reason (``torn``, ``corrupt``, ``foreign``, ``tokens``), which the
tiers count as a miss. Nothing in a blob is ever executed or unpickled.

A block in 8-bit form (``INT8``, ``FP8``) is every layer's K then V 8-bit values (``[block_size, kv_heads, head_dim]`` each,
int8 or float8 e4m3 bytes) followed by every layer's K then V bfloat16 scales
(``[block_size, kv_heads]``), the format of ``--kv-cache-dtype int8|fp8`` (kernels/kv_quant.py).
Compression (measured on SmolLM2-135M's KV, BENCHMARKS.md): zstd on the values, and on the
scales split into their high and low bytes (the high bytes, sign and exponent, barely vary). Where
the value columns (one channel of one head over the block's tokens) differ in magnitude, as in
trained models, columns are grouped by magnitude and each group compressed apart, so that each
gets an entropy code of its own, when that comes out smaller than one frame: 0.444 of bfloat16's
bytes on SmolLM2-135M against 0.455 for one frame. lz4 left int8 KV uncompressed (0.999 of its bytes), so zstd it is; without the zstandard
package, zlib (the standard library) stands in at about the same ratio and a tenth of the speed.

A block in a floating-point form (``FLOAT32``, ``BFLOAT16``, ``FLOAT16``: a cache in the model's
dtype, stored without loss) is every layer's K then V values, ``[block_size, kv_heads, head_dim]``
each, as the cache's bytes, without scales. Compressed, its bytes are split into planes by their
place in the value (all the first bytes, then all the second, ...): the high bytes (sign and
exponent) vary little and compress well, the low mantissa bytes barely at all.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:  # an optional dependency of the worker extra: zlib stands in without it
    import zstandard as _zstd
except ImportError:  # pragma: no cover - exercised where the package is missing
    _zstd = None

MAGIC = b"MQKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBB16s16sHII")
_CHECK_BYTES = 16
# Codec byte: the compressor in the high nibble, the values' layout in the low one.
RAW, ZSTD, ZLIB = 0, 1, 2
PLAIN, COLUMNS, PLANES = 0, 1, 2
# The formats a blob's values may be in: 8-bit with scales, or a cache's own floating-point bytes.
INT8, FP8, FLOAT32, BFLOAT16, FLOAT16 = 1, 2, 3, 4, 5
FORMATS = {"int8": INT8, "fp8": FP8}
# The floating-point formats and the bytes of one value in each.
FLOAT_FORMATS = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2}
# Value columns fall into these magnitude groups by bit length: <= 3 bits, 4, 5, 6, 7 and more.
_GROUPS = 5
# Grouping pays only where magnitudes differ: with one group this large, one frame is used.
_ONE_GROUP_SHARE = 0.85
# Level 1: within 0.1% of levels 3 and 9 on int8 KV (BENCHMARKS.md), and the fastest.
_ZSTD_LEVEL = 1
_ZLIB_LEVEL = 6


class BlockRejected(Exception):
    """A blob that must not be used: ``reason`` is torn, corrupt, foreign or tokens."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """The shape of one block's KV: ``layers`` layers of K and V, each ``[block_size, kv_heads,
    head_dim]`` values (in 8-bit form with ``[block_size, kv_heads]`` bfloat16 scales)."""

    layers: int
    block_size: int
    kv_heads: int
    head_dim: int

    @property
    def values_shape(self) -> tuple[int, int, int, int]:
        return (2 * self.layers, self.block_size, self.kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (2 * self.layers, self.block_size, self.kv_heads)

    @property
    def raw_bytes(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * (self.head_dim + 2)

    def float_shape(self, fmt: int) -> tuple[int, int, int, int]:
        """The bytes of a block in floating-point format ``fmt``, as uint8 ``[2 * layers, block_size,
        kv_heads, head_dim * bytes per value]``."""
        return (2 * self.layers, self.block_size, self.kv_heads, self.head_dim * FLOAT_FORMATS[fmt])

    def block_bytes(self, fmt: int) -> int:
        """Bytes of one uncompressed block in format ``fmt``."""
        if fmt in FLOAT_FORMATS:
            return int(np.prod(self.float_shape(fmt)))
        return self.raw_bytes

    @property
    def bfloat16_bytes(self) -> int:
        """The same block's bytes as bfloat16 KV without scales (the yardstick of the ratios)."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * 2


def zstd_available() -> bool:
    return _zstd is not None


class Compressor:
    """What compresses blocks for one writer (not shared between threads): zstd, or zlib without
    the zstandard package, and whether grouping value columns still pays. Grouping is tried beside
    one frame for the first ``TRIALS`` blocks that look groupable; if it came out smaller in fewer
    than a quarter of them (the KV of random weights), one frame is used from then on."""

    TRIALS = 64

    def __init__(self) -> None:
        self.kind = ZSTD if _zstd is not None else ZLIB
        if self.kind == ZSTD:
            self._compress = _zstd.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=False,
                                                  write_content_size=True).compress
        else:
            self._compress = lambda data: zlib.compress(data, _ZLIB_LEVEL)
        self.trials = 0
        self.grouped_wins = 0

    def __call__(self, data: bytes) -> bytes:
        return self._compress(data)

    @property
    def try_groups(self) -> bool:
        return self.trials < self.TRIALS or 4 * self.grouped_wins >= self.trials


def _decompressor(compressor: int):
    if compressor == ZSTD:
        if _zstd is None:
            raise BlockRejected("foreign", "the block is zstd-compressed and the zstandard package is missing")
        return _zstd.ZstdDecompressor().decompress
    if compressor == ZLIB:
        return zlib.decompress
    raise BlockRejected("corrupt", f"unknown compressor {compressor}")


def encode(identity: bytes, block_hash: bytes, token_ids: Sequence[int], values: np.ndarray,
           scales: np.ndarray | None, fmt: int, geometry: BlockGeometry, compress: bool = True,
           compressor: Compressor | None = None) -> bytes:
    """The blob of one block; compressed (by ``compressor``, a new one if None) unless ``compress``
    is False. In 8-bit form: ``values`` uint8/int8 ``geometry.values_shape``, ``scales`` int16
    (bfloat16 bits) ``geometry.scales_shape``. In a floating-point form: ``values`` the cache's bytes,
    uint8 ``geometry.float_shape(fmt)``, and ``scales`` None."""
    if len(identity) != 16 or len(block_hash) != 16:
        raise ValueError("identity and block hash must be 16 bytes each")
    if fmt in FLOAT_FORMATS:
        return _encode_float(identity, block_hash, token_ids, values, fmt, geometry, compress, compressor)
    if fmt not in (INT8, FP8):
        raise ValueError(f"unknown KV block format {fmt}")
    if scales is None or values.shape != geometry.values_shape or scales.shape != geometry.scales_shape:
        shown = None if scales is None else scales.shape
        raise ValueError(f"block of {values.shape} values / {shown} scales does not match {geometry}")
    values = np.ascontiguousarray(values).view(np.uint8)
    scales = np.ascontiguousarray(scales).view(np.uint16)
    if not compress:
        codec, payload = RAW << 4 | PLAIN, values.tobytes() + scales.tobytes()
    else:
        compressor = compressor or Compressor()
        layout, body = _pack_values(values, compressor)
        split = np.concatenate([(scales >> 8).astype(np.uint8).ravel(), (scales & 0xFF).astype(np.uint8).ravel()])
        packed_scales = compressor(split.tobytes())
        codec = compressor.kind << 4 | layout
        payload = struct.pack("<I", len(body)) + body + packed_scales
    return _frame(identity, block_hash, token_ids, codec, fmt, geometry.raw_bytes, payload)


def _encode_float(identity: bytes, block_hash: bytes, token_ids: Sequence[int], values: np.ndarray, fmt: int,
                  geometry: BlockGeometry, compress: bool, compressor: Compressor | None) -> bytes:
    """A block in a floating-point form: its bytes as they are, or their byte planes compressed."""
    shape = geometry.float_shape(fmt)
    if values.shape != shape or values.dtype != np.uint8:
        raise ValueError(f"block of {values.dtype} {values.shape} does not match {geometry} as uint8 {shape}")
    data = np.ascontiguousarray(values)
    if not compress:
        codec, payload = RAW << 4 | PLAIN, data.tobytes()
    else:
        compressor = compressor or Compressor()
        planes = data.reshape(-1, FLOAT_FORMATS[fmt]).T
        codec, payload = compressor.kind << 4 | PLANES, compressor(np.ascontiguousarray(planes).tobytes())
    return _frame(identity, block_hash, token_ids, codec, fmt, data.size, payload)


def _frame(identity: bytes, block_hash: bytes, token_ids: Sequence[int], codec: int, fmt: int, raw_len: int,
           payload: bytes) -> bytes:
    """Header, tokens, payload and the checksum of them all."""
    tokens = array("I", token_ids).tobytes()
    header = _HEADER.pack(MAGIC, VERSION, codec, fmt, 0, identity, block_hash, len(token_ids), raw_len, len(payload))
    body = header + tokens + payload
    return body + hashlib.blake2b(body, digest_size=_CHECK_BYTES).digest()


def _pack_values(values: np.ndarray, compress: Compressor) -> tuple[int, bytes]:
    """(layout, bytes): one frame of the values as they are, or magnitude groups of columns."""
    plain = compress(values.tobytes())
    if not compress.try_groups:
        return PLAIN, plain
    columns = np.ascontiguousarray(np.moveaxis(values.view(np.int8), 1, -1)).reshape(-1, values.shape[1])
    magnitude = np.abs(columns.astype(np.int16)).max(axis=1)
    group = np.clip(np.ceil(np.log2(magnitude + 1.0)).astype(np.int64) - 3, 0, _GROUPS - 1).astype(np.uint8)
    counts = np.bincount(group, minlength=_GROUPS)
    if counts.max() >= _ONE_GROUP_SHARE * len(group):
        return PLAIN, plain
    parts = [compress(group.tobytes())]
    for g in range(_GROUPS):
        parts.append(compress(columns[group == g].tobytes()) if counts[g] else b"")
    grouped = b"".join(struct.pack("<I", len(p)) + p for p in parts)
    # Grouping loses where the token order held more than the magnitudes (seen on random weights).
    compress.trials += 1
    if len(grouped) < len(plain):
        compress.grouped_wins += 1
        return COLUMNS, grouped
    return PLAIN, plain


def _unpack_values(layout: int, body: bytes, decompress, geometry: BlockGeometry) -> np.ndarray:
    shape = geometry.values_shape
    if layout == PLAIN:
        return np.frombuffer(decompress(body), dtype=np.uint8).reshape(shape)
    if layout != COLUMNS:
        raise BlockRejected("corrupt", f"unknown value layout {layout}")
    parts, offset = [], 0
    for _ in range(_GROUPS + 1):
        (n,) = struct.unpack_from("<I", body, offset)
        parts.append(body[offset + 4: offset + 4 + n])
        offset += 4 + n
    group = np.frombuffer(decompress(parts[0]), dtype=np.uint8)
    columns = np.empty((len(group), shape[1]), dtype=np.uint8)
    for g in range(_GROUPS):
        if parts[g + 1]:
            columns[group == g] = np.frombuffer(decompress(parts[g + 1]), dtype=np.uint8).reshape(-1, shape[1])
    moved = columns.reshape(shape[0], shape[2], shape[3], shape[1])
    return np.ascontiguousarray(np.moveaxis(moved, -1, 1))


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    fmt: int
    # 8-bit form: uint8 [2 * layers, block_size, kv_heads, head_dim]; a floating-point form: its
    # bytes, uint8 [2 * layers, block_size, kv_heads, head_dim * bytes per value].
    values: np.ndarray
    scales: np.ndarray | None  # int16 (bfloat16 bits) [2 * layers, block_size, kv_heads]; None for a float form


def peek_key(blob: bytes) -> tuple[bytes, bytes] | None:
    """(identity, block hash) a blob claims, without checking it; None if it has no header."""
    if len(blob) < _HEADER.size or blob[:4] != MAGIC:
        return None
    fields = _HEADER.unpack_from(blob)
    return fields[5], fields[6]


def decode(blob: bytes, identity: bytes, block_hash: bytes, token_ids: Sequence[int],
           geometry: BlockGeometry, fmt: int | None = None) -> DecodedBlock:
    """The block in ``blob`` if it is whole, unchanged, this identity's, of exactly these tokens (and
    in format ``fmt`` when given); else :class:`BlockRejected`."""
    expected_fmt = fmt
    if len(blob) < _HEADER.size + _CHECK_BYTES or blob[:4] != MAGIC:
        raise BlockRejected("torn", f"{len(blob)} bytes with no block header")
    magic, version, codec, fmt, _, ident, hashed, ntok, raw_len, payload_len = _HEADER.unpack_from(blob)
    expected = _HEADER.size + 4 * ntok + payload_len + _CHECK_BYTES
    if len(blob) != expected:
        raise BlockRejected("torn", f"{len(blob)} bytes where the header promises {expected}")
    body, check = blob[:-_CHECK_BYTES], blob[-_CHECK_BYTES:]
    if hashlib.blake2b(body, digest_size=_CHECK_BYTES).digest() != check:
        raise BlockRejected("corrupt", "checksum mismatch")
    known = fmt in (INT8, FP8) or fmt in FLOAT_FORMATS
    if (version != VERSION or ident != identity or not known or raw_len != geometry.block_bytes(fmt)
            or expected_fmt not in (None, fmt)):
        raise BlockRejected("foreign", "another model, KV format or block geometry")
    if hashed != block_hash:
        raise BlockRejected("foreign", "stored under another block's hash")
    tokens = array("I")
    tokens.frombytes(blob[_HEADER.size: _HEADER.size + 4 * ntok])
    if list(tokens) != list(token_ids):
        raise BlockRejected("tokens", "the block holds other tokens (a hash collision)")
    payload = blob[_HEADER.size + 4 * ntok: len(body)]
    compressor, layout = codec >> 4, codec & 0xF
    if fmt in FLOAT_FORMATS:
        return DecodedBlock(fmt, _unpack_float(compressor, layout, payload, fmt, geometry), None)
    n_values = geometry.raw_bytes - 2 * int(np.prod(geometry.scales_shape))
    try:
        if compressor == RAW:
            values = np.frombuffer(payload, dtype=np.uint8, count=n_values).reshape(geometry.values_shape)
            scales = np.frombuffer(payload, dtype=np.int16, offset=n_values).reshape(geometry.scales_shape)
            return DecodedBlock(fmt, values, scales)
        decompress = _decompressor(compressor)
        (n_body,) = struct.unpack_from("<I", payload)
        values = _unpack_values(layout, payload[4: 4 + n_body], decompress, geometry)
        split = np.frombuffer(decompress(payload[4 + n_body:]), dtype=np.uint8)
        half = split.size // 2
        scales = ((split[:half].astype(np.uint16) << 8) | split[half:]).view(np.int16).reshape(geometry.scales_shape)
    except BlockRejected:
        raise
    except Exception as exc:  # a checksummed blob that still does not unpack was written wrong
        raise BlockRejected("corrupt", f"does not unpack: {exc}") from None
    return DecodedBlock(fmt, values, scales)


def _unpack_float(compressor: int, layout: int, payload: bytes, fmt: int, geometry: BlockGeometry) -> np.ndarray:
    """The bytes of a block in a floating-point form, ``geometry.float_shape(fmt)``."""
    shape = geometry.float_shape(fmt)
    try:
        if compressor == RAW:
            return np.frombuffer(payload, dtype=np.uint8).reshape(shape)
        decompress = _decompressor(compressor)
        if layout != PLANES:
            raise BlockRejected("corrupt", f"unknown value layout {layout}")
        planes = np.frombuffer(decompress(payload), dtype=np.uint8).reshape(FLOAT_FORMATS[fmt], -1)
        return np.ascontiguousarray(planes.T).reshape(shape)
    except BlockRejected:
        raise
    except Exception as exc:  # a checksummed blob that still does not unpack was written wrong
        raise BlockRejected("corrupt", f"does not unpack: {exc}") from None


__all__ = ["BFLOAT16", "BlockGeometry", "BlockRejected", "Compressor", "DecodedBlock", "FLOAT16", "FLOAT32",
           "FLOAT_FORMATS", "FORMATS", "FP8", "INT8", "decode", "encode", "peek_key", "zstd_available"]
