"""Swap space for swap preemption: the host-memory KV blocks and the copies to and from them.

Owns ``HostKVCache``: for every layer a K and a V tensor of ``[num_blocks, block_size,
num_kv_heads, head_dim]`` in host memory, a pool separate from the device cache, and the two
copies the scheduler asks for (``SchedulerOutput.swap_out`` / ``swap_in``). Which block goes
where is the KV cache manager's decision; this module only moves the bytes.

On CUDA the host memory is pinned, so the copies are asynchronous DMA on the current stream:
each step's copies are queued before its forward pass and stream order keeps them ahead of
every kernel that reads or rewrites those blocks, without a host sync. On the CPU both caches
live in the same memory; the pool is still separate, so that swap preemption runs the same
code paths there as on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


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
    ) -> None:
        """``block_shape`` is (block_size, num_kv_heads, head_dim), as in the device cache."""
        if num_blocks < 1 or num_layers < 1:
            raise ValueError(f"a host KV cache needs at least one block and layer, got {num_blocks}, {num_layers}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        # One allocation for everything (pinning is paid per allocation), viewed per layer.
        # Never zeroed: a host block is only ever read after a swap-out wrote it.
        self._storage = torch.empty(
            (num_layers, 2, num_blocks, *self.block_shape), dtype=dtype, pin_memory=pin_memory
        )
        self.caches = [(self._storage[i, 0], self._storage[i, 1]) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

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
            for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
                hk.index_copy_(0, index, dk.index_select(0, device_ids))
                hv.index_copy_(0, index, dv.index_select(0, device_ids))
            return
        runs = _runs(host_ids)
        for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
            _gather_to_host(dk, hk, device_ids, runs)
            _gather_to_host(dv, hv, device_ids, runs)

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
            for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
                dk.index_copy_(0, device_ids, hk.index_select(0, index))
                dv.index_copy_(0, device_ids, hv.index_select(0, index))
            return
        runs = _runs(host_ids)
        for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
            _scatter_from_host(hk, dk, device_ids, runs)
            _scatter_from_host(hv, dv, device_ids, runs)

    def _check(self, device_caches: KVCaches, pairs: Sequence[tuple[int, int]], host_side: int) -> None:
        if len(device_caches) != self.num_layers:
            raise ValueError(f"got {len(device_caches)} device layers for a host cache of {self.num_layers}")
        k = device_caches[0][0]
        if tuple(k.shape[1:]) != self.block_shape or k.dtype != self.dtype:
            raise ValueError(
                f"device blocks {tuple(k.shape[1:])} {k.dtype} do not match host blocks {self.block_shape} {self.dtype}"
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
