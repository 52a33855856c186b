"""Durable Parquet sinks for result and cost rows: the last step before a worker acks.

``DIR/results/`` and ``DIR/costs/`` are hive-partitioned by ``date=YYYY-MM-DD`` (the UTC date of
``finished_at``). A part file appears only complete: it is written under a temporary name
(``.tmp-<uuid>.parquet``, which readers skip), fsynced, renamed to
``part-<worker>-<unix_ms>-<seq>.parquet`` and its folder fsynced. A crash leaves at most a temp
file behind, which :func:`remove_temp_files` deletes. While a temp file is being written its
writer holds an exclusive ``flock`` on it, so that cleaning up at one worker's start never
deletes a file another live worker is still writing.

:class:`Sinks` buffers rows and writes costs before results, so a crash in between leaves an
orphan cost row (compaction marks it ``duplicate``) rather than a result nobody paid for.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mqinfer import faults
from mqinfer.schemas.rows import (
    COST_SCHEMA,
    RESULT_SCHEMA,
    CostRow,
    ResultRow,
    check_row,
    rows_to_table,
    to_micros,
)

RESULTS_DIR = "results"
COSTS_DIR = "costs"
PART_PREFIX = "part-"
TEMP_PREFIX = ".tmp-"
PARQUET_COMPRESSION = "zstd"

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def partition_for(finished_at: float) -> str:
    """The partition folder name of a row finished at ``finished_at`` (unix seconds)."""
    # From the stored microseconds, so that a row a hair before midnight cannot land in a
    # folder whose date differs from its rounded timestamp's.
    day = (_EPOCH + dt.timedelta(microseconds=to_micros(finished_at))).date()
    return f"date={day.isoformat()}"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of a folder (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents, fsyncing each parent that gained an entry."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue  # another writer made it first; its fsync covers the entry
        fsync_dir(folder.parent)


def safe_name(worker: str) -> str:
    """``worker`` as a file-name component (no separators, no leading dot)."""
    name = _UNSAFE_NAME_CHARS.sub("_", worker).lstrip(".")[:100]
    return name or "worker"


def _lock_new_file(path: Path) -> Any | None:
    """Create ``path`` exclusively and lock it; None if a cleaner removed it before the lock held."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    f = os.fdopen(fd, "wb")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:
            f.close()
            return None
    except BlockingIOError:
        # A cleaner holds the lock: it is about to delete this file. Start over with a new name.
        f.close()
        return None
    except BaseException:
        f.close()
        raise
    return f


class DatasetWriter:
    """Writes rows of one dataset (``schema``) under ``root`` as atomically published part files.

    ``before_rename`` is a fault-injection hook for tests: it is called with the temp file's path
    after the data is fsynced and before the rename that publishes it. The named fault point
    ``sink.<dataset folder>.before_rename`` (:mod:`mqinfer.faults`) is reached there too.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        schema: pa.Schema,
        worker: str,
        *,
        before_rename: Callable[[Path], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.schema = schema
        self.worker = worker
        self._name = safe_name(worker)
        self._before_rename = before_rename
        self._fault_point = f"sink.{self.root.name}.before_rename"
        self._last_ms = 0
        self._seq = 0

    def write(self, rows: Sequence[Any]) -> list[Path]:
        """Write ``rows`` durably, one part file per partition; returns the part files' paths."""
        groups: dict[str, list[Any]] = {}
        for row in rows:
            groups.setdefault(partition_for(row.finished_at), []).append(row)
        return [self.write_table(partition, rows_to_table(group, self.schema)) for partition, group in groups.items()]

    def write_table(self, partition: str, table: pa.Table) -> Path:
        """Publish ``table`` (already in this dataset's schema) as one part file of ``partition``."""
        if not table.schema.equals(self.schema):
            raise ValueError(f"table schema does not match the {self.root.name} dataset's schema")
        folder = self.root / partition
        make_dirs(folder)
        while True:
            temp = folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}.parquet"
            f = _lock_new_file(temp)
            if f is not None:
                break
        try:
            pq.write_table(table, f, compression=PARQUET_COMPRESSION)
            f.flush()
            os.fsync(f.fileno())
            if self._before_rename is not None:
                self._before_rename(temp)
            faults.hit(self._fault_point)
            final = folder / self._next_name()
            while final.exists():  # only if two writers share a worker name
                final = folder / self._next_name()
            os.rename(temp, final)
            fsync_dir(folder)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        finally:
            f.close()
        return final

    def _next_name(self) -> str:
        # Names sort by write time for one worker: the millisecond never goes back within a
        # writer (even if the wall clock does) and the sequence breaks ties within one.
        now_ms = time.time_ns() // 1_000_000
        if now_ms > self._last_ms:
            self._last_ms, self._seq = now_ms, 0
        else:
            self._seq += 1
        return f"{PART_PREFIX}{self._name}-{self._last_ms:013d}-{self._seq:06d}.parquet"


def remove_temp_files(root: str | os.PathLike[str]) -> int:
    """Delete temp part files left under ``root`` by crashed writers; returns how many.

    A temp file whose writer is alive is locked and left alone, so this is safe to call while
    other workers write to the same folder.
    """
    removed = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(folder, name)
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                continue  # published or removed meanwhile
            with f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer holds it
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                removed += 1
        # Removals need not be durable: a temp file that comes back after a crash is removed again.
    return removed


class Sinks:
    """The result and cost datasets of one worker, with buffering and a flush policy.

    Rows get cheap checks when added (:func:`check_row`), so a malformed row fails at its
    source instead of failing every later flush. ``pending`` counts buffered rows of both
    datasets; ``should_flush`` says when ``flush_rows`` of them are buffered or the oldest has
    waited ``flush_interval_s``. Safe to use from several threads.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        worker: str,
        *,
        flush_rows: int = 256,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        before_rename: Callable[[Path], None] | None = None,
    ) -> None:
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be at least 1, got {flush_rows}")
        if not flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.out_dir = Path(out_dir)
        self.worker = worker
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self.results = DatasetWriter(self.out_dir / RESULTS_DIR, RESULT_SCHEMA, worker, before_rename=before_rename)
        self.costs = DatasetWriter(self.out_dir / COSTS_DIR, COST_SCHEMA, worker, before_rename=before_rename)
        # (partition, row) in arrival order.
        self._results: list[tuple[str, ResultRow]] = []
        self._costs: list[tuple[str, CostRow]] = []
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def add(self, result: ResultRow, cost: CostRow | None = None) -> None:
        """Buffer a request's result row and its cost row."""
        check_row(result, RESULT_SCHEMA)
        result_item = (partition_for(result.finished_at), result)
        cost_item = None
        if cost is not None:
            check_row(cost, COST_SCHEMA)
            cost_item = (partition_for(cost.finished_at), cost)
        with self._lock:
            self._results.append(result_item)
            if cost_item is not None:
                self._costs.append(cost_item)
            self._touch()

    def add_cost(self, cost: CostRow) -> None:
        """Buffer a cost row that has no result row (``idle``, ``startup``)."""
        check_row(cost, COST_SCHEMA)
        item = (partition_for(cost.finished_at), cost)
        with self._lock:
            self._costs.append(item)
            self._touch()

    def _touch(self) -> None:
        if self._oldest is None:
            self._oldest = self.clock()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._results) + len(self._costs)

    def should_flush(self) -> bool:
        with self._lock:
            if not self._results and not self._costs:
                return False
            if len(self._results) + len(self._costs) >= self.flush_rows:
                return True
            return self._oldest is not None and self.clock() - self._oldest >= self.flush_interval_s

    def flush(self) -> int:
        """Write every buffered row durably, costs first; returns the number of rows written.

        On failure the exception propagates and the rows not yet written stay buffered (rows of
        partitions already published are not written twice).
        """
        with self._flush_lock:
            with self._lock:
                costs, results, oldest = self._costs, self._results, self._oldest
                self._costs, self._results, self._oldest = [], [], None
            written = 0
            try:
                written += _write_items(self.costs, costs)
                written += _write_items(self.results, results)
            except BaseException:
                with self._lock:
                    self._costs = costs + self._costs
                    self._results = results + self._results
                    times = [t for t in (oldest, self._oldest) if t is not None]
                    self._oldest = min(times) if times else None
                raise
            return written


def _write_items(writer: DatasetWriter, items: list[tuple[str, Any]]) -> int:
    """Publish ``items`` one partition at a time, removing each published group from ``items``."""
    written = 0
    while items:
        partition = items[0][0]
        group = [row for p, row in items if p == partition]
        writer.write_table(partition, rows_to_table(group, writer.schema))
        items[:] = [item for item in items if item[0] != partition]
        written += len(group)
    return written


def part_files(dataset_root: str | os.PathLike[str]) -> list[Path]:
    """The published part files of a dataset (temp files excluded), sorted by path."""
    root = Path(dataset_root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"date=*/{PART_PREFIX}*.parquet") if p.is_file())
