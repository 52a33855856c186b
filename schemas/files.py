"""Input files: JSON Lines and Parquet, read as a stream of validated requests or per-line errors.

Every non-blank JSONL line and every Parquet row becomes one :class:`InputItem` (1-based
``line``); a bad one carries a RequestError instead of a Request, with ``request_id``
``line:<N>`` when no usable id could be recovered. Files are read incrementally (line by line,
Parquet batch by batch), so their size is not bounded by memory.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request, decode_request, request_from_obj, usable_id

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 1024

# Integer fields of a Request. A Parquet column of them may have been written as float (pandas
# turns an int column with missing values into float64), so integral floats are taken as ints.
_INT_FIELDS = frozenset({"max_tokens", "min_tokens", "top_k", "seed", "logprobs", "priority", "n"})
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class InputItem:
    """One input line (or Parquet row): exactly one of ``request`` / ``error`` is set."""

    line: int
    request: Request | None
    error: RequestError | None


def input_format(path: str | os.PathLike[str]) -> Literal["jsonl", "parquet"]:
    """The format of an input file, from its extension; ValueError for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    known = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise ValueError(f"{path}: unknown input format {suffix or '(no extension)'!r}; expected one of {known}")


def iter_input(path: str | os.PathLike[str]) -> Iterator[InputItem]:
    """Yield one InputItem per request in a JSONL or Parquet file, in file order.

    The file is opened here, so a missing or unreadable file fails at the call, not at the
    first item.
    """
    fmt = input_format(path)
    if fmt == "jsonl":
        return _iter_jsonl(open(path, "rb"))
    return _iter_parquet(_open_parquet(Path(path)))


def _item(line: int, request: Request | None = None, error: RequestError | None = None) -> InputItem:
    if error is not None and error.request_id is None:
        error = error.with_request_id(f"line:{line}")
    return InputItem(line, request, error)


def _iter_jsonl(f: BinaryIO) -> Iterator[InputItem]:
    with f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if not raw.strip():
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _item(line_no, error=RequestError(errors.INVALID_JSON, f"line is not valid UTF-8: {exc}"))
                continue
            try:
                yield _item(line_no, request=decode_request(raw, fmt="json"))
            except RequestError as exc:
                yield _item(line_no, error=exc)


def _open_parquet(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file: {exc}") from None


def _iter_parquet(parquet: Any) -> Iterator[InputItem]:
    with parquet:
        row_no = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch_rows(batch):
                row_no += 1
                if isinstance(row, RequestError):
                    yield _item(row_no, error=row)
                    continue
                try:
                    yield _item(row_no, request=request_from_obj(clean_parquet_row(row)))
                except RequestError as exc:
                    yield _item(row_no, error=exc)


def batch_rows(batch: Any) -> list[dict[str, Any] | RequestError]:
    """A Parquet batch as Python rows; a row Python cannot hold (a timestamp past year 9999, say)
    becomes a RequestError naming the column, instead of failing the whole file."""
    import pyarrow as pa

    unreadable = (OverflowError, ValueError, pa.ArrowException)
    try:
        return batch.to_pylist()
    except unreadable:
        pass
    rows: list[dict[str, Any] | RequestError] = []
    for i in range(batch.num_rows):
        try:
            rows.append(batch.slice(i, 1).to_pylist()[0])
            continue
        except unreadable:
            pass
        bad = []
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                column[i].as_py()
            except unreadable as exc:
                bad.append((name, exc))
        request_id = None
        if "id" in batch.schema.names:
            try:
                request_id = usable_id(batch.column("id")[i].as_py())
            except unreadable:
                pass
        what = "; ".join(f"{name}: {exc}" for name, exc in bad) or "cannot be read"
        where = f" - at `$.{bad[0][0]}`" if bad else ""
        rows.append(RequestError(errors.INVALID_REQUEST, f"value cannot be read: {what}{where}", request_id))
    return rows


def clean_parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row (from ``to_pylist``) as the object a JSON line would have been."""
    clean = {}
    for key, value in row.items():
        if value is None:
            continue  # a null column is an absent field
        if key == "metadata" and isinstance(value, list):
            # Arrow maps come back as lists of (key, value) pairs.
            if all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
                value = dict(value)
        elif key in _INT_FIELDS and isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        elif key == "response_format":
            value = _parquet_response_format(value)
        elif key == "logit_bias":
            value = _parquet_logit_bias(value)
        elif key == "deadline" and isinstance(value, dt.datetime):
            value = value.timestamp() if value.tzinfo else value.replace(tzinfo=dt.timezone.utc).timestamp()
        clean[key] = value
    return clean


def _parquet_response_format(value: Any) -> Any:
    """A response_format column: JSON text (the natural column type for a schema) is parsed; a
    struct, whose shape Arrow unifies across rows, loses the null fields other rows' types added.
    Anything else is left to the request's validation, which names the field."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
        if isinstance(value.get("json_schema"), dict):
            value["json_schema"] = {k: v for k, v in value["json_schema"].items() if v is not None}
    return value


def _parquet_logit_bias(value: Any) -> Any:
    """A logit_bias column: a map (token id -> bias; Arrow gives it as (key, value) pairs) or JSON
    text (``{"50256": -100}``). Anything else is left to the request's validation."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, list) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        return dict(value)
    return value

