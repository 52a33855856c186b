"""Per-tenant rate limits as configured: ``--tenant-limits tenant=tokens_per_s[:requests_per_s],...``.

A token here is what a request may use at most: its prompt tokens plus the output tokens it may
generate (``max_tokens``, fewer when the context length leaves less room). The whole amount is
taken from the tenant's bucket when the request is admitted, before it runs: a reservation made
up front holds the limit across workers without correcting anything afterwards, and a request
that stops early is still charged its reservation (ask for the ``max_tokens`` you need).
:mod:`.queue.buckets` keeps the buckets in Redis; :mod:`.queue.throttle` holds the requests that wait on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits: tokens per second, and optionally requests per second. Each bucket
    holds one second of its rate (a request bucket at least one request): the largest burst."""

    tokens_per_s: float
    requests_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "requests_per_s"):
            value = getattr(self, name)
            if value is None and name == "requests_per_s":
                continue
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def burst_tokens(self) -> float:
        return self.tokens_per_s

    @property
    def burst_requests(self) -> float:
        return max(1.0, self.requests_per_s or 0.0)

    def describe(self) -> str:
        """``200 tokens/s and 2 requests/s``: the limits in words, for messages."""
        text = f"{self.tokens_per_s:g} tokens/s"
        return text if self.requests_per_s is None else f"{text} and {self.requests_per_s:g} requests/s"

    def __str__(self) -> str:
        text = _short_number(self.tokens_per_s)
        return text if self.requests_per_s is None else f"{text}:{_short_number(self.requests_per_s)}"


def request_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """What a request takes from its tenant's token bucket: its prompt plus the output it may
    generate within the context length."""
    return num_prompt_tokens + max(0, min(max_tokens, max_model_len - num_prompt_tokens))


def _number(tenant: str, what: str, raw: str) -> float:
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"tenant limits: the {what} of tenant {tenant!r} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"tenant limits: the {what} of tenant {tenant!r} must be a finite number > 0, got {raw!r}")
    return value


def parse_tenant_limits(text: str | None) -> dict[str, TenantLimit]:
    """``tenant=tokens_per_s[:requests_per_s],...`` as a dict; empty text or None gives no limits.

    Each entry is split at its last ``=``, so a tenant name may hold ``=`` (not ``,``). Rates are
    finite numbers > 0; a tenant named twice, an empty name, an entry without ``=`` or a rate
    missing is an error that names the entry.
    """
    limits: dict[str, TenantLimit] = {}
    if text is None or not str(text).strip():
        return limits
    for position, entry in enumerate(str(text).split(","), start=1):
        item = entry.strip()
        if not item:
            raise ValueError(f"tenant limits: entry {position} is empty "
                             "(expected tenant=tokens_per_s[:requests_per_s],...)")
        tenant, sep, raw = item.rpartition("=")
        tenant = tenant.strip()
        if not sep or not tenant:
            raise ValueError(f"tenant limits: entry {item!r} is not tenant=tokens_per_s[:requests_per_s]")
        tokens, colon, requests = raw.partition(":")
        tokens_per_s = _number(tenant, "tokens per second", tokens)
        requests_per_s = _number(tenant, "requests per second", requests) if colon else None
        if tenant in limits:
            raise ValueError(f"tenant limits: tenant {tenant!r} is given twice")
        limits[tenant] = TenantLimit(tokens_per_s, requests_per_s)
    return limits


def format_tenant_limits(limits: Mapping[str, TenantLimit]) -> str:
    """The ``tenant=tokens_per_s[:requests_per_s],...`` text that ``parse_tenant_limits`` reads
    back to the same limits."""
    return ",".join(f"{tenant}={limit}" for tenant, limit in limits.items())


def _short_number(value: float) -> str:
    """``200`` for 200.0, ``0.5`` for 0.5; all the digits only where the short form would round."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))
