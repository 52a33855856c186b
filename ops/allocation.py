"""The ``allocation`` basis of cost reports: the fleet's overhead charged to those who used it.

A worker's ``startup``, ``idle`` and ``lost`` rows are device time no request paid for (``lost``:
what a killed worker used and never wrote, billed under its name by the worker that found it dead). ``allocation``
spreads them, per worker and per UTC hour (of ``finished_at``, the hour each row counts in), over
the report's groups in proportion to the device seconds their ``request`` rows used on that
worker in that hour. Overhead of a worker-hour without any request stays unallocated: nobody used
the worker then. The ``usage`` basis (the default) charges requests only. Either way the totals
are every row's: billed + allocated + unallocated overhead + duplicate = TOTAL.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

BASES = ("usage", "allocation")
OVERHEAD_KINDS = ("startup", "idle", "lost")


@dataclass
class Allocation:
    """Overhead spread over group keys (tuples of the ``by`` values, in order)."""

    device_s: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))
    cost_usd: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))
    # Overhead of worker-hours in which no request ran.
    unallocated_device_s: float = 0.0
    unallocated_usd: float = 0.0


def allocate_overhead(table: pa.Table, by: list[str]) -> Allocation:
    """``table``: cost rows (``kind``, ``worker``, ``finished_at``, ``device_s``, ``cost_usd`` and
    the ``by`` columns)."""
    result = Allocation()
    if not table.num_rows:
        return result
    hours = table.append_column("hour", pc.floor_temporal(table["finished_at"], unit="hour"))
    requests = hours.filter(pc.equal(hours["kind"], "request"))
    overhead = hours.filter(pc.is_in(hours["kind"], pa.array(OVERHEAD_KINDS)))
    used: dict[tuple, list[tuple[tuple, float]]] = defaultdict(list)
    if requests.num_rows:
        per_group = requests.group_by(["worker", "hour", *by], use_threads=False).aggregate([("device_s", "sum")])
        for row in per_group.to_pylist():
            used[(row["worker"], row["hour"])].append((tuple(row[k] for k in by), row["device_s_sum"]))
    if not overhead.num_rows:
        return result
    per_hour = overhead.group_by(["worker", "hour"], use_threads=False).aggregate(
        [("device_s", "sum"), ("cost_usd", "sum")])
    for row in per_hour.to_pylist():
        device_s, cost = row["device_s_sum"], row["cost_usd_sum"]
        groups = used.get((row["worker"], row["hour"]), [])
        total = sum(s for _, s in groups)
        if total <= 0:
            result.unallocated_device_s += device_s
            result.unallocated_usd += cost
            continue
        for key, s in groups:
            result.device_s[key] += device_s * s / total
            result.cost_usd[key] += cost * s / total
    return result


__all__ = ["BASES", "Allocation", "OVERHEAD_KINDS", "allocate_overhead"]
