"""The results and costs datasets in object storage: ``--out`` as a pyarrow filesystem URI.

``--out s3://bucket/prefix`` (or ``gs://...``, any URI pyarrow opens; an S3-compatible server takes
``?endpoint_override=host:port&scheme=http`` in the query, credentials come from the environment)
holds the same layout as a local folder: ``results/`` and ``costs/``, partitioned by
``date=YYYY-MM-DD``, one part file per write. A ``file://`` URI is a local folder.

An object store has no rename, so the local temp-write-then-rename becomes its equivalent: a
part file is written complete in memory and made visible by a single upload of the object under
its final, unique name (``part-<worker>-<unix_ms>-<seq>-<random>.parquet``). An object store
shows an object only once its upload completed, so a reader sees a part whole or not at all; a
crash before the upload leaves nothing behind, and there are no temp objects to clean up. Readers
list ``date=*/part-*.parquet`` as for a folder (and skip ``.tmp-*`` names, which these writes never
make).

A part is replaced (rows removed from it: ``mqinfer run --fresh``, or the rows of requests a cost
cap stopped) without a rename too: the new part is uploaded as ``<old name>~<unique>.parquet``,
then the old one is deleted. A part whose name (less ``.parquet``) is the part before a ``~`` of
another part's name is superseded, and readers skip it (:func:`visible_parts`), so a crash between
the two steps shows the new part alone; the next replacement deletes what was left.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mqinfer.schemas import faults
from mqinfer.schemas.dataset import PARQUET_COMPRESSION, PART_PREFIX, DatasetWriter, partition_for, safe_name
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, rows_to_table


def is_remote(out: str | os.PathLike[str]) -> bool:
    """``out`` names object storage (a URI other than ``file://``) rather than a local folder."""
    text = str(out)
    return "://" in text and not text.startswith("file://")


def local_path(out: str | os.PathLike[str]) -> Path:
    """A local folder given as a path or a ``file://`` URI."""
    text = str(out)
    return Path(unquote(urlsplit(text).path)) if text.startswith("file://") else Path(text)


def out_location(out: str | os.PathLike[str]) -> str | Path:
    """``--out`` as a writer takes it: the URI text for object storage, else a local path."""
    return str(out) if is_remote(out) else local_path(out)


_SECRET_PARAM = re.compile(r"(key|secret|token|password|credential)", re.IGNORECASE)


def shown(out: str | Path) -> str:
    """``out`` as it may be printed or logged: a URI without the credentials it may carry (a
    ``user:password@`` part, query options that name a key, secret, token or password)."""
    text = str(out)
    if "://" not in text:
        return text
    parts = urlsplit(text)
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(item if not _SECRET_PARAM.search(item.partition("=")[0]) else f"{item.partition('=')[0]}=***"
                     for item in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def join(base: str | Path, *names: str) -> str | Path:
    """``base`` / ``names``: a path under a folder, or a key under a URI (its query kept at the end)."""
    if isinstance(base, Path):
        return base.joinpath(*names)
    head, sep, query = base.partition("?")
    return head.rstrip("/") + "".join(f"/{n}" for n in names) + (sep + query)


def open_uri(uri: str):
    """(pyarrow filesystem, path within it) of ``uri``; ValueError naming the URI when pyarrow
    cannot open it (an unknown scheme, a malformed query)."""
    from pyarrow import fs

    try:
        return fs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as exc:
        raise ValueError(f"cannot open {shown(uri)}: {exc}") from None


def check_writable(uri: str) -> None:
    """Open ``uri`` and make sure its bucket (or top folder) exists, so that a worker given a
    wrong ``--out`` stops at start-up with the reason instead of failing its first flush."""
    from pyarrow import fs

    filesystem, base = open_uri(uri)
    top = base.strip("/").split("/", 1)[0]
    try:
        info = filesystem.get_file_info(top)
    except (pa.ArrowException, OSError) as exc:
        raise OSError(f"cannot reach {shown(uri)}: {exc}") from None
    if info.type == fs.FileType.NotFound:
        raise FileNotFoundError(f"--out {shown(uri)}: no bucket or folder {top!r}")


def put_object(uri: str, data: bytes) -> None:
    """Write ``data`` as the object ``uri`` in one upload: visible whole once it completes."""
    filesystem, path = open_uri(uri)
    with filesystem.open_output_stream(path) as stream:
        stream.write(data)


SUPERSEDES = "~"  # never in a worker's part name (safe_name keeps letters, digits, '.', '_', '-')


def visible_parts(paths: list[str]) -> list[str]:
    """The part paths a reader takes: every one not superseded by a replacement (sorted)."""
    superseded = set()
    for path in paths:
        stem = path[:-len(".parquet")]
        head, sep, _ = stem.rpartition(SUPERSEDES)
        while sep:
            superseded.add(head)
            head, sep, _ = head.rpartition(SUPERSEDES)
    return sorted(p for p in paths if p[:-len(".parquet")] not in superseded)


def _all_parts(filesystem, root: str) -> list[str]:
    from pyarrow import fs

    try:
        found = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    except (pa.ArrowException, OSError) as exc:
        raise OSError(f"cannot list {root}: {exc}") from None
    return [f.path for f in found if f.type == fs.FileType.File and f.base_name.startswith(PART_PREFIX)
            and f.base_name.endswith(".parquet") and f.path.rsplit("/", 2)[-2].startswith("date=")]


def dataset_parts(uri: str, name: str):
    """(filesystem, visible part paths) of the dataset ``name`` (``results``, ``costs``) of the
    output ``uri`` in object storage."""
    filesystem, base = open_uri(uri)
    return filesystem, visible_parts(_all_parts(filesystem, f"{base.rstrip('/')}/{name}"))


def read_remote(uri: str, name: str, schema: pa.Schema, *, filter=None, columns=None) -> pa.Table:
    """The rows of the dataset ``name`` of the output ``uri`` in object storage (``schema``)."""
    import pyarrow.dataset as ds

    filesystem, parts = dataset_parts(uri, name)
    if not parts:
        table = schema.empty_table()
        return table.select(columns) if columns else table
    return ds.dataset(parts, format="parquet", schema=schema, filesystem=filesystem).to_table(
        filter=filter, columns=columns)


def job_table(out: str | Path, name: str, job_id: str, columns: list[str], kind: str | None = None):
    """The ``columns`` of the rows of ``job_id`` (of cost ``kind``) in the dataset ``name`` of the
    output ``out`` (a folder, or a URI from :func:`out_location`); None when the dataset has no part."""
    import pyarrow.dataset as ds

    where = ds.field("job_id") == job_id
    if kind is not None:
        where = where & (ds.field("kind") == kind)
    if not isinstance(out, Path):
        filesystem, parts = dataset_parts(out, name)
        if not parts:
            return None
        schema = COST_SCHEMA if name == "costs" else RESULT_SCHEMA
        return ds.dataset(parts, format="parquet", schema=schema, filesystem=filesystem).to_table(
            filter=where, columns=columns)
    root = out / name
    if not root.is_dir():
        return None
    dataset = ds.dataset(root, format="parquet", partitioning="hive")
    if not dataset.files:
        return None
    return dataset.to_table(filter=where, columns=columns)


def rewrite_remote(uri: str, name: str, schema: pa.Schema, drop) -> int:
    """Remove from the dataset ``name`` of the output ``uri`` the rows ``drop(table)`` (a boolean
    mask) marks, replacing each part that has some; returns how many rows were removed."""
    filesystem, base = open_uri(uri)
    everything = _all_parts(filesystem, f"{base.rstrip('/')}/{name}")
    shown = visible_parts(everything)
    for leftover in sorted(set(everything) - set(shown)):  # a replacement cut short: finish it
        filesystem.delete_file(leftover)
    removed = 0
    for path in shown:
        table = pq.read_table(path, filesystem=filesystem, schema=schema)
        mask = drop(table)
        count = int(pc.sum(mask).as_py() or 0)
        if not count:
            continue
        rest = table.filter(pc.invert(mask))
        buffer = pa.BufferOutputStream()
        pq.write_table(rest, buffer, compression=PARQUET_COMPRESSION)
        replacement = f"{path[:-len('.parquet')]}{SUPERSEDES}{time.time_ns() // 1_000_000:013d}{uuid.uuid4().hex[:6]}.parquet"
        with filesystem.open_output_stream(replacement) as stream:
            stream.write(buffer.getvalue())
        filesystem.delete_file(path)
        if not rest.num_rows:
            filesystem.delete_file(replacement)
        removed += count
    return removed


class ObjectDatasetWriter:
    """Writes rows of one dataset (``schema``) under the URI ``root`` as part objects, each made
    visible by one upload under a unique final name. The interface of
    :class:`mqinfer.schemas.dataset.DatasetWriter`; the fault point ``sink.<dataset>.before_rename``
    is reached just before the upload (the moment that publishes the part)."""

    def __init__(self, root: str, schema: pa.Schema, worker: str) -> None:
        self.root = root
        self.schema = schema
        self.worker = worker
        self._filesystem, self._base = open_uri(root)
        self._base = self._base.rstrip("/")
        self._name = safe_name(worker)
        self._fault_point = f"sink.{self._base.rsplit('/', 1)[-1]}.before_rename"
        self._last_ms = 0
        self._seq = 0

    def write(self, rows) -> list[str]:
        """Write ``rows`` (of this dataset), one part object per partition; returns their paths."""
        groups: dict[str, list] = {}
        for row in rows:
            groups.setdefault(partition_for(row.finished_at), []).append(row)
        return [self.write_table(partition, rows_to_table(group, self.schema)) for partition, group in groups.items()]

    def write_table(self, partition: str, table: pa.Table) -> str:
        """Publish ``table`` (in this dataset's schema) as one part object of ``partition``;
        returns its path within the filesystem."""
        if not table.schema.equals(self.schema):
            raise ValueError(f"table schema does not match the {self._base.rsplit('/', 1)[-1]} dataset's schema")
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression=PARQUET_COMPRESSION)
        data = buffer.getvalue()
        faults.hit(self._fault_point)
        path = f"{self._base}/{partition}/{self._next_name()}"
        with self._filesystem.open_output_stream(path) as stream:
            stream.write(data)
        return path

    def _next_name(self) -> str:
        # As a local writer's names, sorted by write time for one worker; the random part keeps
        # two writers that share a worker name from replacing each other's objects.
        now_ms = time.time_ns() // 1_000_000
        if now_ms > self._last_ms:
            self._last_ms, self._seq = now_ms, 0
        else:
            self._seq += 1
        return f"{PART_PREFIX}{self._name}-{self._last_ms:013d}-{self._seq:06d}-{uuid.uuid4().hex[:8]}.parquet"


def dataset_writer(out: str | Path, name: str, schema: pa.Schema, worker: str):
    """A writer of the dataset ``name`` under ``out``: a local folder's or object storage's."""
    if isinstance(out, Path):
        return DatasetWriter(out / name, schema, worker)
    return ObjectDatasetWriter(str(join(out, name)), schema, worker)


__all__ = ["ObjectDatasetWriter", "check_writable", "dataset_parts", "dataset_writer", "is_remote", "job_table", "join",
           "local_path", "open_uri", "out_location", "put_object", "read_remote", "rewrite_remote", "shown", "visible_parts"]
