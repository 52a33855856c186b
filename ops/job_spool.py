"""A bulk job's durable spool under its output folder: the validated input index and the collected rows.

``DIR/.mqinfer-job/`` holds:

- ``job.json``: the manifest (job id, input file, when it was created), so that submitting the
  same input into the same folder after a server lost its data resumes the job;
- ``index/part-NNNNNN.parquet``: the validated input in order, one row per request line
  (``line``, ``id``, the request as a ready stream payload or the line's error), written while
  validating so that feeding never parses the input again (removed once the job has ended), and
  the order in which the part's requests are fed when that is not input order;
- ``duplicates.parquet``: lines whose id repeats an earlier line's;
- ``rows/part-NNNNNN-XXXXXXXX.parquet``: result rows collected from the job's result stream.

Every file appears complete or not at all: written under a temporary name, fsynced, renamed,
and its folder fsynced. A crash leaves at most a ``.tmp-`` file, which :meth:`Spool.clean` removes.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from mqinfer.schemas.rows import RESULT_SCHEMA

SPOOL_DIR = ".mqinfer-job"
TEMP_PREFIX = ".tmp-"
COMPRESSION = "zstd"

INDEX_SCHEMA = pa.schema([
    pa.field("line", pa.int64(), nullable=False),
    pa.field("id", pa.string(), nullable=False),
    # The msgpack stream payload (job_id and deadline already set); null for an invalid line.
    pa.field("request", pa.binary()),
    # "completions" / "chat" for OpenAI Batch lines, null for native requests.
    pa.field("api", pa.string()),
    pa.field("error_code", pa.string()),
    pa.field("error", pa.string()),
    # The part's feed order, a permutation of its rows: the k-th value is the row (0-based, within
    # the part) fed k-th. Null in every row when the part is fed in input order. It is written
    # with the part, once, so that a feed cursor (part, position) means the same request on every
    # resume.
    pa.field("feed_order", pa.int32()),
])

DUPLICATES_SCHEMA = pa.schema([
    pa.field("line", pa.int64(), nullable=False),
    pa.field("id", pa.string(), nullable=False),
    pa.field("first_line", pa.int64(), nullable=False),
])


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create ``path`` by ``write(file)`` so that it appears whole or not at all, durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:12]}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_table_atomic(path: Path, table: pa.Table) -> None:
    write_atomic(path, lambda f: pq.write_table(table, f, compression=COMPRESSION))


class Spool:
    """The spool folder of the job whose output folder is ``out``."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.root = self.out / SPOOL_DIR
        self.index_dir = self.root / "index"
        self.rows_dir = self.root / "rows"
        self.manifest_path = self.root / "job.json"
        self.duplicates_path = self.root / "duplicates.parquet"

    # -- manifest ----------------------------------------------------------------------------
    def read_manifest(self) -> dict | None:
        try:
            return json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.manifest_path} is unreadable ({exc}); remove it or choose another --out") from None

    def write_manifest(self, manifest: dict) -> None:
        data = json.dumps(manifest, indent=2, sort_keys=True).encode()
        write_atomic(self.manifest_path, lambda f: f.write(data))

    # -- input index -------------------------------------------------------------------------
    def index_path(self, part: int) -> Path:
        return self.index_dir / f"part-{part:06d}.parquet"

    def write_index_part(self, part: int, columns: dict[str, list], feed_order: Sequence[int] | None = None) -> None:
        """Write index part ``part`` from ``columns`` (every column of INDEX_SCHEMA but
        ``feed_order``); ``feed_order``: the rows in the order to feed them, None for input order."""
        n = len(columns["line"])
        if feed_order is not None and sorted(feed_order) != list(range(n)):
            raise ValueError(f"feed order of index part {part} is not a permutation of its {n} rows")
        order = list(feed_order) if feed_order is not None else [None] * n
        table = pa.Table.from_pydict({**columns, "feed_order": order}, schema=INDEX_SCHEMA)
        write_table_atomic(self.index_path(part), table)

    def read_index_part(self, part: int, columns: Sequence[str] | None = None) -> pa.Table:
        return pq.read_table(self.index_path(part), columns=list(columns) if columns else None)

    def read_feed_order(self, part: int) -> list[int] | None:
        """The rows of index part ``part`` in the order to feed them; None for input order (also
        for a part written before the feed order was kept)."""
        path = self.index_path(part)
        if "feed_order" not in pq.read_schema(path).names:
            return None
        column = pq.read_table(path, columns=["feed_order"])["feed_order"]
        if column.null_count == len(column):
            return None
        return column.to_pylist()

    def read_index(self, parts: int, columns: Sequence[str] | None = None) -> pa.Table:
        tables = [self.read_index_part(k, columns) for k in range(parts)]
        schema = INDEX_SCHEMA if columns is None else pa.schema([INDEX_SCHEMA.field(c) for c in columns])
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def reset_index(self) -> None:
        """Forget a previous validation (its parts are rewritten from the input)."""
        if self.index_dir.is_dir():
            for path in self.index_dir.iterdir():
                path.unlink()
        self.duplicates_path.unlink(missing_ok=True)

    def write_duplicates(self, table: pa.Table) -> None:
        write_table_atomic(self.duplicates_path, table.cast(DUPLICATES_SCHEMA))

    def read_duplicates(self) -> pa.Table:
        if not self.duplicates_path.exists():
            return DUPLICATES_SCHEMA.empty_table()
        return pq.read_table(self.duplicates_path)

    # -- collected rows ----------------------------------------------------------------------
    def new_rows_part_name(self, seq: int) -> str:
        # Unique even when a crashed task's part with the same sequence number is left behind.
        return f"part-{seq:06d}-{uuid.uuid4().hex[:8]}.parquet"

    def write_rows_part(self, name: str, table: pa.Table) -> None:
        write_table_atomic(self.rows_dir / name, table)

    def read_rows(self, names: Sequence[str], columns: Sequence[str] | None = None) -> pa.Table:
        tables = [pq.read_table(self.rows_dir / name, columns=list(columns) if columns else None,
                                schema=RESULT_SCHEMA if columns is None else None) for name in names]
        if tables:
            return pa.concat_tables(tables)
        schema = RESULT_SCHEMA if columns is None else pa.schema([RESULT_SCHEMA.field(c) for c in columns])
        return schema.empty_table()

    def existing_rows_parts(self) -> list[str]:
        if not self.rows_dir.is_dir():
            return []
        return sorted(p.name for p in self.rows_dir.iterdir()
                      if p.name.startswith("part-") and p.name.endswith(".parquet"))

    # -- housekeeping ------------------------------------------------------------------------
    def clean(self) -> int:
        """Remove temporary files a crash left behind; returns how many."""
        removed = 0
        for folder in (self.root, self.index_dir, self.rows_dir, self.out):
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith(TEMP_PREFIX):
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed
