"""A bulk job's cost from the cost rows: the authoritative figure, as opposed to the running one.

Workers write a request's cost row durably before they ack its entry, and only then put its row on
the job's result stream with the row's ``cost_usd``; the job's tasks add those up as they collect
(the *stream* figure). That figure counts one attempt per request: the attempt whose row was
collected. The cost rows hold every attempt the job paid for: a request computed twice (a worker
stalled past ``--claim-idle-ms``, or killed after writing and before acking) has two ``request``
rows, of which compaction marks one ``duplicate``; work handed back at shutdown or dropped when
another worker took the entry over is a ``duplicate`` row of its own. :func:`job_cost` adds up
every row with the job's ``job_id`` in the workers' ``costs/`` datasets, whatever its kind, after
dropping rows identical in every column (as compaction does).

What no row of the job holds: the time a killed worker used and never wrote, which the worker
that finds it dead bills as a ``lost`` row (no ``job_id``: it ran several jobs' requests at once),
and the workers' ``startup`` and ``idle`` time. ``mqinfer report costs --basis allocation --by
job_id`` spreads those over the jobs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from mqinfer.ops.report_sources import is_uri, remote_parts
from mqinfer.schemas.dataset import COSTS_DIR, part_files, partition_for
from mqinfer.schemas.rows import COST_SCHEMA, distinct_rows

log = logging.getLogger("mqinfer.jobs")


@dataclass(frozen=True)
class JobCost:
    """The cost rows of one job, summed: all of them (``cost_usd``, ``device_s``, ``rows``), and by
    kind: ``request`` rows (``request_usd``) and ``duplicate`` rows (``duplicate_usd``, work done
    more than once: retried, handed back or taken over)."""

    cost_usd: float
    device_s: float
    rows: int
    request_usd: float
    duplicate_usd: float
    # Folders given that hold no costs/ dataset (yet): their rows, if any, are not counted.
    missing: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self) | {"missing": list(self.missing)}


def parse_folders(value: str | Iterable[str] | None) -> list[str]:
    """``DIR,DIR,...`` (or a list) as absolute folder paths, in order, without repeats; object
    storage URIs (``s3://...``, as workers' ``--out`` takes them) stay as given."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        item = str(item).strip()
        if item:
            path = item if is_uri(item) else str(Path(item).expanduser().resolve())
            if path not in out:
                out.append(path)
    return out


def rows_since(job: dict) -> float | None:
    """Where a registered job's cost rows can begin (its ``created_at``), for :func:`job_cost`;
    None for a job resumed after its server forgot it, whose first rows predate its registration."""
    if int(job.get("resumed_rows") or 0):
        return None
    try:
        return float(job["created_at"])
    except (KeyError, TypeError, ValueError):
        return None


def job_cost(folders: Iterable[str | os.PathLike[str]], job_id: str, *, since: float | None = None) -> JobCost:
    """Every cost row of ``job_id`` in the ``costs/`` datasets of ``folders`` (workers' ``--out``:
    local folders or object storage URIs).

    ``since`` (unix seconds; the job's creation): date partitions before its day are not read,
    since no row of the job can have finished before the job existed."""
    files, missing, datasets = [], [], []
    first_day = partition_for(since) if since is not None else None
    for folder in folders:
        if is_uri(folder):
            try:
                filesystem, parts = remote_parts(str(folder))
            except FileNotFoundError:
                missing.append(str(folder))
                continue
            parts = [p for p in parts if first_day is None or p.rsplit("/", 2)[-2] >= first_day]
            if parts:
                datasets.append(ds.dataset(parts, format="parquet", schema=COST_SCHEMA, filesystem=filesystem))
            continue
        root = Path(folder) / COSTS_DIR
        if not root.is_dir():
            missing.append(str(folder))
            continue
        files += [f for f in part_files(root) if first_day is None or f.parent.name >= first_day]
    if files:
        datasets.append(ds.dataset([str(f) for f in files], format="parquet", schema=COST_SCHEMA))
    tables = [d.to_table(filter=ds.field("job_id") == job_id) for d in datasets]
    table = pa.concat_tables(tables) if tables else COST_SCHEMA.empty_table()
    if table.num_rows:
        # A row written twice alike (a part published again) counts once, as compaction keeps it.
        table = distinct_rows(table)
    if missing:
        log.warning("job %s: no costs/ dataset in %s; its rows there, if any, are not counted", job_id,
                    ", ".join(missing))

    def usd(kind: str | None = None) -> float:
        rows = table if kind is None else table.filter(pc.equal(table["kind"], kind))
        return float(pc.sum(rows["cost_usd"], min_count=0).as_py() or 0.0)

    return JobCost(
        cost_usd=usd(), device_s=float(pc.sum(table["device_s"], min_count=0).as_py() or 0.0), rows=table.num_rows,
        request_usd=usd("request"), duplicate_usd=usd("duplicate"), missing=tuple(missing),
    )


__all__ = ["JobCost", "job_cost", "parse_folders", "rows_since"]
