"""KV tiers below the device cache: host memory, a local disk directory, a shared directory.

Owns ``KVTiers``, the workers-side ``LowerTiers`` of the KV cache manager
(scheduler/kv_cache_manager.py), and :func:`model_identity`. The manager decides which blocks move;
this class moves them and keeps them:

* ``store``: prompt blocks whose KV is computed are copied out of the device cache (through a few
  host blocks, the swap machinery of workers/engine/swap.py) and kept in the device cache's own format, bit
  for bit: an int8 / fp8 cache's values and scales, a cache in the model's dtype as its float bytes
  (``storage="lossless"``, the default), or that cache quantized to int8 (``storage="int8"``, an
  explicit choice: a quarter of float32's bytes, and a restored prefix carries int8 rounding). They
  go into the host tier at once, uncompressed, and to a background thread that compresses them
  (workers/engine/kv_codec.py) and writes them to the directory tiers. The thread's queue is bounded:
  when the disk cannot keep up, writes are dropped and counted, and the step never waits.
* ``contains`` / ``load``: a lookup walks the tiers in order (host, disk, shared); a block is used
  only if its blob is whole, unchanged, of this model and of exactly the request's tokens, else it
  is a miss (counted by reason and removed from that tier) and the next tier is tried. A block
  found below the host tier is promoted into it. Loaded blocks are copied into the device blocks
  the manager allocated, before the step's forward pass.

A block's key is the model identity and its chained hash, so workers of the same model and
settings share blocks through a directory, across restarts, and those of another never do. The
identity covers what changes the KV of the same tokens: the weights (the model id's hash), dtype,
the device cache's KV format and how the tiers store it, quantization, block size and the rotary
frequencies; and the prefix
cache scope, so that a tier written under one scope is never read under another. Within a scope,
the chained hash starts from the request's cache partition (its tenant under ``tenant``, its cache
salt), so partitions never share a block here either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from mqinfer.kernels.kv_quant import SCALE_DTYPE, LayerKVCache, as_raw, dequantize_kv, quantize_kv
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, check_scope
from mqinfer.workers.engine import kv_codec
from mqinfer.workers.config import KV_TIER_STORAGES as TIER_STORAGES
from mqinfer.workers.engine.kv_codec import BlockGeometry, BlockRejected
from mqinfer.workers.engine.kv_store import DirectoryStore, HostStore
from mqinfer.workers.engine.swap import HostKVCache

log = logging.getLogger(__name__)

BlockCopy = tuple[int, bytes, tuple[int, ...]]
# Blocks copied through host memory at a time.
STAGING_BLOCKS = 32
# The background writer's nice value: it compresses and writes while the model's threads leave a
# core free, instead of taking cores from them (measured: BENCHMARKS.md).
WRITER_NICE = 10
# Bytes of blocks waiting for the background writer, at most (and never fewer than 16 blocks).
WRITE_QUEUE_BYTES = 256 << 20
DEFAULT_TIER_STORAGE = "lossless"
_FLOAT_FORMATS = {torch.float32: kv_codec.FLOAT32, torch.bfloat16: kv_codec.BFLOAT16, torch.float16: kv_codec.FLOAT16}


def model_identity(model_id: str, dtype: str, kv_cache_dtype: str, block_size: int, quantization: str,
                   smoothquant_alpha: float, rotary_inv_freq: torch.Tensor | None,
                   prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE, storage: str = "int8") -> bytes:
    """16 bytes naming everything that makes two workers' KV for the same tokens interchangeable,
    and the prefix cache scope that wrote it: a block written under one scope is never read under
    another (the block hash already separates the partitions within a scope). ``storage`` matters
    only for a cache in the model's dtype (``auto``): lossless blocks are named apart from int8 ones,
    whose identity is the one tiers had before lossless storage existed."""
    fields = {
        "format": kv_codec.VERSION, "model": model_id, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
        "block_size": block_size, "quantization": quantization,
        "smoothquant_alpha": smoothquant_alpha if quantization == "w8a8" else None,
        "prefix_cache_scope": check_scope(prefix_cache_scope),
    }
    if kv_cache_dtype == "auto" and check_storage(storage) == "lossless":
        fields["tier_storage"] = "lossless"
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16)
    if rotary_inv_freq is not None:
        digest.update(rotary_inv_freq.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def check_storage(storage: str) -> str:
    if storage not in TIER_STORAGES:
        raise ValueError(f"kv_tier_storage must be one of {', '.join(TIER_STORAGES)}, got {storage!r}")
    return storage


class KVTiers:
    """The tiers of one engine (see the module docstring). ``stores``: host first if any, then the
    directory tiers in lookup order; ``storage``: how a cache in the model's dtype is stored."""

    def __init__(self, stores: Sequence[HostStore | DirectoryStore], identity: bytes,
                 device_caches: Sequence[LayerKVCache], write_queue_bytes: int = WRITE_QUEUE_BYTES,
                 storage: str = DEFAULT_TIER_STORAGE) -> None:
        if not stores:
            raise ValueError("KV tiers need at least one store")
        self.stores = list(stores)
        self.host = self.stores[0] if isinstance(self.stores[0], HostStore) else None
        self.lower = [s for s in self.stores if s is not self.host]
        self.identity = identity
        self.device_caches = [LayerKVCache(*c) for c in device_caches]
        first = self.device_caches[0]
        self.device = first.k.device
        self.quantized = first.quantized
        self.cache_dtype = first.k.dtype
        block_size, kv_heads, head_dim = first.k.shape[1:]
        self.geometry = BlockGeometry(len(self.device_caches), block_size, kv_heads, head_dim)
        # Lossless: the cache's float bytes; otherwise 8-bit (as they are, or quantized here).
        self.lossless = not self.quantized and check_storage(storage) == "lossless"
        if self.lossless:
            if self.cache_dtype not in _FLOAT_FORMATS:
                raise ValueError(f"KV tiers cannot store a {self.cache_dtype} cache losslessly")
            self.fmt = _FLOAT_FORMATS[self.cache_dtype]
        else:
            self.fmt = kv_codec.FP8 if self.cache_dtype == torch.float8_e4m3fn else kv_codec.INT8
        self.staging = HostKVCache(STAGING_BLOCKS, len(self.device_caches), (block_size, kv_heads, head_dim),
                                   self.cache_dtype, pin_memory=self.device.type == "cuda", quantized=self.quantized)
        self.dropped_writes = 0
        block_bytes = self.geometry.block_bytes(self.fmt)
        self._queue: queue.Queue = queue.Queue(maxsize=max(16, write_queue_bytes // block_bytes))
        self._writer: threading.Thread | None = None
        if self.lower:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    def key(self, block_hash: bytes) -> bytes:
        return self.identity + block_hash

    # -- the manager's interface ------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        key = self.key(block_hash)
        for store in self.stores:
            if store.contains(key):
                return True
            store.stats.misses += 1
        return False

    def load(self, blocks: Sequence[BlockCopy]) -> list[str]:
        served: list[str] = []
        for start in range(0, len(blocks), STAGING_BLOCKS):
            chunk = blocks[start: start + STAGING_BLOCKS]
            found = []
            for block_id, block_hash, token_ids in chunk:
                got = self._fetch(block_hash, token_ids)
                if got is None:
                    break
                found.append(got[1])
                served.append(got[0])
            if found:
                self._stage(found)
                self.staging.swap_in(self.device_caches, [(row, chunk[row][0]) for row in range(len(found))])
                self._sync()  # the staging blocks are reused for the next chunk
            if len(found) < len(chunk):
                break
        return served

    def store(self, blocks: Sequence[BlockCopy]) -> None:
        todo = [b for b in blocks if not self._held(self.key(b[1]))]
        for start in range(0, len(todo), STAGING_BLOCKS):
            chunk = todo[start: start + STAGING_BLOCKS]
            self.staging.swap_out(self.device_caches, [(block_id, row) for row, (block_id, _, _) in enumerate(chunk)])
            self._sync()
            values, scales = self._unstage(len(chunk))
            for row, (_, block_hash, token_ids) in enumerate(chunk):
                key = self.key(block_hash)
                if self.host is not None:
                    t0 = time.perf_counter()
                    blob = kv_codec.encode(self.identity, block_hash, token_ids, values[row], _row(scales, row),
                                           self.fmt, self.geometry, compress=False)
                    self.host.put(key, blob)
                    self.host.stats.write_seconds += time.perf_counter() - t0
                if self._writer is not None:
                    try:
                        self._queue.put_nowait((key, block_hash, token_ids, values[row], _row(scales, row)))
                    except queue.Full:
                        self.dropped_writes += 1

    # -- moving blocks ----------------------------------------------------------------------------
    def _held(self, key: bytes) -> bool:
        """Whether the block is stored already: in the host tier, or (without one) the first below."""
        first = self.host if self.host is not None else self.lower[0]
        return first.contains(key)

    def _fetch(self, block_hash: bytes, token_ids: Sequence[int]) -> tuple[str, kv_codec.DecodedBlock] | None:
        """The first tier's whole, matching copy of the block (promoted to the host tier)."""
        key = self.key(block_hash)
        for store in self.stores:
            t0 = time.perf_counter()
            blob = store.get(key)
            if blob is None:  # gone since the lookup (another worker evicted it)
                continue
            try:
                decoded = kv_codec.decode(blob, self.identity, block_hash, token_ids, self.geometry, fmt=self.fmt)
            except BlockRejected as exc:
                store.stats.reject(exc.reason)
                store.discard(key)
                log.warning("KV tier %s: block %s rejected (%s), recomputed instead", store.kind,
                            block_hash.hex()[:12], exc)
                continue
            stats = store.stats
            stats.hits += 1
            stats.read_bytes += len(blob)
            stats.read_seconds += time.perf_counter() - t0
            stats.prefix_tokens += len(token_ids)
            if self.host is not None and store is not self.host:
                self.host.put(key, kv_codec.encode(self.identity, block_hash, token_ids, decoded.values,
                                                   decoded.scales, decoded.fmt, self.geometry, compress=False))
            return store.kind, decoded
        return None

    def _stage(self, decoded: Sequence[kv_codec.DecodedBlock]) -> None:
        """Write decoded blocks into the first staging blocks, in the device cache's format."""
        n = len(decoded)
        values = torch.from_numpy(np.stack([d.values for d in decoded]))  # [n, 2 * layers, ...] uint8
        if self.lossless:
            for layer, cache in enumerate(self.staging.caches):
                for j, dst in enumerate((cache.k, cache.v)):
                    dst[:n].view(torch.uint8).copy_(values[:, 2 * layer + j])
            return
        scales = torch.from_numpy(np.stack([d.scales for d in decoded])).view(SCALE_DTYPE)
        for layer, cache in enumerate(self.staging.caches):
            for j, (dst, dst_scale) in enumerate(((cache.k, cache.k_scale), (cache.v, cache.v_scale))):
                v, s = values[:, 2 * layer + j], scales[:, 2 * layer + j]
                if self.quantized:
                    as_raw(dst)[:n].view(torch.uint8).copy_(v)
                    dst_scale[:n].copy_(s)
                else:
                    dst[:n].copy_(dequantize_kv(v.view(torch.int8), s, dst.dtype))

    def _unstage(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``n`` staging blocks in the stored form: the float bytes ``[n, 2 * layers, ...]``
        (lossless, scales None), or 8-bit values and bfloat16 scale bits (quantized here for a cache in
        the model's dtype)."""
        if self.lossless:
            raw = [t[:n].contiguous().view(torch.uint8) for cache in self.staging.caches for t in (cache.k, cache.v)]
            return torch.stack(raw, dim=1).numpy(), None
        values, scales = [], []
        for cache in self.staging.caches:
            for t, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
                if self.quantized:
                    values.append(as_raw(t)[:n].view(torch.uint8))
                    scales.append(s[:n])
                else:
                    q, scale = quantize_kv(t[:n], torch.int8)
                    values.append(q.view(torch.uint8))
                    scales.append(scale)
        return (torch.stack(values, dim=1).numpy(), torch.stack(scales, dim=1).view(torch.int16).numpy())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- the background writer --------------------------------------------------------------------
    def _write_loop(self) -> None:
        compressor = kv_codec.Compressor()
        try:  # Linux: a lower priority for this thread, so that the model's threads go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, block_hash, token_ids, values, scales = item
                t0 = time.perf_counter()
                blob = kv_codec.encode(self.identity, block_hash, token_ids, values, scales, self.fmt,
                                       self.geometry, compressor=compressor)
                encode_s = time.perf_counter() - t0
                for store in self.lower:
                    t1 = time.perf_counter()
                    store.put(key, blob)
                    store.stats.write_seconds += time.perf_counter() - t1 + encode_s
            except Exception:  # a cache write must never stop the worker
                log.exception("KV tier write failed")
            finally:
                self._queue.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped); False if that took too long."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (for at most ``timeout_s``), stop the writer, close the stores."""
        if self._writer is not None:
            if not self.flush(timeout_s):
                log.warning("KV tiers: %d blocks not written at close", self._queue.unfinished_tasks)
            self._queue.put(None)
            self._writer.join(timeout=5.0)
            self._writer = None
        for store in self.stores:
            store.close()

    # -- observing --------------------------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """Each tier's counters as plain data (for the metrics and the benchmark)."""
        out = []
        for store in self.stores:
            s = store.stats
            out.append({
                "tier": store.kind, "hits": s.hits, "misses": s.misses, "rejected": dict(s.rejected),
                "read_bytes": s.read_bytes, "written_bytes": s.written_bytes, "read_seconds": s.read_seconds,
                "write_seconds": s.write_seconds, "evicted": s.evicted, "write_errors": s.write_errors,
                "stored_bytes": s.stored_bytes, "stored_blocks": s.stored_blocks, "prefix_tokens": s.prefix_tokens,
                "max_bytes": store.max_bytes,
            })
        if out:
            out[0]["dropped_writes"] = self.dropped_writes
        return out


def _row(scales: np.ndarray | None, row: int) -> np.ndarray | None:
    return None if scales is None else scales[row]


def attach_engine_tiers(config, info, model, runner, scheduler) -> KVTiers | None:
    """The tiers an ``EngineConfig`` asks for, attached to the engine's KV cache manager (None when
    it asks for none). ``info``: the ``ModelInfo``; ``model`` its module (for the rotary frequencies)."""
    if not config.kv_tiers_on:
        return None
    if getattr(config, "pipeline_parallel_size", 1) > 1:
        raise ValueError("KV tiers do not combine with pipeline parallelism (each stage holds some layers)")
    rotary = getattr(model, "rotary", None)
    identity = model_identity(info.model_id, info.dtype, config.kv_cache_dtype, config.block_size,
                              config.quantization, config.smoothquant_alpha, getattr(rotary, "inv_freq", None),
                              config.prefix_cache_scope, config.kv_tier_storage)
    tiers = build_tiers(host_bytes=int(config.kv_host_cache_gib * 2**30), disk_dir=config.kv_disk_cache,
                        disk_bytes=int(config.kv_disk_cache_gib * 2**30), shared_dir=config.kv_shared_cache,
                        shared_bytes=int(config.kv_shared_cache_gib * 2**30), identity=identity,
                        device_caches=runner.kv_caches, storage=config.kv_tier_storage)
    scheduler.kv_cache_manager.attach_tiers(tiers)
    form = "lossless" if tiers.lossless else "8-bit"
    log.info("KV tiers: %s (%s, %s)", ", ".join(
        f"{s.kind} {s.max_bytes / 2**30:g} GiB" + (f" at {s.path}" if hasattr(s, "path") else "")
        for s in tiers.stores), form, "zstd" if kv_codec.zstd_available() else "zlib: install zstandard for speed")
    return tiers


def build_tiers(*, host_bytes: int, disk_dir: str | None, disk_bytes: int, shared_dir: str | None,
                shared_bytes: int, identity: bytes, device_caches: Sequence[LayerKVCache],
                storage: str = DEFAULT_TIER_STORAGE) -> KVTiers | None:
    """The tiers a configuration asks for, or None when it asks for none."""
    stores: list[HostStore | DirectoryStore] = []
    if host_bytes > 0:
        stores.append(HostStore(host_bytes))
    if disk_dir:
        stores.append(DirectoryStore(disk_dir, disk_bytes, kind="disk"))
    if shared_dir:
        stores.append(DirectoryStore(shared_dir, shared_bytes, kind="shared"))
    if not stores:
        return None
    return KVTiers(stores, identity, device_caches, storage=storage)


__all__ = ["DEFAULT_TIER_STORAGE", "KVTiers", "TIER_STORAGES", "attach_engine_tiers", "build_tiers", "check_storage",
           "model_identity"]
