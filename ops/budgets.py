"""Per-tenant budgets: the TOML file, checking spend against it, and a worker's enforcement.

The file (``--budgets FILE``)::

    period = "month"        # "total" (the default), "month" or "day": UTC calendar periods
    default_usd = 100.0     # optional: the budget of every tenant not listed
    [tenants]
    acme = 1200.0
    beta = 0                # no requests at all

A tenant is over budget once its spend in a period reaches its budget. A tenant with no budget
(not listed, and no ``default_usd``) is never over.

Spend is counted in two places that agree. The cost report sums the ``request`` rows of the
costs dataset by tenant and period (after compaction, duplicates bill nobody). For
enforcement, workers keep a Redis hash per period, ``mqinfer:{S}:spend`` (``total``) or
``mqinfer:{S}:spend:2025-01`` (``month``) / ``...:2025-01-31`` (``day``), tenant → dollars: a
worker adds a request's cost with ``HINCRBYFLOAT`` in the transaction that acks its entry, so
a row counts exactly when it is acked; a row written by a worker that crashed before acking
(compaction marks it ``duplicate``) adds nothing, and its redelivered run adds its cost once.

Enforcement (``--enforce-budgets``) happens where a worker reads a request: once the tenant's
spend (read from the hash at most every ``refresh_s``, plus this worker's rows not yet acked)
reaches its budget, the request ends with an error row ``budget_exceeded`` and costs nothing.
Requests already read or running finish, so a tenant can overshoot by what was in flight.
Needs only the standard library and a Redis client: no torch, no pyarrow.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

BUDGET_EXCEEDED = "budget_exceeded"
PERIODS = ("total", "month", "day")
# Period hashes outlive their period by a margin, then expire on their own.
_KEY_TTL_S = {"month": 62 * 86_400, "day": 3 * 86_400}


class BudgetError(ValueError):
    """A budgets file that cannot be used."""


@dataclass(frozen=True)
class Budgets:
    tenants: dict[str, float] = field(default_factory=dict)
    default_usd: float | None = None
    period: str = "total"

    def __post_init__(self) -> None:
        if self.period not in PERIODS:
            raise BudgetError(f"period must be one of {', '.join(PERIODS)}, got {self.period!r}")
        for tenant, usd in self.tenants.items():
            _check_amount(f"tenants.{tenant}", usd)
        if self.default_usd is not None:
            _check_amount("default_usd", self.default_usd)

    def limit(self, tenant: str | None) -> float | None:
        """The tenant's budget in USD per period, or None when it has none."""
        return self.tenants.get(tenant or "default", self.default_usd)

    def period_of(self, unix_s: float) -> str:
        """The budget period a moment falls in: ``""`` (total), ``YYYY-MM`` or ``YYYY-MM-DD`` (UTC)."""
        if self.period == "total":
            return ""
        day = dt.datetime.fromtimestamp(unix_s, tz=dt.timezone.utc)
        return day.strftime("%Y-%m" if self.period == "month" else "%Y-%m-%d")

    def describe_period(self, period: str) -> str:
        return "all time" if self.period == "total" else f"{self.period} {period}"


def _check_amount(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise BudgetError(f"{name} must be a non-negative number of USD, got {value!r}")


def load_budgets(path: str | os.PathLike[str]) -> Budgets:
    """Read and check a budgets TOML file (see the module docstring)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BudgetError(f"budgets file {p} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BudgetError(f"budgets file {p} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"period", "default_usd", "tenants"})
    if unknown:
        raise BudgetError(f"budgets file {p}: unknown keys {', '.join(unknown)} "
                          "(expected period, default_usd and a [tenants] table)")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise BudgetError(f"budgets file {p}: `tenants` must be a table of tenant = USD")
    try:
        return Budgets(tenants={str(k): v for k, v in tenants.items()}, default_usd=data.get("default_usd"),
                       period=data.get("period", "total"))
    except BudgetError as exc:
        raise BudgetError(f"budgets file {p}: {exc}") from None


@dataclass
class BudgetStatus:
    """A tenant's spend against its budget in one period (the worst one in a report's window)."""

    tenant: str
    period: str
    budget_usd: float
    spent_usd: float
    over: bool
    remaining_usd: float


def check_budgets(budgets: Budgets, spend: Mapping[tuple[str, str], float]) -> list[BudgetStatus]:
    """Each budgeted tenant's status, from its spend by (tenant, period).

    A tenant listed in the file appears even without spend; a tenant budgeted only by
    ``default_usd`` appears when it spent something. For a tenant with several periods in
    ``spend`` the one with the highest spend is reported (the latest on a tie). Sorted by
    tenant.
    """
    worst: dict[str, tuple[str, float]] = {tenant: ("", 0.0) for tenant in budgets.tenants}
    for (tenant, period), usd in spend.items():
        if budgets.limit(tenant) is None:
            continue
        best = worst.get(tenant)
        if best is None or (usd, period) > (best[1], best[0]):
            worst[tenant] = (period, usd)
    out = []
    for tenant in sorted(worst):
        period, usd = worst[tenant]
        limit = budgets.limit(tenant)
        out.append(BudgetStatus(tenant=tenant, period=period, budget_usd=limit, spent_usd=usd,
                                over=usd > 0 and usd >= limit, remaining_usd=max(0.0, limit - usd)))
    return out


def spend_key(stream: str, period: str = "") -> str:
    """The Redis hash (tenant -> USD) of one budget period, in the request stream's hash slot."""
    base = f"mqinfer:{{{stream}}}:spend"
    return f"{base}:{period}" if period else base


class BudgetGuard:
    """A worker's side of ``--enforce-budgets``: refuse a spent tenant's new requests, count spend at ack."""

    def __init__(self, budgets: Budgets, redis_client, stream: str, *, clock: Callable[[], float] = time.time,
                 refresh_s: float = 1.0) -> None:
        self.budgets = budgets
        self.redis = redis_client
        self.stream = stream
        self.clock = clock
        self.refresh_s = refresh_s
        # tenant -> (read at, period, USD in the hash then)
        self._read: dict[str, tuple[float, str, float]] = {}
        # entry id -> (tenant, USD, period) of rows written and not acked yet
        self._unacked: dict[str, tuple[str, float, str]] = {}

    def exceeded(self, tenant: str | None) -> str | None:
        """Why a new request of ``tenant`` is refused, or None when it may run."""
        tenant = tenant or "default"
        limit = self.budgets.limit(tenant)
        if limit is None:
            return None
        now = self.clock()
        period = self.budgets.period_of(now)
        cached = self._read.get(tenant)
        if cached is None or cached[1] != period or now - cached[0] >= self.refresh_s:
            raw = self.redis.hget(spend_key(self.stream, period), tenant)
            cached = (now, period, float(raw) if raw is not None else 0.0)
            self._read[tenant] = cached
        spent = cached[2] + sum(usd for t, usd, p in self._unacked.values() if t == tenant and p == period)
        if spent < limit:
            return None
        return (f"tenant {tenant!r} has spent ${spent:.6f} of its ${limit:.6f} budget for "
                f"{self.budgets.describe_period(period)}; its new requests are refused (--enforce-budgets)")

    def note(self, entry_id: str, tenant: str | None, cost_usd: float, finished_at: float) -> None:
        """A request row was written: its cost counts once its entry is acked."""
        if cost_usd > 0:
            self._unacked[entry_id] = (tenant or "default", cost_usd, self.budgets.period_of(finished_at))

    def charge(self, pipe, entry_ids: Iterable[str]) -> list[str]:
        """Queue the spend of ``entry_ids`` on ``pipe`` (the ack transaction); returns the ids
        charged, to pass to :meth:`charged` once the transaction succeeded."""
        charged = []
        touched: set[str] = set()
        for entry_id in entry_ids:
            item = self._unacked.get(entry_id)
            if item is None:
                continue
            tenant, usd, period = item
            key = spend_key(self.stream, period)
            pipe.hincrbyfloat(key, tenant, usd)
            touched.add(period)
            charged.append(entry_id)
        for period in touched:
            ttl = _KEY_TTL_S.get(self.budgets.period)
            if ttl is not None:
                pipe.expire(spend_key(self.stream, period), ttl)
        return charged

    def charged(self, entry_ids: Iterable[str]) -> None:
        """The ack transaction went through: forget these rows' local spend, re-read it next time."""
        for entry_id in entry_ids:
            item = self._unacked.pop(entry_id, None)
            if item is not None:
                self._read.pop(item[0], None)

    def spend_snapshot(self, client=None) -> dict[str, float]:
        """Every tenant's spend in the current period, from Redis (for metrics; ``client``
        defaults to the guard's own)."""
        raw = (client or self.redis).hgetall(spend_key(self.stream, self.budgets.period_of(self.clock())))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}


__all__ = [
    "BUDGET_EXCEEDED", "PERIODS", "BudgetError", "BudgetGuard", "BudgetStatus", "Budgets", "check_budgets",
    "load_budgets", "spend_key",
]
