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
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from mqinfer.schemas import faults
from mqinfer.schemas.dataset import PARQUET_COMPRESSION, PART_PREFIX, safe_name


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
        raise ValueError(f"cannot open {uri}: {exc}") from None


def check_writable(uri: str) -> None:
    """Open ``uri`` and make sure its bucket (or top folder) exists, so that a worker given a
    wrong ``--out`` stops at start-up with the reason instead of failing its first flush."""
    from pyarrow import fs

    filesystem, base = open_uri(uri)
    top = base.strip("/").split("/", 1)[0]
    try:
        info = filesystem.get_file_info(top)
    except (pa.ArrowException, OSError) as exc:
        raise OSError(f"cannot reach {uri}: {exc}") from None
    if info.type == fs.FileType.NotFound:
        raise FileNotFoundError(f"--out {uri}: no bucket or folder {top!r}")


def put_object(uri: str, data: bytes) -> None:
    """Write ``data`` as the object ``uri`` in one upload: visible whole once it completes."""
    filesystem, path = open_uri(uri)
    with filesystem.open_output_stream(path) as stream:
        stream.write(data)


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


__all__ = ["ObjectDatasetWriter", "check_writable", "is_remote", "join", "local_path", "open_uri", "out_location",
           "put_object"]
