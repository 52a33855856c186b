"""Budgets: the TOML file, checking spend against it, and a worker's enforcement.

The file (``--budgets FILE``)::

    period = "month"        # "total" (the default), "month" or "day": UTC calendar periods
    default_usd = 100.0     # optional: the budget of every tenant not listed
    thresholds = [50, 80, 100]  # optional: warning lines, percent of each budget (this is the default)
    [tenants]
    acme = 1200.0
    beta = 0                # no requests at all
    [jobs]                  # optional: budgets of bulk jobs, by job id
    nightly-eval = 40.0
    [metadata.business_line]  # optional: budgets of the requests labelled business_line = VALUE
    retail = 500.0

A budget belongs to a **group**: a tenant, a job, or the requests whose ``metadata`` label KEY
has one VALUE (``metadata.KEY = VALUE``). A group reaches a warning threshold once its spend in
a period reaches that percent of its budget, and is over budget once its spend reaches the
budget. A group with no budget (not listed, and for tenants no ``default_usd``) is never over.

Spend is counted in two places that agree. The cost report sums the ``request`` rows of the
costs dataset by group and period (after compaction, duplicates bill nobody). For
enforcement, workers keep Redis hashes per period: tenants in ``mqinfer:{S}:spend`` (``total``)
or ``mqinfer:{S}:spend:2025-01`` (``month``) / ``...:2025-01-31`` (``day``), tenant → dollars,
and the other groups in ``mqinfer:{S}:spend-groups`` (the same suffixes), ``KEY=VALUE`` →
dollars (``job_id=nightly-eval``, ``metadata.business_line=retail``): a worker adds a request's
cost with ``HINCRBYFLOAT`` in the transaction that acks its entry, so a row counts exactly when
it is acked; a row written by a worker that crashed before acking (compaction marks it
``duplicate``) adds nothing, and its redelivered run adds its cost once.

Enforcement (``--enforce-budgets``) happens where a worker reads a request: once the spend of
any budgeted group the request belongs to (read from the hash at most every ``refresh_s``, plus
this worker's rows not yet acked) reaches its budget, the request ends with an error row
``budget_exceeded`` and costs nothing. Requests already read or running finish, so a group can
overshoot by what was in flight. Needs only the standard library and a Redis client: no torch,
no pyarrow.
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
# Warning lines, percent of a budget: a group's status lists each one its spend reached.
DEFAULT_THRESHOLDS = (50.0, 80.0, 100.0)
METADATA_PREFIX = "metadata."
# The group keys a budget may name besides metadata.KEY, in the order reports list them.
BUDGET_KEYS = ("tenant", "job_id")
# Period hashes outlive their period by a margin, then expire on their own.
_KEY_TTL_S = {"month": 62 * 86_400, "day": 3 * 86_400}


class BudgetError(ValueError):
    """A budgets file that cannot be used."""


@dataclass(frozen=True)
class Budgets:
    tenants: dict[str, float] = field(default_factory=dict)
    default_usd: float | None = None
    period: str = "total"
    # Job id -> USD, and metadata label KEY -> VALUE -> USD.
    jobs: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, dict[str, float]] = field(default_factory=dict)
    # Warning lines, percent of each budget, ascending.
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS

    def __post_init__(self) -> None:
        if self.period not in PERIODS:
            raise BudgetError(f"period must be one of {', '.join(PERIODS)}, got {self.period!r}")
        for tenant, usd in self.tenants.items():
            _check_amount(f"tenants.{tenant}", usd)
        if self.default_usd is not None:
            _check_amount("default_usd", self.default_usd)
        for job, usd in self.jobs.items():
            _check_amount(f"jobs.{job}", usd)
        for label, values in self.metadata.items():
            if not label or not isinstance(values, dict):
                raise BudgetError(f"metadata.{label} must be a table of VALUE = USD")
            for value, usd in values.items():
                _check_amount(f"metadata.{label}.{value}", usd)
        thresholds = self.thresholds
        if (not isinstance(thresholds, (list, tuple)) or not thresholds
                or any(isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1000
                       for t in thresholds)
                or list(thresholds) != sorted(set(thresholds))):
            raise BudgetError(f"thresholds must be ascending percents of a budget in (0, 1000], got {thresholds!r}")
        object.__setattr__(self, "thresholds", tuple(float(t) for t in thresholds))

    def limit(self, tenant: str | None) -> float | None:
        """The tenant's budget in USD per period, or None when it has none."""
        return self.tenants.get(tenant or "default", self.default_usd)

    def budget_of(self, key: str, value: str | None) -> float | None:
        """The budget of the group ``key`` = ``value`` (``tenant``, ``job_id`` or ``metadata.KEY``),
        or None when it has none."""
        if key == "tenant":
            return self.limit(value)
        if value is None:
            return None
        if key == "job_id":
            return self.jobs.get(value)
        if key.startswith(METADATA_PREFIX):
            return self.metadata.get(key[len(METADATA_PREFIX):], {}).get(value)
        return None

    def keys(self) -> list[str]:
        """The group keys this file budgets: ``tenant`` (always: default_usd may cover any),
        ``job_id`` when it lists jobs, ``metadata.KEY`` for each label it lists."""
        return ["tenant"] + (["job_id"] if self.jobs else []) + [METADATA_PREFIX + k for k in sorted(self.metadata)]

    def listed(self) -> list[tuple[str, str, float]]:
        """Every group the file names, as (key, value, USD): tenants, jobs, then metadata groups."""
        return ([("tenant", t, usd) for t, usd in sorted(self.tenants.items())]
                + [("job_id", j, usd) for j, usd in sorted(self.jobs.items())]
                + [(METADATA_PREFIX + k, v, usd) for k in sorted(self.metadata)
                   for v, usd in sorted(self.metadata[k].items())])

    def groups_of(self, tenant: str | None, job_id: str | None = None,
                  metadata: Mapping[str, str] | None = None) -> list[tuple[str, str, float]]:
        """The budgeted groups a request belongs to, as (key, value, USD)."""
        out = []
        tenant = tenant or "default"
        limit = self.limit(tenant)
        if limit is not None:
            out.append(("tenant", tenant, limit))
        if job_id is not None and job_id in self.jobs:
            out.append(("job_id", job_id, self.jobs[job_id]))
        for label, values in self.metadata.items():
            value = (metadata or {}).get(label)
            if value is not None and value in values:
                out.append((METADATA_PREFIX + label, value, values[value]))
        return out

    def reached(self, spent: float, budget: float) -> list[float]:
        """The thresholds (percent) that ``spent`` reached of ``budget`` (a zero budget: every
        threshold once anything is spent)."""
        if spent <= 0:
            return []
        return [t for t in self.thresholds if budget <= 0 or spent >= budget * t / 100.0]

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
    unknown = sorted(set(data) - {"period", "default_usd", "thresholds", "tenants", "jobs", "metadata"})
    if unknown:
        raise BudgetError(f"budgets file {p}: unknown keys {', '.join(unknown)} "
                          "(expected period, default_usd, thresholds and [tenants], [jobs], [metadata.KEY] tables)")
    tables = {}
    for name, what in (("tenants", "tenant = USD"), ("jobs", "job id = USD"), ("metadata", "KEY = {VALUE = USD}")):
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise BudgetError(f"budgets file {p}: `{name}` must be a table of {what}")
        tables[name] = table
    try:
        return Budgets(tenants={str(k): v for k, v in tables["tenants"].items()}, default_usd=data.get("default_usd"),
                       period=data.get("period", "total"), jobs={str(k): v for k, v in tables["jobs"].items()},
                       metadata=dict(tables["metadata"]),
                       thresholds=data.get("thresholds", DEFAULT_THRESHOLDS))
    except BudgetError as exc:
        raise BudgetError(f"budgets file {p}: {exc}") from None


@dataclass
class BudgetStatus:
    """A group's spend against its budget in one period (the worst one in a report's window)."""

    # The tenant, for a tenant's budget; None for the other groups.
    tenant: str | None
    period: str
    budget_usd: float
    spent_usd: float
    over: bool
    remaining_usd: float
    # The group: ``tenant``, ``job_id`` or ``metadata.KEY``, and its value.
    key: str = "tenant"
    value: str = ""
    # The warning thresholds (percent of the budget) the spend reached.
    thresholds_reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.value and self.key == "tenant" and self.tenant is not None:
            self.value = self.tenant

    @property
    def group(self) -> str:
        """``KEY=VALUE``: how reports and metrics name the group."""
        return f"{self.key}={self.value}"


def check_budgets(budgets: Budgets, spend: Mapping[tuple[str, str], float]) -> list[BudgetStatus]:
    """Each budgeted tenant's status, from its spend by (tenant, period) (see :func:`check_groups`)."""
    return [s for s in check_groups(budgets, {("tenant", t, p): usd for (t, p), usd in spend.items()})
            if s.key == "tenant"]


def check_groups(budgets: Budgets, spend: Mapping[tuple[str, str, str], float]) -> list[BudgetStatus]:
    """Each budgeted group's status, from its spend by (key, value, period).

    A group listed in the file appears even without spend; a tenant budgeted only by
    ``default_usd`` appears when it spent something. For a group with several periods in
    ``spend`` the one with the highest spend is reported (the latest on a tie). Sorted by key
    (tenant, job_id, metadata.KEY) and value.
    """
    worst: dict[tuple[str, str], tuple[str, float]] = {(k, v): ("", 0.0) for k, v, _ in budgets.listed()}
    for (key, value, period), usd in spend.items():
        if budgets.budget_of(key, value) is None:
            continue
        best = worst.get((key, value))
        if best is None or (usd, period) > (best[1], best[0]):
            worst[(key, value)] = (period, usd)
    order = {k: i for i, k in enumerate(BUDGET_KEYS)}
    out = []
    for key, value in sorted(worst, key=lambda kv: (order.get(kv[0], len(order)), kv[0], kv[1])):
        period, usd = worst[(key, value)]
        limit = budgets.budget_of(key, value)
        out.append(BudgetStatus(tenant=value if key == "tenant" else None, period=period, budget_usd=limit,
                                spent_usd=usd, over=usd > 0 and usd >= limit, remaining_usd=max(0.0, limit - usd),
                                key=key, value=value, thresholds_reached=budgets.reached(usd, limit)))
    return out


def spend_key(stream: str, period: str = "") -> str:
    """The Redis hash (tenant -> USD) of one budget period, in the request stream's hash slot."""
    base = f"mqinfer:{{{stream}}}:spend"
    return f"{base}:{period}" if period else base


def group_spend_key(stream: str, period: str = "") -> str:
    """The Redis hash (``KEY=VALUE`` -> USD) of the job and metadata groups' spend in one budget
    period, in the request stream's hash slot."""
    base = f"mqinfer:{{{stream}}}:spend-groups"
    return f"{base}:{period}" if period else base


def _describe(key: str, value: str) -> str:
    return f"tenant {value!r}" if key == "tenant" else f"job {value!r}" if key == "job_id" else f"{key}={value!r}"


class BudgetGuard:
    """A worker's side of ``--enforce-budgets``: refuse the new requests of a group that spent its
    budget, count spend at ack."""

    def __init__(self, budgets: Budgets, redis_client, stream: str, *, clock: Callable[[], float] = time.time,
                 refresh_s: float = 1.0) -> None:
        self.budgets = budgets
        self.redis = redis_client
        self.stream = stream
        self.clock = clock
        self.refresh_s = refresh_s
        # (key, value) -> (read at, period, USD in the hash then)
        self._read: dict[tuple[str, str], tuple[float, str, float]] = {}
        # entry id -> (groups, USD, period) of rows written and not acked yet
        self._unacked: dict[str, tuple[tuple[tuple[str, str], ...], float, str]] = {}

    def _hash_and_field(self, key: str, value: str, period: str) -> tuple[str, str]:
        if key == "tenant":
            return spend_key(self.stream, period), value
        return group_spend_key(self.stream, period), f"{key}={value}"

    def exceeded(self, tenant: str | None, *, job_id: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> str | None:
        """Why a new request (of ``tenant``, ``job_id``, ``metadata``) is refused, or None when it may run."""
        groups = self.budgets.groups_of(tenant, job_id, metadata)
        if not groups:
            return None
        now = self.clock()
        period = self.budgets.period_of(now)
        for key, value, limit in groups:
            spent = self.spent(key, value, now, period)
            if spent >= limit:
                return (f"{_describe(key, value)} has spent ${spent:.6f} of its ${limit:.6f} budget for "
                        f"{self.budgets.describe_period(period)}; its new requests are refused (--enforce-budgets)")
        return None

    def spent(self, key: str, value: str, now: float, period: str) -> float:
        """The group's spend in ``period``: the hash (re-read after ``refresh_s``) and this worker's
        rows not acked yet."""
        cached = self._read.get((key, value))
        if cached is None or cached[1] != period or now - cached[0] >= self.refresh_s:
            raw = self.redis.hget(*self._hash_and_field(key, value, period))
            cached = (now, period, float(raw) if raw is not None else 0.0)
            self._read[(key, value)] = cached
        return cached[2] + sum(usd for groups, usd, p in self._unacked.values()
                               if p == period and (key, value) in groups)

    def note(self, entry_id: str, tenant: str | None, cost_usd: float, finished_at: float, *,
             job_id: str | None = None, metadata: Mapping[str, str] | None = None) -> None:
        """A request row was written: its cost counts once its entry is acked (for its tenant
        always, for its job and metadata groups where they have a budget)."""
        if cost_usd > 0:
            tenant = tenant or "default"
            groups = (("tenant", tenant),) + tuple(
                (k, v) for k, v, _ in self.budgets.groups_of(tenant, job_id, metadata) if k != "tenant")
            self._unacked[entry_id] = (groups, cost_usd, self.budgets.period_of(finished_at))

    def charge(self, pipe, entry_ids: Iterable[str]) -> list[str]:
        """Queue the spend of ``entry_ids`` on ``pipe`` (the ack transaction); returns the ids
        charged, to pass to :meth:`charged` once the transaction succeeded."""
        charged = []
        touched: set[str] = set()
        for entry_id in entry_ids:
            item = self._unacked.get(entry_id)
            if item is None:
                continue
            groups, usd, period = item
            for key, value in groups:
                name, hash_field = self._hash_and_field(key, value, period)
                pipe.hincrbyfloat(name, hash_field, usd)
                touched.add(name)
            charged.append(entry_id)
        ttl = _KEY_TTL_S.get(self.budgets.period)
        if ttl is not None:
            for name in sorted(touched):
                pipe.expire(name, ttl)
        return charged

    def charged(self, entry_ids: Iterable[str]) -> None:
        """The ack transaction went through: forget these rows' local spend, re-read it next time."""
        for entry_id in entry_ids:
            item = self._unacked.pop(entry_id, None)
            if item is not None:
                for group in item[0]:
                    self._read.pop(group, None)

    def spend_snapshot(self, client=None) -> dict[str, float]:
        """Every tenant's spend in the current period, from Redis (for metrics; ``client``
        defaults to the guard's own)."""
        raw = (client or self.redis).hgetall(spend_key(self.stream, self.budgets.period_of(self.clock())))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}

    def group_spend_snapshot(self, client=None) -> dict[tuple[str, str], float]:
        """Every group's spend in the current period, (key, value) -> USD: the tenants' and the job
        and metadata groups' (for metrics)."""
        client = client or self.redis
        out = {("tenant", t): usd for t, usd in self.spend_snapshot(client).items()}
        raw = client.hgetall(group_spend_key(self.stream, self.budgets.period_of(self.clock())))
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else k
            key, _, value = name.partition("=")
            out[(key, value)] = float(v)
        return out


__all__ = [
    "BUDGET_EXCEEDED", "BUDGET_KEYS", "DEFAULT_THRESHOLDS", "PERIODS", "BudgetError", "BudgetGuard", "BudgetStatus",
    "Budgets", "check_budgets", "check_groups", "group_spend_key", "load_budgets", "spend_key",
]
