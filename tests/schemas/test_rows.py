"""Result and cost rows: the column contract and the conversion to Arrow."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mqinfer.schemas.errors import RequestError
from mqinfer.schemas import errors
from mqinfer.schemas.rows import (
    COST_SCHEMA,
    RESULT_SCHEMA,
    CostRow,
    ResultRow,
    TokenLogprob,
    error_result_row,
    rows_to_table,
    with_device_share,
)

UTC_US = pa.timestamp("us", tz="UTC")


def test_result_schema_is_the_contract():
    assert RESULT_SCHEMA.names == [
        "job_id", "id", "tenant", "model", "request_type", "finish_reason", "error_code", "error",
        "prompt_tokens", "output_tokens", "output_token_ids", "text", "logprobs", "enqueued_at", "started_at",
        "first_token_at", "finished_at", "worker", "attempt", "metadata", "schema_valid", "index", "slo_met",
    ]
    types = {f.name: f.type for f in RESULT_SCHEMA}
    assert types["schema_valid"] == pa.bool_() and RESULT_SCHEMA.field("schema_valid").nullable
    assert types["prompt_tokens"] == types["output_tokens"] == types["attempt"] == pa.int32()
    assert types["output_token_ids"] == pa.list_(pa.int32())
    assert types["finished_at"] == types["enqueued_at"] == UTC_US
    assert types["metadata"] == pa.map_(pa.string(), pa.string())
    lp = types["logprobs"].value_type
    assert [(f.name, f.type) for f in lp] == [
        ("token_id", pa.int32()), ("logprob", pa.float32()), ("top_token_ids", pa.list_(pa.int32())),
        ("top_logprobs", pa.list_(pa.float32())),
    ]
    assert types["index"] == pa.int32()
    nullable = {f.name for f in RESULT_SCHEMA if f.nullable}
    # index: nullable only so that files written before it read (as 0); workers always write it.
    assert nullable == {"job_id", "error_code", "error", "text", "logprobs", "enqueued_at", "started_at",
                        "first_token_at", "schema_valid", "index", "slo_met"}
    assert types["slo_met"] == pa.bool_()


def test_cost_schema_is_the_contract():
    assert COST_SCHEMA.names == [
        "kind", "job_id", "id", "tenant", "model", "request_type", "prompt_tokens", "cached_prompt_tokens",
        "output_tokens", "queue_s", "prefill_s", "decode_s", "device_s", "recomputed_s", "kv_block_s", "cost_usd",
        "price_per_device_hour", "worker", "finished_at", "rejected_tokens", "device_share",
        "host_cached_tokens", "disk_cached_tokens", "shared_cached_tokens", "index", "metadata", "model_variant",
    ]
    types = {f.name: f.type for f in COST_SCHEMA}
    # The request's labels, as in the result rows, and how the worker ran the model.
    assert types["metadata"] == RESULT_SCHEMA.field("metadata").type and types["model_variant"] == pa.string()
    assert COST_SCHEMA.field("metadata").nullable and COST_SCHEMA.field("model_variant").nullable
    assert all(types[n] == pa.int32() for n in ("prompt_tokens", "cached_prompt_tokens", "output_tokens",
                                                "rejected_tokens"))
    assert all(types[n] == pa.float64() for n in ("queue_s", "device_s", "cost_usd", "price_per_device_hour",
                                                  "device_share"))
    # Added after rows were written without it: nullable, and such rows read as one whole device.
    assert COST_SCHEMA.field("device_share").nullable
    assert types["finished_at"] == UTC_US
    assert types["index"] == pa.int32() and COST_SCHEMA.field("index").nullable
    # Prefix tokens per KV tier: added later, nullable.
    assert all(types[n] == pa.int32() and COST_SCHEMA.field(n).nullable
               for n in ("host_cached_tokens", "disk_cached_tokens", "shared_cached_tokens"))


def test_rows_written_before_the_index_read_as_choice_zero():
    from mqinfer.schemas.rows import with_choice_index

    result = rows_to_table([ResultRow(id="r", model="m", finish_reason="stop", finished_at=1.0, worker="w",
                                      index=3)], RESULT_SCHEMA)
    assert ResultRow(id="r", model="m", finish_reason="stop", finished_at=1.0, worker="w").index == 0
    old = result.drop_columns(["index"])
    assert with_choice_index(old, RESULT_SCHEMA)["index"].to_pylist() == [0]
    assert with_choice_index(result, RESULT_SCHEMA)["index"].to_pylist() == [3]
    nulls = result.set_column(result.schema.get_field_index("index"), RESULT_SCHEMA.field("index"),
                              pa.nulls(1, pa.int32()))
    assert with_choice_index(nulls, RESULT_SCHEMA)["index"].to_pylist() == [0]
    costs = rows_to_table([CostRow(kind="request", id="r", worker="w", finished_at=1.0, index=2),
                           CostRow(kind="idle", worker="w", finished_at=1.0)], COST_SCHEMA)
    assert costs["index"].to_pylist() == [2, None]
    filled = with_choice_index(costs.drop_columns(["index"]), COST_SCHEMA)
    assert filled["index"].to_pylist() == [0, None] and filled.schema.equals(COST_SCHEMA)


def test_cost_rows_written_before_device_share_read_as_one_device():
    new = rows_to_table([CostRow(kind="idle", device_s=1.0, worker="w", finished_at=1.0, device_share=0.5)],
                        COST_SCHEMA)
    old = new.drop_columns(["device_share"])
    assert with_device_share(old)["device_share"].to_pylist() == [1.0]
    assert with_device_share(new)["device_share"].to_pylist() == [0.5]
    mixed = pa.concat_tables([new, new.set_column(new.schema.get_field_index("device_share"),
                                                  COST_SCHEMA.field("device_share"), pa.nulls(1, pa.float64()))])
    filled = with_device_share(mixed)
    assert filled["device_share"].to_pylist() == [0.5, 1.0] and filled.schema.equals(COST_SCHEMA)


def test_rows_to_table_converts_and_survives_parquet(tmp_path):
    row = ResultRow(
        job_id=None, id="r1", model="tiny", finish_reason="length", prompt_tokens=3, output_tokens=2,
        output_token_ids=[7, 8], text="ab",
        logprobs=[TokenLogprob(token_id=7, logprob=-0.25, top_token_ids=[7, 1], top_logprobs=[-0.25, -2.0]),
                  TokenLogprob(token_id=8, logprob=-1.5)],
        enqueued_at=1_700_000_000.0, started_at=1_700_000_000.5, first_token_at=None, finished_at=1_700_000_001.000001,
        worker="w", attempt=2, metadata={"a": "1"},
    )
    table = rows_to_table([row], RESULT_SCHEMA)
    assert table.schema.equals(RESULT_SCHEMA)
    pq.write_table(table, tmp_path / "r.parquet")
    back = pq.read_table(tmp_path / "r.parquet").to_pylist()[0]
    assert back["finished_at"] == dt.datetime(2023, 11, 14, 22, 13, 21, 1, tzinfo=dt.timezone.utc)
    assert back["started_at"].timestamp() == 1_700_000_000.5 and back["first_token_at"] is None
    assert back["metadata"] == [("a", "1")] and back["output_token_ids"] == [7, 8]
    assert back["logprobs"] == [
        {"token_id": 7, "logprob": -0.25, "top_token_ids": [7, 1], "top_logprobs": [-0.25, -2.0]},
        {"token_id": 8, "logprob": -1.5, "top_token_ids": [], "top_logprobs": []},
    ]
    assert (back["job_id"], back["tenant"], back["request_type"], back["attempt"]) == (None, "default", "default", 2)


def test_cost_rows_and_null_checks():
    idle = CostRow(kind="idle", device_s=2.5, cost_usd=0.001, price_per_device_hour=1.44, worker="w", finished_at=10.0)
    table = rows_to_table([idle], COST_SCHEMA)
    assert table.to_pylist()[0]["id"] is None and table["device_s"].to_pylist() == [2.5]
    with pytest.raises(ValueError, match="`worker` must not be null"):
        rows_to_table([CostRow(kind="idle", worker=None, finished_at=1.0)], COST_SCHEMA)
    with pytest.raises(ValueError, match="`prompt_tokens`"):
        rows_to_table([CostRow(kind="request", prompt_tokens=2**31, worker="w", finished_at=1.0)], COST_SCHEMA)
    with pytest.raises(ValueError, match="time zone"):
        rows_to_table([CostRow(kind="idle", worker="w", finished_at=dt.datetime(2024, 1, 1))], COST_SCHEMA)


def test_error_result_row():
    err = RequestError(errors.INVALID_REQUEST, "Expected `int` >= 1 - at `$.max_tokens`", "r9")
    row = error_result_row(err.request_id, "j1", err.code, err.message, model="tiny", worker="w", attempt=1,
                           enqueued_at=5.0, finished_at=6.0, metadata={"m": "x"})
    assert (row.finish_reason, row.error_code, row.error) == ("error", "invalid_request", err.message)
    assert (row.id, row.job_id, row.prompt_tokens, row.output_tokens, row.output_token_ids) == ("r9", "j1", 0, 0, [])
    assert (row.tenant, row.request_type, row.metadata) == ("default", "default", {"m": "x"})
    assert rows_to_table([row], RESULT_SCHEMA).num_rows == 1
