"""Swap space for swap preemption: the host-memory KV blocks and the copies to and from them.

Owns ``HostKVCache``: for every layer a K and a V tensor of ``[num_blocks, block_size,
num_kv_heads, head_dim]`` in host memory (and for an 8-bit cache their bfloat16 scales,
``[num_blocks, block_size, num_kv_heads]``), a pool separate from the device cache, and the two
copies the scheduler asks for (``SchedulerOutput.swap_out`` / ``swap_in``). Which block goes
where is the KV cache manager's decision; this module only moves the bytes: a block is row
``block`` of every tensor of a layer's cache (``LayerKVCache.tensors()``), copied as it is.

On CUDA the host memory is pinned, so the copies are asynchronous DMA on the current stream:
each step's copies are queued before its forward pass and stream order keeps them ahead of
every kernel that reads or rewrites those blocks, without a host sync. On the CPU both caches
live in the same memory; the pool is still separate, so that swap preemption runs the same
code paths there as on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mqinfer.kernels.kv_quant import SCALE_DTYPE, LayerKVCache, as_raw

# One cache per layer: a LayerKVCache, or a plain (k_cache, v_cache) pair.
KVCaches = Sequence[LayerKVCache | tuple[torch.Tensor, torch.Tensor]]


def num_swap_blocks_for(swap_space_bytes: int, block_bytes: int) -> int:
    """How many KV blocks of ``block_bytes`` (all layers, K and V) fit in the swap space."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return max(0, int(swap_space_bytes) // block_bytes)


class HostKVCache:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_shape: tuple[int, int, int],
        dtype: torch.dtype,
        pin_memory: bool = False,
        quantized: bool = False,
    ) -> None:
        """``block_shape`` is (block_size, num_kv_heads, head_dim), as in the device cache;
        ``quantized``: the device cache is 8-bit and its scales are swapped with it."""
        if num_blocks < 1 or num_layers < 1:
            raise ValueError(f"a host KV cache needs at least one block and layer, got {num_blocks}, {num_layers}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.quantized = quantized
        # One allocation for the values and one for the scales (pinning is paid per
        # allocation), viewed per layer. Never zeroed: a host block is only ever read after a
        # swap-out wrote it.
        self._storage = torch.empty(
            (num_layers, 2, num_blocks, *self.block_shape), dtype=dtype, pin_memory=pin_memory
        )
        self._scales = torch.empty(
            (num_layers, 2, num_blocks, *self.block_shape[:2]), dtype=SCALE_DTYPE, pin_memory=pin_memory
        ) if quantized else None
        self.caches = [
            LayerKVCache(self._storage[i, 0], self._storage[i, 1])
            if self._scales is None else
            LayerKVCache(self._storage[i, 0], self._storage[i, 1], self._scales[i, 0], self._scales[i, 1])
            for i in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        scales = 0 if self._scales is None else self._scales.numel() * self._scales.element_size()
        return self._storage.numel() * self._storage.element_size() + scales

    @property
    def is_pinned(self) -> bool:
        return self._storage.is_pinned()

    def swap_out(self, device_caches: KVCaches, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``pairs`` of (device block, host block)."""
        if not pairs:
            return
        self._check(device_caches, pairs, host_side=1)
        pairs = sorted(pairs, key=lambda p: p[1])
        device = device_caches[0][0].device
        device_ids = torch.tensor([d for d, _ in pairs], dtype=torch.int64).to(device, non_blocking=True)
        host_ids = [h for _, h in pairs]
        if device.type == "cpu":
            index = torch.tensor(host_ids, dtype=torch.int64)
            for src, dst in self._tensor_pairs(device_caches):
                dst.index_copy_(0, index, src.index_select(0, device_ids))
            return
        runs = _runs(host_ids)
        for src, dst in self._tensor_pairs(device_caches):
            _gather_to_host(src, dst, device_ids, runs)

    def swap_in(self, device_caches: KVCaches, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: ``pairs`` of (host block, device block)."""
        if not pairs:
            return
        self._check(device_caches, pairs, host_side=0)
        pairs = sorted(pairs)
        device = device_caches[0][0].device
        device_ids = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(device, non_blocking=True)
        host_ids = [h for h, _ in pairs]
        if device.type == "cpu":
            index = torch.tensor(host_ids, dtype=torch.int64)
            for dst, src in self._tensor_pairs(device_caches):
                dst.index_copy_(0, device_ids, src.index_select(0, index))
            return
        runs = _runs(host_ids)
        for dst, src in self._tensor_pairs(device_caches):
            _scatter_from_host(src, dst, device_ids, runs)

    def _tensor_pairs(self, device_caches: KVCaches) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor, host tensor) for every tensor of every layer, float8 ones as their
        bytes (PyTorch's CPU index copies do not take float8)."""
        return [
            (as_raw(d), as_raw(h))
            for device_cache, host_cache in zip(device_caches, self.caches)
            for d, h in zip(LayerKVCache(*device_cache).tensors(), host_cache.tensors())
        ]

    def _check(self, device_caches: KVCaches, pairs: Sequence[tuple[int, int]], host_side: int) -> None:
        if len(device_caches) != self.num_layers:
            raise ValueError(f"got {len(device_caches)} device layers for a host cache of {self.num_layers}")
        k = device_caches[0][0]
        if tuple(k.shape[1:]) != self.block_shape or k.dtype != self.dtype:
            raise ValueError(
                f"device blocks {tuple(k.shape[1:])} {k.dtype} do not match host blocks {self.block_shape} {self.dtype}"
            )
        if LayerKVCache(*device_caches[0]).quantized != self.quantized:
            raise ValueError(
                "the device cache " + ("has" if not self.quantized else "has no")
                + " scales but the host cache " + ("has none" if not self.quantized else "has")
            )
        num_device = k.shape[0]
        for pair in pairs:
            host, dev = pair[host_side], pair[1 - host_side]
            if not (0 <= host < self.num_blocks and 0 <= dev < num_device):
                raise ValueError(
                    f"block pair {pair} out of range ({num_device} device blocks, {self.num_blocks} host blocks)"
                )


# The device paths: one gather or scatter kernel per tensor on the device, and one DMA per run of
# consecutive host blocks (the host pool hands out mostly consecutive blocks), all queued on the
# current stream. Scratch tensors may be freed right away: the caching allocator reuses their
# memory only for work queued after these copies on the same stream.
def _gather_to_host(src: torch.Tensor, dst: torch.Tensor, device_ids: torch.Tensor, runs) -> None:
    staged = src.index_select(0, device_ids)
    for start, offset, length in runs:
        dst[start : start + length].copy_(staged[offset : offset + length], non_blocking=True)


def _scatter_from_host(src: torch.Tensor, dst: torch.Tensor, device_ids: torch.Tensor, runs) -> None:
    staged = torch.empty((device_ids.numel(), *src.shape[1:]), dtype=dst.dtype, device=dst.device)
    for start, offset, length in runs:
        staged[offset : offset + length].copy_(src[start : start + length], non_blocking=True)
    dst.index_copy_(0, device_ids, staged)


def _runs(sorted_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, offset in the list, length) of each run of consecutive ids."""
    runs = []
    offset = 0
    n = len(sorted_ids)
    while offset < n:
        end = offset + 1
        while end < n and sorted_ids[end] == sorted_ids[end - 1] + 1:
            end += 1
        runs.append((sorted_ids[offset], offset, end - offset))
        offset = end
    return runs


__all__ = ["HostKVCache", "num_swap_blocks_for"]
