"""The results and costs datasets on disk: their layout and the atomic part-file write.

``DIR/results/`` and ``DIR/costs/`` are hive-partitioned by ``date=YYYY-MM-DD`` (the UTC date of
``finished_at``). A part file appears only complete: it is written under a temporary name
(``.tmp-<uuid>.parquet``, which readers skip), fsynced, renamed to
``part-<worker>-<unix_ms>-<seq>.parquet`` and its folder fsynced. A crash leaves at most a temp
file behind, which :func:`remove_temp_files` deletes. While a temp file is being written its
writer holds an exclusive ``flock`` on it, so that cleaning up at one worker's start never
deletes a file another live worker is still writing.

Workers write these files (``workers/queue/sink.py`` buffers rows for them); compaction and reports
read and rewrite them.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mqinfer.schemas import faults
from mqinfer.schemas.rows import rows_to_table, to_micros

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
    ``sink.<dataset folder>.before_rename`` (:mod:`mqinfer.schemas.faults`) is reached there too.
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


def part_files(dataset_root: str | os.PathLike[str]) -> list[Path]:
    """The published part files of a dataset (temp files excluded), sorted by path."""
    root = Path(dataset_root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"date=*/{PART_PREFIX}*.parquet") if p.is_file())
