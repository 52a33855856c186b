"""Compaction of an output folder: one result row per request, every cost row billed once.

Delivery is at least once, so a request can have several result rows (a retry after a crash, a
re-claimed entry, an error row and a later success). Compaction keeps, per (``job_id``, ``id``,
``index``) (a request with ``n`` choices has one row per choice ``index``), a non-error row if
there is one, else the first written, ordering rows by ``finished_at``, then part file name, then
row index. Cost rows are all kept, but a ``request`` row whose (``job_id``, ``id``, ``index``,
``worker``, ``finished_at``) is not the kept result's becomes ``duplicate`` (it bills nobody); a
row written twice (every column equal, a retried write) is kept once. The rule is a fixed point:
compacting compacted data changes nothing. Rows written before the ``index`` column existed are
choice 0, and partitions compaction rewrites say so.

Rewriting is crash-safe. New files are first written under temporary names; then a journal
listing the renames and deletions is published atomically; then it is carried out and removed.
On start, a journal left by a crash is carried out to the end (every step is idempotent) and
temporary files without a journal are deleted, so killing compaction anywhere and running it
again gives exactly the rows one uninterrupted run gives. A lock file keeps two compactions of
one folder apart. Memory use is bounded by the key columns of all results plus one partition.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mqinfer.schemas import faults
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, with_choice_index, with_device_share
from mqinfer.schemas.dataset import COSTS_DIR, PARQUET_COMPRESSION, RESULTS_DIR, fsync_dir, part_files
from mqinfer.schemas.dataset_uri import is_remote, rewrite_remote

JOURNAL_NAME = ".compact-journal.json"
LOCK_NAME = ".compact.lock"
TEMP_PREFIX = ".compact-tmp-"
# Stands in for a null job_id in join keys (Arrow joins never match nulls); job ids cannot hold
# control characters, so it cannot collide with a real one.
_NO_JOB = "\x00"

FaultHook = Callable[[str], None]


@dataclass
class CompactStats:
    results_before: int = 0
    results_after: int = 0
    # Result rows discarded because another row of the same request was kept.
    duplicates_removed: int = 0
    costs_before: int = 0
    costs_after: int = 0
    # Cost rows that were kind "request" before and are "duplicate" now.
    cost_rows_marked_duplicate: int = 0
    # Cost rows dropped because an identical row (every column) was written before.
    identical_cost_rows_removed: int = 0
    files_before: int = 0
    files_after: int = 0
    # True when an interrupted compaction's journal was found and carried out first.
    recovered: bool = False


@dataclass
class _Plan:
    """New files (already written under temp names) and the old files they replace."""

    renames: list[tuple[Path, Path]]
    deletes: list[Path]


def compact(out_dir: str | os.PathLike[str], *, fault: FaultHook | None = None) -> CompactStats:
    """Compact ``out_dir/results`` and ``out_dir/costs`` in place; see the module docstring.

    ``fault`` is for crash tests only: it is called with the name of each step
    (``temp_written``, ``journal_written``, ``rename:<i>``, ``delete:<i>``, and ``recover:...``
    during recovery) and may raise to simulate a crash there. Without one, each step is the
    named fault point ``compact.<step>`` of :mod:`mqinfer.schemas.faults` (off unless a test arms it).
    """
    out = Path(out_dir)
    stats = CompactStats()
    if not out.is_dir():
        return stats
    step = fault or _fault_points()
    with _locked(out / LOCK_NAME):
        stats.recovered = _recover(out, step)
        run = uuid.uuid4().hex[:8]
        writer = _TempWriter(run)
        result_files = part_files(out / RESULTS_DIR)
        cost_files = part_files(out / COSTS_DIR)
        stats.files_before = len(result_files) + len(cost_files)
        kept = _plan_results(result_files, writer, stats)
        _plan_costs(cost_files, kept, writer, stats)
        plan = writer.plan()
        stats.files_after = stats.files_before - len(plan.deletes) + len(plan.renames)
        if not plan.deletes and not plan.renames:
            return stats
        for folder in {temp.parent for temp, _ in plan.renames}:
            fsync_dir(folder)
        step("temp_written")
        _write_journal(out, plan)
        step("journal_written")
        _apply(out, plan, step, prefix="")
    return stats


def drop_job(out_dir: str | os.PathLike[str], job_id: str, ids: Collection[str] | None = None) -> tuple[int, int]:
    """Remove every result and cost row of ``job_id`` from ``out_dir`` (``mqinfer run --fresh``), or
    with ``ids`` only those of these requests (``mqinfer run`` retrying the requests a cost cap
    stopped).

    Uses the same crash-safe journal as :func:`compact`; returns (result rows, cost rows) removed.
    In object storage (a URI) each part with such rows is replaced by one without them
    (:func:`mqinfer.schemas.dataset_uri.rewrite_remote`).
    """
    if is_remote(out_dir):
        return tuple(rewrite_remote(str(out_dir), dataset, schema, _job_mask(job_id, ids))
                     for dataset, schema in ((RESULTS_DIR, RESULT_SCHEMA), (COSTS_DIR, COST_SCHEMA)))
    out = Path(out_dir)
    if not out.is_dir():
        return 0, 0
    step = _fault_points()
    removed = {RESULTS_DIR: 0, COSTS_DIR: 0}
    with _locked(out / LOCK_NAME):
        _recover(out, step)
        writer = _TempWriter(uuid.uuid4().hex[:8])
        for dataset, schema in ((RESULTS_DIR, RESULT_SCHEMA), (COSTS_DIR, COST_SCHEMA)):
            for path in part_files(out / dataset):
                table = _read(path, schema)
                if schema is COST_SCHEMA:
                    table = with_device_share(table)
                mine = _job_mask(job_id, ids)(table)
                count = pc.sum(mine).as_py() or 0
                if not count:
                    continue
                removed[dataset] += count
                writer.deletes.append(path)
                keep = table.filter(pc.invert(mine))
                if keep.num_rows:
                    temp, parquet = writer.start(path.parent, schema)
                    parquet.write_table(keep)
                    writer.finish(temp, parquet)
        plan = writer.plan()
        if plan.deletes:
            for folder in {temp.parent for temp, _ in plan.renames}:
                fsync_dir(folder)
            _write_journal(out, plan)
            _apply(out, plan, step, prefix="")
    return removed[RESULTS_DIR], removed[COSTS_DIR]


def _job_mask(job_id: str, ids: Collection[str] | None):
    """The rows of ``job_id`` (of the requests ``ids`` only, when given) of a table, as a mask."""
    def mask(table: pa.Table):
        mine = pc.fill_null(pc.equal(table["job_id"], job_id), False)
        if ids is not None:
            mine = pc.and_(mine, pc.fill_null(pc.is_in(table["id"], value_set=pa.array(sorted(ids), pa.string())),
                                              False))
        return mine
    return mask


def _fault_points() -> FaultHook:
    if not faults.enabled():
        return lambda name: None
    return lambda name: faults.hit(f"compact.{name}")


# -- locking, journal, recovery -----------------------------------------------------------------


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another compaction of {path.parent} is running (lock {path} is held)") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_journal(out: Path, plan: _Plan) -> None:
    doc = {
        "version": 1,
        "renames": [[str(t.relative_to(out)), str(f.relative_to(out))] for t, f in plan.renames],
        "deletes": [str(p.relative_to(out)) for p in plan.deletes],
    }
    temp = out / (JOURNAL_NAME + ".tmp")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(temp, out / JOURNAL_NAME)
    fsync_dir(out)


def _apply(out: Path, plan: _Plan, step: FaultHook, *, prefix: str) -> None:
    """Carry out a journal's plan; every step may already have been done by a crashed run."""
    folders = set()
    for i, (temp, final) in enumerate(plan.renames):
        if temp.exists():
            os.rename(temp, final)
        elif not final.exists():
            raise RuntimeError(
                f"compaction journal {out / JOURNAL_NAME} names {temp}, which is gone, and {final} does not"
                " exist: the folder was changed by hand; restore the file or remove the journal"
            )
        folders.add(final.parent)
        step(f"{prefix}rename:{i}")
    for folder in folders:
        fsync_dir(folder)
    for i, old in enumerate(plan.deletes):
        old.unlink(missing_ok=True)
        folders.add(old.parent)
        step(f"{prefix}delete:{i}")
    for folder in folders:
        fsync_dir(folder)
        _remove_if_empty(folder)
    (out / JOURNAL_NAME).unlink()
    fsync_dir(out)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        return  # not empty (the usual case), or already gone
    fsync_dir(folder.parent)


def _recover(out: Path, step: FaultHook) -> bool:
    """Finish an interrupted compaction, then delete temp files no journal refers to."""
    journal = out / JOURNAL_NAME
    recovered = False
    if journal.exists():
        try:
            doc = json.loads(journal.read_text(encoding="utf-8"))
            plan = _Plan(
                renames=[(out / t, out / f) for t, f in doc["renames"]],
                deletes=[out / p for p in doc["deletes"]],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"compaction journal {journal} is unreadable: {exc}") from None
        _apply(out, plan, step, prefix="recover:")
        recovered = True
    (out / (JOURNAL_NAME + ".tmp")).unlink(missing_ok=True)
    for dataset in (RESULTS_DIR, COSTS_DIR):
        root = out / dataset
        if root.is_dir():
            for temp in root.glob(f"date=*/{TEMP_PREFIX}*"):
                temp.unlink(missing_ok=True)
    return recovered


class _TempWriter:
    """Writes new part files under temp names and remembers where each is to be published."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.ms = time.time_ns() // 1_000_000
        self.seq = 0
        self.renames: list[tuple[Path, Path]] = []
        self.deletes: list[Path] = []

    def start(self, folder: Path, schema: pa.Schema) -> tuple[Path, pq.ParquetWriter]:
        self.seq += 1
        temp = folder / f"{TEMP_PREFIX}{self.run}-{self.seq:04d}.parquet"
        final = folder / f"part-compacted-{self.ms:013d}-{self.run}-{self.seq:04d}.parquet"
        self.renames.append((temp, final))
        return temp, pq.ParquetWriter(temp, schema, compression=PARQUET_COMPRESSION)

    @staticmethod
    def finish(temp: Path, writer: pq.ParquetWriter) -> None:
        writer.close()
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def plan(self) -> _Plan:
        return _Plan(renames=list(self.renames), deletes=list(self.deletes))


def _read(path: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """A part file's rows in ``schema`` (or just ``columns`` of it)."""
    names = columns or schema.names
    try:
        with pq.ParquetFile(path) as parquet:
            present = set(parquet.schema_arrow.names)
            # A nullable column added to the schema after the file was written reads as nulls.
            absent = [n for n in names if n not in present and schema.field(n).nullable]
            table = parquet.read(columns=[n for n in names if n not in absent])
    except (pa.ArrowException, OSError) as exc:
        raise RuntimeError(f"cannot read {path}: {exc}") from None
    for n in absent:
        table = table.append_column(schema.field(n), pa.nulls(table.num_rows, schema.field(n).type))
    target = pa.schema([schema.field(n) for n in names])
    if not table.schema.equals(target):
        try:
            table = table.select(names).cast(target)
        except (pa.ArrowException, KeyError) as exc:
            raise RuntimeError(f"{path} does not have the expected columns: {exc}") from None
    if "index" in names and (schema is RESULT_SCHEMA or "id" in names):
        table = with_choice_index(table, schema)  # rows from before the column: choice 0
    return table


def _lacks_index(path: Path) -> bool:
    """A part file written before the ``index`` column existed: rewritten with it (choice 0)."""
    try:
        with pq.ParquetFile(path) as parquet:
            return "index" not in parquet.schema_arrow.names
    except (pa.ArrowException, OSError) as exc:
        raise RuntimeError(f"cannot read {path}: {exc}") from None


def _by_partition(files: list[Path]) -> dict[Path, list[Path]]:
    groups: dict[Path, list[Path]] = {}
    for f in files:
        groups.setdefault(f.parent, []).append(f)
    for folder in groups:
        groups[folder].sort(key=lambda p: p.name)
    return groups


def _job_key(column: pa.ChunkedArray) -> pa.ChunkedArray:
    return pc.fill_null(column, _NO_JOB)


def _micros(column: pa.ChunkedArray) -> pa.ChunkedArray:
    return pc.cast(column, pa.int64())


def _arange(n: int) -> pa.Array:
    return pa.array(range(n), type=pa.int64())


# -- results --------------------------------------------------------------------------------


def _plan_results(files: list[Path], writer: _TempWriter, stats: CompactStats) -> pa.Table:
    """Choose the kept result rows, write rewritten partitions; returns the kept rows' keys."""
    empty_keys = pa.table(
        {
            "job_key": pa.array([], pa.string()),
            "id": pa.array([], pa.string()),
            "index": pa.array([], pa.int32()),
            "worker": pa.array([], pa.string()),
            "finished_at": pa.array([], pa.int64()),
        }
    )
    if not files:
        return empty_keys
    # File order for "then part file name": by name, the path only breaking ties.
    order = sorted(range(len(files)), key=lambda i: (files[i].name, str(files[i])))
    rank_of_file = {files[i]: rank for rank, i in enumerate(order)}
    key_tables = []
    rows_in_file: dict[Path, int] = {}
    for path in files:
        t = _read(path, RESULT_SCHEMA, ["job_id", "id", "index", "finish_reason", "finished_at", "worker"])
        rows_in_file[path] = t.num_rows
        key_tables.append(
            pa.table(
                {
                    "job_key": _job_key(t["job_id"]),
                    "id": t["id"],
                    "index": t["index"],
                    "is_error": pc.equal(t["finish_reason"], "error"),
                    "finished_at": _micros(t["finished_at"]),
                    "file": pa.array([rank_of_file[path]] * t.num_rows, pa.int32()),
                    "row": _arange(t.num_rows),
                    "worker": t["worker"],
                }
            )
        )
    keys = pa.concat_tables(key_tables)
    stats.results_before = keys.num_rows
    # Preference order: non-error first, then first written. Each request's choice keeps its best row.
    ranked = keys.sort_by([("is_error", "ascending"), ("finished_at", "ascending"), ("file", "ascending"),
                           ("row", "ascending")])
    ranked = ranked.append_column("rank", _arange(ranked.num_rows))
    best = ranked.group_by(["job_key", "id", "index"], use_threads=False).aggregate([("rank", "min")])
    kept = ranked.take(best["rank_min"])
    stats.results_after = kept.num_rows
    stats.duplicates_removed = stats.results_before - stats.results_after

    # Kept row indices per file, as Arrow arrays (not Python lists: there may be millions).
    per_file = kept.group_by("file", use_threads=False).aggregate([("row", "list")])
    kept_rows: dict[int, pa.Array] = {
        file: per_file["row_list"][i].values for i, file in enumerate(per_file["file"].to_pylist())
    }
    for folder, group in _by_partition(files).items():
        total = sum(rows_in_file[p] for p in group)
        keep = sum(len(kept_rows.get(rank_of_file[p], [])) for p in group)
        if len(group) == 1 and keep == total and not _lacks_index(group[0]):
            continue  # already compact
        writer.deletes.extend(group)
        if keep == 0:
            continue
        temp, out = writer.start(folder, RESULT_SCHEMA)
        try:
            for path in group:
                rows = kept_rows.get(rank_of_file[path])
                if rows is None:
                    continue
                table = _read(path, RESULT_SCHEMA)
                if len(rows) < table.num_rows:
                    table = table.filter(pc.is_in(_arange(table.num_rows), value_set=rows))
                out.write_table(table)
        finally:
            writer.finish(temp, out)
    return kept.select(["job_key", "id", "index", "worker", "finished_at"])


# -- costs ----------------------------------------------------------------------------------


def _plan_costs(files: list[Path], kept: pa.Table, writer: _TempWriter, stats: CompactStats) -> None:
    # A cost row matches its result only if finished_at is equal, so only the kept results of
    # the same partition can match: join each partition with those alone.
    kept_partition = pc.strftime(pc.cast(kept["finished_at"], RESULT_SCHEMA.field("finished_at").type),
                                 format="date=%Y-%m-%d")
    for folder, group in _by_partition(files).items():
        # Rows written before device_share existed billed one whole device: rewritten, they say so.
        tables = [with_device_share(_read(path, COST_SCHEMA)) for path in group]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        before = table.num_rows
        stats.costs_before += before
        table, new_kind, changed, marked = _mark_costs(table, kept.filter(pc.equal(kept_partition, folder.name)))
        stats.identical_cost_rows_removed += before - table.num_rows
        stats.cost_rows_marked_duplicate += marked
        stats.costs_after += table.num_rows
        if len(group) == 1 and table.num_rows == before and not changed and not _lacks_index(group[0]):
            continue
        writer.deletes.extend(group)
        if table.num_rows == 0:
            continue
        table = table.set_column(table.schema.get_field_index("kind"), COST_SCHEMA.field("kind"), new_kind)
        temp, out = writer.start(folder, COST_SCHEMA)
        try:
            out.write_table(table)
        finally:
            writer.finish(temp, out)


def _mark_costs(table: pa.Table, kept: pa.Table) -> tuple[pa.Table, pa.Array, bool, int]:
    """Drop repeated rows and give request/duplicate rows their kind; rows stay in file order.

    Returns the remaining rows, their new ``kind`` column, whether any kind changed, and how
    many rows went from ``request`` to ``duplicate``.
    """
    if table.num_rows == 0:
        return table, pa.array([], pa.string()), False, 0
    billable_kinds = pa.array(["request", "duplicate"])
    # A row written twice is one row. "request" and "duplicate" are the same row at two
    # moments, so they compare equal here.
    kind_class = pc.if_else(pc.is_in(table["kind"], value_set=billable_kinds), "request", table["kind"])
    # Map columns (metadata) cannot be grouping keys; rows equal in the rest are one request's.
    names = [f.name for f in COST_SCHEMA if f.name != "kind" and not pa.types.is_map(f.type)]
    probe = table.select(names).append_column("kind_class", kind_class).append_column("pos", _arange(table.num_rows))
    firsts = probe.group_by(names + ["kind_class"], use_threads=False).aggregate([("pos", "min")])["pos_min"]
    table = table.take(pc.take(firsts, pc.sort_indices(firsts)))

    n = table.num_rows
    billable = pc.is_in(table["kind"], value_set=billable_kinds)
    candidates = pa.table(
        {
            "job_key": _job_key(table["job_id"]),
            "id": table["id"],
            "index": table["index"],
            "worker": table["worker"],
            "finished_at": _micros(table["finished_at"]),
            "pos": _arange(n),
        }
    ).filter(billable)
    matched = candidates.join(kept, keys=["job_key", "id", "index", "worker", "finished_at"], join_type="inner")
    # Several rows can match one kept result only if they differ somewhere (else they were
    # dropped above); the first in file order bills, the rest are duplicates.
    claimed = matched.group_by(["job_key", "id", "index"], use_threads=False).aggregate([("pos", "min")])["pos_min"]
    is_claimed = pc.is_in(_arange(n), value_set=claimed)
    old_kind = table["kind"].combine_chunks()
    new_kind = pc.if_else(billable, pc.if_else(is_claimed, "request", "duplicate"), old_kind)
    if isinstance(new_kind, pa.ChunkedArray):
        new_kind = new_kind.combine_chunks()
    changed = not pc.all(pc.equal(old_kind, new_kind)).as_py()
    went_duplicate = pc.and_(pc.equal(old_kind, "request"), pc.equal(new_kind, "duplicate"))
    marked = pc.sum(pc.cast(went_duplicate, pa.int64())).as_py() or 0
    return table, new_kind, changed, marked
