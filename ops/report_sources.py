"""Where a cost report reads its rows: one or several output folders, local or behind any pyarrow
filesystem URI (``s3://bucket/prefix``, ``gs://...``, ``file:///...``).

A source is what a worker's ``--out`` names: its ``costs/`` dataset (``date=YYYY-MM-DD/part-*.parquet``)
is read; temporary files (``.tmp-*``) never are. A report over several sources is the report over
the union of their rows, so a fleet whose workers write to many folders is reported at once. An S3
URI takes pyarrow's options in its query (``?endpoint_override=host:port&scheme=http`` for an
S3-compatible server) and the usual AWS credentials from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from mqinfer.schemas.dataset import COSTS_DIR, part_files
from mqinfer.schemas.dataset_uri import dataset_parts, open_uri
from mqinfer.schemas.rows import COST_SCHEMA


def is_uri(source: str | os.PathLike[str]) -> bool:
    """A filesystem URI (``scheme://...``) rather than a local path."""
    return "://" in str(source)


def as_sources(out_dirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """One source or several, as a list of texts; ValueError when there is none."""
    if isinstance(out_dirs, (str, os.PathLike)):
        out_dirs = [out_dirs]
    sources = [str(s) for s in out_dirs]
    if not sources:
        raise ValueError("no output folder given")
    return sources


def remote_parts(uri: str):
    """(filesystem, part file paths) of the ``costs/`` dataset under ``uri`` (parts a replacement
    superseded left out, :func:`mqinfer.schemas.dataset_uri.visible_parts`)."""
    from pyarrow import fs

    filesystem, base = open_uri(uri)
    root = f"{base.rstrip('/')}/{COSTS_DIR}"
    try:
        info = filesystem.get_file_info(root)
    except (pa.ArrowException, OSError) as exc:
        raise OSError(f"cannot list {uri}: {exc}") from None
    if info.type == fs.FileType.NotFound:
        raise FileNotFoundError(f"no {COSTS_DIR}/ dataset in {uri}")
    return dataset_parts(uri, COSTS_DIR)


def cost_datasets(sources: Sequence[str]) -> list[ds.Dataset]:
    """A dataset (of COST_SCHEMA) per source that has part files; FileNotFoundError for a source
    that is not an output folder with a ``costs/`` dataset."""
    datasets = []
    for source in sources:
        if is_uri(source):
            filesystem, parts = remote_parts(source)
            if parts:
                datasets.append(ds.dataset(parts, format="parquet", schema=COST_SCHEMA, filesystem=filesystem))
            continue
        out = Path(source)
        if not out.is_dir():
            raise FileNotFoundError(f"no such output folder: {out}")
        if not (out / COSTS_DIR).is_dir():
            raise FileNotFoundError(f"no {COSTS_DIR}/ dataset in {out}")
        files = part_files(out / COSTS_DIR)
        if files:
            datasets.append(ds.dataset([str(f) for f in files], format="parquet", schema=COST_SCHEMA))
    return datasets


def read_costs(sources: Sequence[str], condition=None) -> pa.Table:
    """Every cost row of ``sources`` matching ``condition`` (a dataset expression), as one table."""
    tables = [d.to_table(filter=condition) for d in cost_datasets(sources)]
    if not tables:
        return COST_SCHEMA.empty_table()
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


__all__ = ["as_sources", "cost_datasets", "is_uri", "read_costs", "remote_parts"]
