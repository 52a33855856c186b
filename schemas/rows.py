"""Storage rows: one result row and one cost row per finished request (per choice of a request with
``n`` > 1 choices, told apart by ``index``), and their Arrow schemas.

``ResultRow`` and ``CostRow`` are what workers build in Python (timestamps as float unix
seconds); ``RESULT_SCHEMA`` and ``COST_SCHEMA`` are the public column contract of the
``results/`` and ``costs/`` Parquet datasets, in that order. :func:`rows_to_table` is the one
place where the former become the latter (timestamps become microseconds, UTC).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

FINISH_REASONS = ("stop", "length", "error", "expired", "cancelled")
COST_KINDS = ("request", "idle", "startup", "duplicate", "lost")

TIMESTAMP = pa.timestamp("us", tz="UTC")

LOGPROB_TYPE = pa.struct(
    [
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("logprob", pa.float32(), nullable=False),
        pa.field("top_token_ids", pa.list_(pa.int32())),
        pa.field("top_logprobs", pa.list_(pa.float32())),
    ]
)

RESULT_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string()),
        pa.field("id", pa.string(), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("request_type", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("error_code", pa.string()),
        pa.field("error", pa.string()),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),
        pa.field("output_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("text", pa.string()),
        pa.field("logprobs", pa.list_(LOGPROB_TYPE)),
        pa.field("enqueued_at", TIMESTAMP),
        pa.field("started_at", TIMESTAMP),
        pa.field("first_token_at", TIMESTAMP),
        pa.field("finished_at", TIMESTAMP, nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("metadata", pa.map_(pa.string(), pa.string()), nullable=False),
        # Whether the text follows the request's response_format (true only for a "stop" ending
        # the grammar accepts); null for requests without one, for error rows, and in rows written
        # before the column existed.
        pa.field("schema_valid", pa.bool_()),
        # The choice of a request with n > 1 choices (0 to n - 1), 0 otherwise: a request is one
        # (job_id, id) and has one row per index. Workers always write it; nullable only so that
        # files written before the column existed still read, where null means 0
        # (with_choice_index; compaction writes the 0).
        pa.field("index", pa.int32()),
        # Whether the request met every latency target it had (slo_ttft_ms, slo_tpot_ms, or its
        # tenant's --tenant-slos; see workers/queue/slo.py); null without targets, for a request that
        # never ran, and in rows written before the column existed.
        pa.field("slo_met", pa.bool_()),
    ]
)

COST_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("job_id", pa.string()),
        pa.field("id", pa.string()),
        pa.field("tenant", pa.string()),
        pa.field("model", pa.string()),
        pa.field("request_type", pa.string()),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("cached_prompt_tokens", pa.int32(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),
        pa.field("queue_s", pa.float64(), nullable=False),
        pa.field("prefill_s", pa.float64(), nullable=False),
        pa.field("decode_s", pa.float64(), nullable=False),
        pa.field("device_s", pa.float64(), nullable=False),
        pa.field("recomputed_s", pa.float64(), nullable=False),
        pa.field("kv_block_s", pa.float64(), nullable=False),
        pa.field("cost_usd", pa.float64(), nullable=False),
        pa.field("price_per_device_hour", pa.float64(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("finished_at", TIMESTAMP, nullable=False),
        # Proposed tokens computed and discarded by speculative decoding (their time is in device_s);
        # null in rows written before the column existed.
        pa.field("rejected_tokens", pa.int32()),
        # The share of a priced device the row's worker held (device_s is its wall seconds times
        # this): on CUDA one per tensor-parallel rank, on a CPU machine (one device) the worker's
        # threads over the usable cores. Null in rows written before the column existed, which
        # billed one whole device: read it as 1.0 (with_device_share).
        pa.field("device_share", pa.float64()),
        # Of cached_prompt_tokens, those copied up from each KV tier below the device cache (host
        # memory, the disk directory, the shared directory); the rest were in the device cache. Null
        # in rows written before the columns existed.
        pa.field("host_cached_tokens", pa.int32()),
        pa.field("disk_cached_tokens", pa.int32()),
        pa.field("shared_cached_tokens", pa.int32()),
        # The choice a request row bills (see the results' index); null for the rows of no request
        # (idle, startup, lost) and for work no result carries; read as 0 where a request row
        # written before the column existed has none (with_choice_index).
        pa.field("index", pa.int32()),
        # The request's own labels (its ``metadata``, as in the result row), for splitting the bill
        # by them; empty for rows of no request, null in rows written before the column existed.
        pa.field("metadata", pa.map_(pa.string(), pa.string())),
        # What changes the price of the same model on the same device: the weights' dtype, their
        # quantization, the KV cache dtype and the tensor and pipeline ranks, as
        # ``dtype=...,quantization=...,kv_cache_dtype=...,tp=T,pp=P`` (model_variant()). Null where
        # the worker is unknown (a ``lost`` row, rows of ``mqinfer run``'s own, older rows).
        pa.field("model_variant", pa.string()),
    ]
)

# What a cost row without a device_share (written before the column existed) held.
LEGACY_DEVICE_SHARE = 1.0


class TokenLogprob(msgspec.Struct, kw_only=True):
    """The sampled token's log-probability and the top alternatives at one output position."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class ResultRow(msgspec.Struct, kw_only=True):
    """One finished request (or one rejected one: ``finish_reason`` "error")."""

    job_id: str | None = None
    id: str
    tenant: str = "default"
    model: str
    request_type: str = "default"
    finish_reason: str
    error_code: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_token_ids: list[int] = []
    text: str | None = None
    # TokenLogprob structs (or dicts of the same keys), one per output token; None when not asked.
    logprobs: list[TokenLogprob] | None = None
    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float
    worker: str
    attempt: int = 1
    metadata: dict[str, str] = {}
    schema_valid: bool | None = None
    index: int = 0
    slo_met: bool | None = None


class CostRow(msgspec.Struct, kw_only=True):
    """Where device time went: one row per request, plus ``idle`` and ``startup`` rows per worker,
    and a ``lost`` row for the time a killed worker used but never wrote (written by the worker
    that found it dead, with the dead worker's name)."""

    kind: Literal["request", "idle", "startup", "duplicate", "lost"]
    job_id: str | None = None
    id: str | None = None
    tenant: str | None = None
    model: str | None = None
    request_type: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    device_s: float = 0.0
    recomputed_s: float = 0.0
    kv_block_s: float = 0.0
    cost_usd: float = 0.0
    price_per_device_hour: float = 0.0
    worker: str
    finished_at: float
    rejected_tokens: int = 0
    device_share: float = 1.0
    index: int | None = None
    host_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    shared_cached_tokens: int = 0
    metadata: dict[str, str] = {}
    model_variant: str | None = None


def model_variant(*, dtype: str, quantization: str, kv_cache_dtype: str, tensor_parallel_size: int = 1,
                  pipeline_parallel_size: int = 1) -> str:
    """The ``model_variant`` label of a worker's rows: what it runs the model as."""
    return (f"dtype={dtype},quantization={quantization},kv_cache_dtype={kv_cache_dtype},"
            f"tp={tensor_parallel_size},pp={pipeline_parallel_size}")


def distinct_rows(table: pa.Table) -> pa.Table:
    """``table`` with rows that are equal in every column kept once (the first, in order).

    Map columns (``metadata``) cannot be grouping keys in Arrow; two rows that agree everywhere
    else belong to the same request and carry the same map, so they are compared on the rest.
    """
    if not table.num_rows:
        return table
    names = [f.name for f in table.schema if not pa.types.is_map(f.type)]
    positions = pa.array(range(table.num_rows), pa.int64())
    firsts = table.select(names).append_column("__pos", positions).group_by(names, use_threads=False).aggregate(
        [("__pos", "min")])["__pos_min"]
    return table.take(pc.take(firsts, pc.sort_indices(firsts)))


def with_device_share(table: pa.Table) -> pa.Table:
    """Cost rows ``table`` with ``device_share`` present and never null: rows written before the
    column existed read as :data:`LEGACY_DEVICE_SHARE` (one whole device, as they billed)."""
    field = COST_SCHEMA.field("device_share")
    if "device_share" not in table.schema.names:
        return table.append_column(field, pa.array([LEGACY_DEVICE_SHARE] * table.num_rows, pa.float64()))
    column = table["device_share"]
    if not column.null_count:
        return table
    filled = pc.fill_null(column, LEGACY_DEVICE_SHARE)
    return table.set_column(table.schema.get_field_index("device_share"), field, filled)


def with_choice_index(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows ``table`` of ``schema`` (RESULT_SCHEMA or COST_SCHEMA) with ``index`` present and null
    only where it means "no request": a row written before the column existed, or without one, is
    choice 0; a cost row without an id (idle, startup, lost) keeps a null index."""
    field = schema.field("index")
    if "index" not in table.schema.names:
        # Where the schema has it (columns added after it follow it).
        at = min(schema.get_field_index("index"), table.num_columns)
        table = table.add_column(at, field, pa.nulls(table.num_rows, pa.int32()))
    column = table["index"]
    if not column.null_count:
        return table
    zero = pa.scalar(0, pa.int32())
    if schema is COST_SCHEMA:
        filled = pc.if_else(pc.is_valid(column), column,
                            pc.if_else(pc.is_valid(table["id"]), zero, pa.scalar(None, pa.int32())))
        if filled.null_count == column.null_count:
            return table
    else:
        filled = pc.fill_null(column, zero)
    return table.set_column(table.schema.get_field_index("index"), field, filled)


def to_micros(value: float | int | dt.datetime | None) -> int | None:
    """Unix seconds (or an aware datetime) as integer microseconds, the storage unit."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError(f"timestamp {value!r} has no time zone; give unix seconds or an aware datetime")
        value = value.timestamp()
    return round(value * 1_000_000)


def _column(rows: Sequence[Any], field: pa.Field) -> pa.Array:
    name = field.name
    try:
        values = [getattr(row, name) for row in rows]
    except AttributeError:
        raise ValueError(f"rows for this schema need a `{name}` attribute") from None
    if pa.types.is_timestamp(field.type):
        values = [to_micros(v) for v in values]
    elif name == "logprobs":
        values = [None if v is None else msgspec.to_builtins(v) for v in values]
    try:
        array = pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise ValueError(f"column `{name}`: {exc}") from None
    if not field.nullable and array.null_count:
        first = next(i for i, v in enumerate(values) if v is None)
        raise ValueError(f"column `{name}` must not be null (row {first})")
    return array


_INT32_RANGE = range(-(2**31), 2**31)
_CHECKS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def check_row(row: Any, schema: pa.Schema) -> None:
    """Cheap checks of one row against ``schema``: required columns set, int32 columns in range.

    Catches the usual mistakes where a row is made, for a few microseconds, without building
    Arrow arrays (that happens once per batch in :func:`rows_to_table`).
    """
    checks = _CHECKS.get(id(schema))
    if checks is None:
        required = tuple(f.name for f in schema if not f.nullable)
        int32 = tuple(f.name for f in schema if f.type == pa.int32())
        checks = _CHECKS[id(schema)] = (required, int32)
    required, int32 = checks
    for name in required:
        if getattr(row, name, None) is None:
            raise ValueError(f"column `{name}` must not be null")
    for name in int32:
        value = getattr(row, name)
        if value is not None and (not isinstance(value, int) or value not in _INT32_RANGE):
            raise ValueError(f"column `{name}` must be an int32, got {value!r}")


def rows_to_table(rows: Sequence[Any], schema: pa.Schema) -> pa.Table:
    """An Arrow table with exactly ``schema``'s columns, one row per ``rows`` item."""
    return pa.Table.from_arrays([_column(rows, field) for field in schema], schema=schema)


def error_result_row(
    request_id: str,
    job_id: str | None,
    code: str,
    message: str,
    *,
    tenant: str = "default",
    model: str,
    request_type: str = "default",
    worker: str,
    attempt: int = 1,
    enqueued_at: float | None = None,
    finished_at: float,
    metadata: dict[str, str] | None = None,
) -> ResultRow:
    """The row of a request that ended in an error: ``finish_reason`` "error", zero tokens."""
    return ResultRow(
        job_id=job_id,
        id=request_id,
        tenant=tenant,
        model=model,
        request_type=request_type,
        finish_reason="error",
        error_code=code,
        error=message,
        prompt_tokens=0,
        output_tokens=0,
        output_token_ids=[],
        text=None,
        logprobs=None,
        enqueued_at=enqueued_at,
        started_at=None,
        first_token_at=None,
        finished_at=finished_at,
        worker=worker,
        attempt=attempt,
        metadata=dict(metadata or {}),
    )
