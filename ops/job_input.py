"""Reading a job's input file in resumable chunks: each chunk ends at a position the next one starts from.

A bulk job validates its input over many short rq tasks, so it must pick up exactly where the
last task stopped without re-reading the file from its start. A JSONL position is a byte offset
(plus the number of lines before it); a Parquet position is a row index, reached through the
row groups' row counts. Items are the same :class:`~mqinfer.schemas.files.InputItem` that
:func:`~mqinfer.schemas.files.iter_input` yields, with the same numbering (1-based, blank JSONL
lines counted but skipped) and the same ``line:<N>`` id for a line whose id cannot be recovered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.files import InputItem, input_format
from mqinfer.schemas.request import decode_request, request_from_obj

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class InputPosition:
    """Where reading resumes: ``offset`` is a byte offset (JSONL) or a row index (Parquet);
    ``line`` is how many lines or rows lie before it."""

    offset: int = 0
    line: int = 0

    def encode(self) -> str:
        return f"{self.offset}:{self.line}"

    @classmethod
    def decode(cls, text: str | None) -> "InputPosition":
        if not text:
            return cls()
        offset, _, line = text.partition(":")
        return cls(int(offset), int(line or 0))


class InputUnusable(ValueError):
    """The input file as a whole cannot be read (missing, unknown format, not Parquet)."""


def read_chunk(path: str | os.PathLike[str], position: InputPosition, max_items: int
               ) -> tuple[list[InputItem], InputPosition, bool]:
    """Up to ``max_items`` items from ``position``; returns (items, next position, end of file)."""
    if max_items < 1:
        raise ValueError(f"max_items must be >= 1, got {max_items}")
    p = Path(path)
    try:
        fmt = input_format(p)
    except ValueError as exc:
        raise InputUnusable(str(exc)) from None
    if not p.is_file():
        raise InputUnusable(f"input file {p} does not exist (or is not a file)")
    if fmt == "jsonl":
        return _jsonl_chunk(p, position, max_items)
    return _parquet_chunk(p, position, max_items)


def _with_line_id(line: int, exc: RequestError) -> RequestError:
    return exc if exc.request_id is not None else exc.with_request_id(f"line:{line}")


def _jsonl_chunk(path: Path, position: InputPosition, max_items: int
                 ) -> tuple[list[InputItem], InputPosition, bool]:
    items: list[InputItem] = []
    line_no = position.line
    with open(path, "rb") as f:
        f.seek(position.offset)
        while len(items) < max_items:
            raw = f.readline()
            if not raw:
                return items, InputPosition(f.tell(), line_no), True
            line_no += 1
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip():
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                error = RequestError(errors.INVALID_JSON, f"line is not valid UTF-8: {exc}")
                items.append(InputItem(line_no, None, _with_line_id(line_no, error)))
                continue
            try:
                items.append(InputItem(line_no, decode_request(raw, fmt="json"), None))
            except RequestError as exc:
                items.append(InputItem(line_no, None, _with_line_id(line_no, exc)))
        end = f.tell()
        at_eof = not f.read(1)
    return items, InputPosition(end, line_no), at_eof


def _parquet_chunk(path: Path, position: InputPosition, max_items: int
                   ) -> tuple[list[InputItem], InputPosition, bool]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # The cleaning of a Parquet row into a request object lives with the file reader.
    from mqinfer.schemas.files import clean_parquet_row

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputUnusable(f"{path}: not a readable Parquet file: {exc}") from None
    items: list[InputItem] = []
    with parquet:
        meta = parquet.metadata
        start, group = 0, 0
        while group < meta.num_row_groups and start + meta.row_group(group).num_rows <= position.offset:
            start += meta.row_group(group).num_rows
            group += 1
        if group >= meta.num_row_groups:
            return items, position, True
        skip = position.offset - start
        row_no = position.offset
        groups = list(range(group, meta.num_row_groups))
        for batch in parquet.iter_batches(batch_size=max(max_items, 1024), row_groups=groups):
            if skip:
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                batch = batch.slice(skip)
                skip = 0
            for row in batch.slice(0, max_items - len(items)).to_pylist():
                row_no += 1
                try:
                    items.append(InputItem(row_no, request_from_obj(clean_parquet_row(row)), None))
                except RequestError as exc:
                    items.append(InputItem(row_no, None, _with_line_id(row_no, exc)))
            if len(items) >= max_items:
                break
        at_eof = row_no >= meta.num_rows
    return items, InputPosition(row_no, row_no), at_eof
