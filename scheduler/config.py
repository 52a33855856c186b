"""Scheduler configuration: KV cache geometry and per-step limits, validated when built."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, check_scope

PREEMPTION_MODES = ("recompute", "swap")

# Tenant weights as the scheduler keeps them: (tenant, weight) pairs sorted by tenant.
TenantWeights = tuple[tuple[str, float], ...]


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """``tenant=weight,tenant=weight`` as a dict; empty text or None gives no weights.

    Each entry is split at its last ``=``, so a tenant name may hold ``=`` (not ``,``). A weight
    is a finite number > 0; a tenant named twice, an empty name or an entry without ``=`` is an
    error that names the entry.
    """
    weights: dict[str, float] = {}
    if text is None or not str(text).strip():
        return weights
    for position, entry in enumerate(str(text).split(","), start=1):
        item = entry.strip()
        if not item:
            raise ValueError(f"tenant weights: entry {position} is empty (expected tenant=weight,tenant=weight)")
        tenant, sep, raw = item.rpartition("=")
        tenant, raw = tenant.strip(), raw.strip()
        if not sep or not tenant:
            raise ValueError(f"tenant weights: entry {item!r} is not tenant=weight")
        try:
            weight = float(raw)
        except ValueError:
            raise ValueError(f"tenant weights: the weight of tenant {tenant!r} must be a number, got {raw!r}") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"tenant weights: the weight of tenant {tenant!r} must be a finite number > 0, got {raw!r}")
        if tenant in weights:
            raise ValueError(f"tenant weights: tenant {tenant!r} is given twice")
        weights[tenant] = weight
    return weights


def format_tenant_weights(weights: Mapping[str, float] | Iterable[tuple[str, float]]) -> str:
    """The ``tenant=weight,...`` text that ``parse_tenant_weights`` reads back to the same weights."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    return ",".join(f"{tenant}={_short_number(weight)}" for tenant, weight in pairs)


def _short_number(value: float) -> str:
    """``2`` for 2.0, ``0.5`` for 0.5; all the digits only where the short form would round."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


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

    # These defaults are also the engine's: EngineConfig (workers/config.py) takes its block
    # size, step limits, prefix caching, preemption mode and aging from here, and `mqinfer worker
    # --help` shows them. The step limits are the measured ones (BENCHMARKS.md). num_kv_blocks
    # and max_model_len the engine always sizes itself (from memory and from the model); their
    # defaults serve callers that build a scheduler directly.
    block_size: int = 16
    num_kv_blocks: int = 4096
    # Token budget per step: prompt chunks and decode tokens of all scheduled requests together.
    # 2048: a bulk backlog's throughput is the same as with 4096 (SmolLM2, 600 x (128 + 64), a
    # 2-vCPU Xeon, 2026-12-06: 1075-1091 output tokens/s against 1076-1087; 512 lost 11%; a
    # prefill-heavy 96 x (160 + 48) run may lose 2-4%, within that machine's noise), and a
    # request that arrives during a full prompt step waits half as long for it (about 0.37 s
    # there instead of 0.75).
    max_num_batched_tokens: int = 2048
    # Running requests at most.
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    # Who shares cached prefix blocks (schemas/cache_scope.py): "tenant", requests of one tenant
    # (and one cache salt); "global", every request (of one cache salt).
    prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE
    # What a preempted request does with its KV: "recompute" drops it (the prefix cache keeps
    # what it can) and computes it again on re-admission; "swap" copies it to a host-memory
    # pool of ``num_swap_blocks`` blocks and back, falling back to recompute when that is full.
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0
    # Priority aging: a waiting request's effective priority is ``priority - waited_s /
    # priority_aging_s`` (lowest runs first), so one priority level is worth this many seconds
    # of waiting and nothing starves. None: strict priority, first come first served within it.
    priority_aging_s: float | None = 60.0
    # Fair share between tenants within a priority level (scheduler/fair.py): each tenant's
    # service counts divided by its weight here; a tenant not named has weight 1. Given as a
    # mapping or (tenant, weight) pairs, kept as pairs sorted by tenant.
    tenant_weights: TenantWeights = ()
    # Speculative decoding: a running request about to sample may carry up to this many proposed
    # tokens, checked in the same step (0 = off; the scheduler also needs a proposer).
    num_speculative_tokens: int = 0
    # Proposals are added only while the step's scheduled tokens stay at or below this many, so that
    # a busy step (prefill chunks, many decodes) runs without them.
    speculative_max_batched_tokens: int = 32
    # Within that ceiling, True: each request runs only the proposals the speculation policy
    # (scheduler/speculation.py) expects to pay for themselves; False: every request that can
    # runs up to num_speculative_tokens, whatever its acceptance so far.
    speculative_adaptive: bool = True
    # While requests with latency targets are in, plan each step to keep them (scheduler/slo.py):
    # bulk decodes and prompt tokens only as many as the step-time model says fit. False composes
    # every step as if no request had a target (they still come first in the order).
    slo_step_plans: bool = True

    def __post_init__(self) -> None:
        self._normalize_tenant_weights()
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        check_scope(self.prefix_cache_scope)
        swap = self.num_swap_blocks
        if not isinstance(swap, int) or isinstance(swap, bool) or swap < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {self.num_swap_blocks!r}")
        if self.preemption_mode == "swap" and self.num_swap_blocks == 0:
            raise ValueError("preemption_mode swap needs swap space: num_swap_blocks must be at least 1")
        for name in ("num_speculative_tokens", "speculative_max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.slo_step_plans, bool):
            raise ValueError(f"slo_step_plans must be true or false, got {self.slo_step_plans!r}")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"speculative_adaptive must be true or false, got {self.speculative_adaptive!r}")
        aging = self.priority_aging_s
        if aging is not None and (
            not isinstance(aging, (int, float)) or isinstance(aging, bool) or not math.isfinite(aging) or aging <= 0
        ):
            raise ValueError(f"priority_aging_s must be a finite number of seconds > 0 (or None: off), got {aging!r}")
        # Every running request gets at least one token per step (decodes never stall), which
        # needs a budget of at least one token per running request.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so that every running request can advance each step"
            )

    def _normalize_tenant_weights(self) -> None:
        given = self.tenant_weights
        if isinstance(given, str):
            raise ValueError("tenant_weights must be a mapping of tenant to weight (parse text with "
                             "parse_tenant_weights)")
        pairs = list(given.items() if isinstance(given, Mapping) else given)
        seen: set[str] = set()
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"tenant_weights: expected (tenant, weight) pairs, got {pair!r}")
            tenant, weight = pair
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"tenant_weights: a tenant must be a non-empty string, got {tenant!r}")
            if tenant in seen:
                raise ValueError(f"tenant_weights: tenant {tenant!r} is given twice")
            seen.add(tenant)
            if (not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight)
                    or weight <= 0):
                raise ValueError(f"tenant_weights: the weight of tenant {tenant!r} must be a finite number > 0, "
                                 f"got {weight!r}")
        object.__setattr__(self, "tenant_weights", tuple(sorted((t, float(w)) for t, w in pairs)))

    def weight_of(self, tenant: str) -> float:
        """The tenant's fair-share weight (1 when not named)."""
        for name, weight in self.tenant_weights:
            if name == tenant:
                return weight
        return 1.0

    @property
    def num_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.block_size * self.num_kv_blocks
