"""Scheduler configuration: KV cache geometry and per-step limits, validated when built."""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `block_size=True` is a mistake, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How big the paged KV cache is and how much work one engine step may hold.

    ``num_kv_blocks`` blocks of ``block_size`` tokens each; every block id in
    ``range(num_kv_blocks)`` is usable (none is reserved).
    """

    block_size: int = 16
    num_kv_blocks: int = 4096
    # Token budget per step: prompt chunks and decode tokens of all scheduled requests together.
    max_num_batched_tokens: int = 2048
    # Running requests at most.
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        # Every running request gets at least one token per step (decodes never stall), which
        # needs a budget of at least one token per running request.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so that every running request can advance each step"
            )

    @property
    def num_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.block_size * self.num_kv_blocks
