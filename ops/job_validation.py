"""Validating a bulk job's input into the spool index, one chunk of lines at a time.

Each chunk of input lines (``job_input.read_chunk``) becomes one index part (:func:`index_chunk`):
per line its id, the request re-encoded with the job's id and deadline, or the line's error; and,
with ``order`` prefix, the order in which the part's requests are fed (prefix-tree order under the
job's ``prefix_cache_scope``, so requests that share a prompt prefix reach the workers together).
A request with ``n`` > 1 choices is an error row in a bulk job (:func:`refuse_choices`). Once the
whole input is indexed, :func:`repeated_ids` finds the lines whose id came earlier.

Pure functions over the parsed items and Arrow tables; :class:`mqinfer.ops.job_run.JobRun` writes
what they return to the spool and the job's hash.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from mqinfer.schemas import errors
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.prefix_order import prefix_key
from mqinfer.schemas.request import encode_request

MAX_REPORTED_ERRORS = 10     # invalid lines listed in the job (all are in the output)


@dataclass
class IndexChunk:
    """One index part: its columns, its feed order (None: input order), and what the job's hash
    counts of it."""

    columns: dict[str, list]
    feed_order: list[int] | None
    invalid: int = 0
    # The invalid lines, each as the job lists it (line, id, code, message).
    errors: list[dict] = field(default_factory=list)
    # The formats of its valid lines ("native", "openai").
    formats: set[str] = field(default_factory=set)


def refuse_choices(item):
    """A bulk job's output keeps one row per request: a request with ``n`` > 1 choices is an error
    row naming the parameter, not a row whose other choices would be dropped."""
    req = item.request
    if req is None or (getattr(req, "n", 1) or 1) <= 1:
        return item
    error = RequestError(errors.UNSUPPORTED_PARAMETER,
                         f"n = {req.n} is not supported in bulk jobs (`mqinfer jobs`): their output keeps one row "
                         "per request; use `mqinfer run` or the stream for several choices - at `$.n`", req.id)
    return dataclasses.replace(item, request=None, error=error)


def index_chunk(items, job_id: str, job_deadline: float | None, order: str, prefix_cache_scope: str) -> IndexChunk:
    """The index part of ``items`` (parsed input lines): every valid request given the job's id and
    the earlier of its own deadline and the job's; with ``order`` prefix, the feed order."""
    columns: dict[str, list] = {"line": [], "id": [], "request": [], "api": [], "error_code": [], "error": []}
    chunk = IndexChunk(columns, None)
    sort_keys: list[tuple] = []  # (prefix key, row) of each valid request, for the feed order
    for row, item in enumerate(items):
        columns["line"].append(item.line)
        if item.request is None:
            chunk.invalid += 1
            err = item.error
            columns["id"].append(err.request_id or f"line:{item.line}")
            columns["request"].append(None)
            columns["api"].append(None)
            columns["error_code"].append(err.code)
            columns["error"].append(err.message)
            chunk.errors.append({"line": item.line, "id": err.request_id, "code": err.code,
                                 "message": err.message[:500]})
            continue
        req = item.request
        chunk.formats.add("openai" if req.api is not None else "native")
        deadline = req.deadline
        if job_deadline is not None:
            deadline = job_deadline if deadline is None else min(deadline, job_deadline)
        req = msgspec.structs.replace(req, job_id=job_id, deadline=deadline)
        if order == "prefix":
            sort_keys.append((prefix_key(req, prefix_cache_scope), row))
        columns["id"].append(req.id)
        columns["request"].append(encode_request(req, "msgpack"))
        columns["api"].append(req.api)
        columns["error_code"].append(None)
        columns["error"].append(None)
    if order == "prefix":
        # Stable: requests with the same prompt keep their input order. Invalid lines, never
        # fed, go last.
        sort_keys.sort(key=lambda pair: pair[0])
        valid = {row for _, row in sort_keys}
        chunk.feed_order = [row for _, row in sort_keys] + [row for row in range(len(items)) if row not in valid]
    return chunk


def repeated_ids(index: pa.Table) -> pa.Table:
    """(line, id, first_line) of every valid line whose id an earlier valid line has, by line;
    ``index``: the whole index's ``line``, ``id`` and ``error_code`` columns."""
    valid = index.filter(pc.is_null(index["error_code"])).select(["line", "id"])
    firsts = valid.group_by("id").aggregate([("line", "min"), ("line", "count")])
    repeated = firsts.filter(pc.greater(firsts["line_count"], 1))
    if not repeated.num_rows:
        return pa.table({"line": pa.array([], pa.int64()), "id": pa.array([], pa.string()),
                         "first_line": pa.array([], pa.int64())})
    joined = valid.join(repeated.select(["id", "line_min"]), "id", join_type="inner")
    later = joined.filter(pc.not_equal(joined["line"], joined["line_min"])).sort_by("line")
    return pa.table({"line": later["line"], "id": later["id"], "first_line": later["line_min"]})
