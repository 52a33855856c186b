"""A bulk job's final output: one row per input line, in input order, and the OpenAI Batch files.

``DIR/output.parquet`` has the results schema (:data:`~mqinfer.schemas.rows.RESULT_SCHEMA`), one
row per non-blank input line in input order: the collected row of each request (when a request
has several, as after a crash, a non-error one if any, else the first collected), an error row
for each invalid line (id from the line, else ``line:<N>``) and for each line repeating an
earlier line's id, and for requests that never got a row a ``cancelled`` or ``expired`` row (the
job ended so) or an error row with code ``lost``.

When the input holds OpenAI Batch lines, ``DIR/output.jsonl`` (finished requests) and
``DIR/errors.jsonl`` (errors, cancelled and expired ones) follow the OpenAI Batch output format,
matched to the input by ``custom_id``; ``custom_id`` is null for a line that had none usable. They
cover the OpenAI lines and the invalid lines (which may have meant to be OpenAI lines); native
requests mixed into such an input are only in ``output.parquet``.
Token-level logprobs name tokens by id (``"token": "<id>"``): the job has no tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import IO

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from mqinfer.ops.job_spool import Spool, write_atomic, write_table_atomic
from mqinfer.schemas import errors
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow, error_result_row, rows_to_table

JOBS_WORKER = "mqinfer-jobs"
OUTPUT_PARQUET = "output.parquet"
OUTPUT_JSONL = "output.jsonl"
ERRORS_JSONL = "errors.jsonl"
_ORDER_STRIDE = 1 << 40  # error rows sort after every non-error row of the same id
# The `api` of a line that is no request at all: it belongs in errors.jsonl, whatever it meant to be.
_INVALID_LINE = "invalid"

_REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
_OPENAI_ERRORS = {
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
    "expired": ("batch_expired", "This request could not be executed before the batch's deadline."),
}


@dataclass(frozen=True)
class OutputSummary:
    rows: int
    completed: int
    failed: int
    cancelled: int
    expired: int
    prompt_tokens: int
    output_tokens: int
    openai: bool
    # Failed rows (in ``failed``) of requests a cost cap or budget stopped before they ran.
    budget_exceeded: int = 0


def compose_output(spool: Spool, *, job_id: str, index_parts: int, row_parts: list[str], ending: str,
                   openai: bool, now: float) -> OutputSummary:
    """Write the output files of a job that ends as ``ending`` (completed, cancelled, expired)."""
    index = spool.read_index(index_parts, ["line", "id", "request", "api", "error_code", "error"])
    duplicates = spool.read_duplicates()
    kept = _kept_rows(spool.read_rows(row_parts))

    dup_lines = duplicates["line"]
    is_invalid = pc.is_valid(index["error_code"])
    is_dup = pc.is_in(index["line"], value_set=dup_lines)
    valid = index.filter(pc.and_(pc.invert(is_invalid), pc.invert(is_dup)))
    where = pc.index_in(valid["id"], value_set=kept["id"])
    found = pc.is_valid(where)

    present = valid.filter(found)
    parts = [_with_line(kept.take(pc.drop_null(where)), present["line"], present["api"])]

    synthesized: list[ResultRow] = []
    synth_lines: list[int] = []
    synth_api: list[str | None] = []
    missing = valid.filter(pc.invert(found))
    for line, payload, api in zip(missing["line"].to_pylist(), missing["request"].to_pylist(),
                                  missing["api"].to_pylist()):
        synthesized.append(_unfinished_row(_REQUEST_DECODER.decode(payload), job_id, ending, now))
        synth_lines.append(line)
        synth_api.append(api)
    invalid = index.filter(is_invalid)
    for line, rid, code, message in zip(invalid["line"].to_pylist(), invalid["id"].to_pylist(),
                                        invalid["error_code"].to_pylist(), invalid["error"].to_pylist()):
        synthesized.append(_error_row(rid, job_id, code, f"line {line}: {message}", now))
        synth_lines.append(line)
        synth_api.append(_INVALID_LINE)
    dup_index = index.filter(is_dup)
    dup_api = dict(zip(dup_index["line"].to_pylist(), dup_index["api"].to_pylist()))
    for line, rid, first in zip(dup_lines.to_pylist(), duplicates["id"].to_pylist(),
                                duplicates["first_line"].to_pylist()):
        synthesized.append(_error_row(
            rid, job_id, errors.INVALID_REQUEST,
            f"line {line}: id {rid!r} repeats line {first}; ids must be unique within a job", now))
        synth_lines.append(line)
        synth_api.append(dup_api.get(line))
    if synthesized:
        parts.append(_with_line(rows_to_table(synthesized, RESULT_SCHEMA), pa.array(synth_lines, pa.int64()),
                                pa.array(synth_api, pa.string())))

    table = pa.concat_tables(parts).sort_by("line")
    output = table.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
    write_table_atomic(spool.out / OUTPUT_PARQUET, output)
    if openai:
        _write_openai(spool, job_id, table.filter(pc.is_valid(table["api"])))

    reasons = output["finish_reason"]

    def count(*values: str) -> int:
        return int(pc.sum(pc.is_in(reasons, value_set=pa.array(values, pa.string()))).as_py() or 0)

    return OutputSummary(
        rows=output.num_rows, completed=count("stop", "length"), failed=count("error"),
        cancelled=count("cancelled"), expired=count("expired"),
        prompt_tokens=int(pc.sum(output["prompt_tokens"]).as_py() or 0),
        output_tokens=int(pc.sum(output["output_tokens"]).as_py() or 0), openai=openai,
        budget_exceeded=int(pc.sum(pc.equal(pc.fill_null(output["error_code"], ""), errors.BUDGET_EXCEEDED))
                            .as_py() or 0),
    )


def _kept_rows(rows: pa.Table) -> pa.Table:
    """One row per id: the first non-error row collected, else the first row."""
    if rows.num_rows == 0:
        return rows
    is_error = pc.equal(rows["finish_reason"], "error").cast(pa.int64())
    key = pc.add(pc.multiply(is_error, _ORDER_STRIDE), pa.array(range(rows.num_rows), pa.int64()))
    keyed = rows.append_column("_key", key)
    best = keyed.select(["id", "_key"]).group_by("id").aggregate([("_key", "min")])
    kept = keyed.filter(pc.is_in(keyed["_key"], value_set=best["_key_min"]))
    return kept.drop_columns(["_key"])


def _with_line(rows: pa.Table, line: pa.Array, api: pa.Array) -> pa.Table:
    return rows.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA).append_column("line", line).append_column("api", api)


def _error_row(rid: str, job_id: str, code: str, message: str, now: float) -> ResultRow:
    return error_result_row(rid, job_id, code, message, model="", worker=JOBS_WORKER, attempt=0, finished_at=now)


def _unfinished_row(req: Request, job_id: str, ending: str, now: float) -> ResultRow:
    """The row of a request that never got one: the job was cancelled or expired first, or it was lost."""
    if ending in ("cancelled", "expired"):
        return ResultRow(job_id=job_id, id=req.id, tenant=req.tenant, model=req.model or "",
                         request_type=req.request_type, finish_reason=ending, finished_at=now,
                         worker=JOBS_WORKER, attempt=0, metadata=dict(req.metadata))
    row = error_result_row(req.id, job_id, errors.LOST,
                           "no result row arrived for this request (its stream entry was lost)",
                           tenant=req.tenant, model=req.model or "", request_type=req.request_type,
                           worker=JOBS_WORKER, attempt=0, finished_at=now, metadata=dict(req.metadata))
    return row


# -- OpenAI Batch output ---------------------------------------------------------------------
def _short_hash(*parts: object) -> str:
    return hashlib.sha256("\x00".join(str(p) for p in parts).encode()).hexdigest()[:24]


def _chat_logprobs(items: list[dict] | None) -> dict | None:
    if items is None:
        return None
    return {"content": [
        {"token": str(t["token_id"]), "logprob": t["logprob"], "bytes": None,
         "top_logprobs": [{"token": str(tid), "logprob": lp, "bytes": None}
                          for tid, lp in zip(t["top_token_ids"] or [], t["top_logprobs"] or [])]}
        for t in items
    ]}


def _completion_logprobs(items: list[dict] | None) -> dict | None:
    if items is None:
        return None
    return {
        "tokens": [str(t["token_id"]) for t in items],
        "token_logprobs": [t["logprob"] for t in items],
        "top_logprobs": [{str(tid): lp for tid, lp in zip(t["top_token_ids"] or [], t["top_logprobs"] or [])}
                         for t in items],
        "text_offset": None,
    }


def openai_record(job_id: str, row: dict) -> tuple[bool, dict]:
    """(is_success, the OpenAI Batch output object) of one output row (with ``line`` and ``api``)."""
    line = row["line"]
    rid = row["id"]
    custom_id = None if row["finish_reason"] == "error" and rid == f"line:{line}" else rid
    record: dict = {"id": f"batch_req_{_short_hash(job_id, line)}", "custom_id": custom_id}
    reason = row["finish_reason"]
    if reason in ("stop", "length"):
        created = int(row["finished_at"].timestamp())
        usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["output_tokens"],
                 "total_tokens": row["prompt_tokens"] + row["output_tokens"]}
        if row["api"] == "chat":
            body = {"id": f"chatcmpl-{_short_hash(job_id, rid, 'chat')}", "object": "chat.completion",
                    "created": created, "model": row["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": row["text"] or ""},
                                 "logprobs": _chat_logprobs(row["logprobs"]), "finish_reason": reason}],
                    "usage": usage}
        else:
            body = {"id": f"cmpl-{_short_hash(job_id, rid, 'completion')}", "object": "text_completion",
                    "created": created, "model": row["model"],
                    "choices": [{"index": 0, "text": row["text"] or "",
                                 "logprobs": _completion_logprobs(row["logprobs"]), "finish_reason": reason}],
                    "usage": usage}
        record["response"] = {"status_code": 200, "request_id": f"req_{_short_hash(job_id, rid)}", "body": body}
        record["error"] = None
        return True, record
    if reason in _OPENAI_ERRORS:
        code, message = _OPENAI_ERRORS[reason]
    else:
        code, message = row["error_code"] or errors.INTERNAL_ERROR, row["error"] or "the request failed"
    record["response"] = None
    record["error"] = {"code": code, "message": message}
    return False, record


def _write_openai(spool: Spool, job_id: str, table: pa.Table) -> None:
    # Two passes over the table (one per file) keep memory at one batch of JSON at a time.
    def writer(success: bool):
        def write(f: IO[bytes]) -> None:
            for batch in table.to_batches(max_chunksize=4096):
                for row in batch.to_pylist():
                    ok, record = openai_record(job_id, row)
                    if ok == success:
                        f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        return write

    write_atomic(spool.out / OUTPUT_JSONL, writer(True))
    write_atomic(spool.out / ERRORS_JSONL, writer(False))
