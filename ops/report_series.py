"""The series a cost report draws beyond its tables: each group's billed cost per hour, and the
distribution of cost per request (ops/report_html.py charts them; JSON has them too)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

# Bins of the cost distribution per decade of dollars.
BINS_PER_DECADE = 4


@dataclass
class GroupHour:
    """A group's billed cost in one UTC hour (of ``finished_at``)."""

    hour: str  # start of the hour, ISO 8601, UTC
    key: dict[str, str | None]
    cost_usd: float


@dataclass
class CostBin:
    """Requests whose cost (every choice's) lies in [lo_usd, hi_usd); the first bin, lo = hi = 0,
    holds the requests that cost nothing (refused, invalid, cancelled before they ran)."""

    lo_usd: float
    hi_usd: float
    requests: int


def _iso(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def group_hours(billed: pa.Table, by: Sequence[str]) -> list[GroupHour]:
    """The ``billed`` (request) rows summed by hour and group, in hour then key order."""
    if not billed.num_rows:
        return []
    table = billed.select(list(by) + ["cost_usd"]).append_column(
        "hour", pc.floor_temporal(billed["finished_at"], unit="hour"))
    agg = table.group_by(["hour", *by], use_threads=False).aggregate([("cost_usd", "sum")]).to_pylist()
    agg.sort(key=lambda r: (r["hour"], [(r[k] is None, r[k] or "") for k in by]))
    return [GroupHour(hour=_iso(r["hour"]), key={k: r[k] for k in by}, cost_usd=r["cost_usd_sum"]) for r in agg]


def cost_distribution(billed: pa.Table) -> list[CostBin]:
    """How many requests cost how much: log-spaced bins (BINS_PER_DECADE a decade), a request
    being (job_id, id) with the cost of all its choices."""
    if not billed.num_rows:
        return []
    keyed = pa.table({"job_id": pc.fill_null(billed["job_id"], ""), "id": pc.fill_null(billed["id"], ""),
                      "cost_usd": billed["cost_usd"]})
    costs = keyed.group_by(["job_id", "id"], use_threads=False).aggregate([("cost_usd", "sum")])["cost_usd_sum"]
    values = [c for c in costs.to_pylist() if c is not None]
    free = sum(1 for c in values if c <= 0)
    paid = [c for c in values if c > 0]
    bins = [CostBin(0.0, 0.0, free)] if free else []
    if not paid:
        return bins
    first = math.floor(math.log10(min(paid)) * BINS_PER_DECADE)
    last = math.floor(math.log10(max(paid)) * BINS_PER_DECADE)
    counts = [0] * (last - first + 1)
    for c in paid:
        i = min(max(math.floor(math.log10(c) * BINS_PER_DECADE) - first, 0), len(counts) - 1)
        counts[i] += 1
    for i, n in enumerate(counts):
        lo, hi = 10 ** ((first + i) / BINS_PER_DECADE), 10 ** ((first + i + 1) / BINS_PER_DECADE)
        bins.append(CostBin(lo, hi, n))
    return bins


__all__ = ["BINS_PER_DECADE", "CostBin", "GroupHour", "cost_distribution", "group_hours"]
