"""Input files: JSONL and Parquet, line numbers, per-line errors, streaming."""

from __future__ import annotations

import datetime as dt
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mqinfer.schemas import errors
from mqinfer.schemas.files import InputItem, input_format, iter_input


def outcome(item: InputItem):
    if item.request is not None:
        assert item.error is None
        return (item.line, "ok", item.request.id)
    return (item.line, item.error.code, item.error.request_id)


def test_jsonl_lines_errors_and_numbering(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "one"}),
        "",  # blank: skipped but counted
        "   ",
        '{"id": "b", "prompt": ',  # malformed
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "c", "prompt": "x", "max_tokens": 0}),
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "best_of": 2}}),
        json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}),
    ]
    raw = ("\r\n".join(lines)).encode() + b"\n" + b'{"id": "f", "prompt": "\xff\xfe"}\n' + b'{"id": "g", "prompt": "z"}'
    path.write_bytes(b"\xef\xbb\xbf" + raw)  # a BOM on the first line is tolerated
    items = list(iter_input(path))
    assert [outcome(i) for i in items] == [
        (1, "ok", "a"),
        (4, errors.INVALID_JSON, "line:4"),
        (5, errors.INVALID_REQUEST, "line:5"),
        (6, errors.INVALID_REQUEST, "c"),
        (7, errors.UNSUPPORTED_PARAMETER, "d"),
        (8, "ok", "e"),
        (9, errors.INVALID_JSON, "line:9"),
        (10, "ok", "g"),
    ]
    assert "$.max_tokens" in items[3].error.message
    assert "missing required field `id`" in items[2].error.message
    assert "UTF-8" in items[6].error.message
    assert items[5].request.api == "chat"


def test_formats_by_extension(tmp_path):
    assert input_format("x.JSONL") == input_format("x.ndjson") == input_format("x.json") == "jsonl"
    assert input_format("x.parquet") == input_format("x.pq") == "parquet"
    with pytest.raises(ValueError, match="data.csv"):
        iter_input(tmp_path / "data.csv")
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="broken.parquet"):
        iter_input(bad)
    with pytest.raises(FileNotFoundError):
        iter_input(tmp_path / "absent.jsonl")


def test_parquet_rows(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "id": ["a", "b", None, "d", "e"],
            "prompt": ["hello", None, "x", "y", "z"],
            "prompt_token_ids": pa.array([None, [1, 2, 3], None, None, None], pa.list_(pa.int32())),
            # pandas writes an int column with gaps as float64
            "max_tokens": pa.array([8.0, None, 4.0, 2.5, None], pa.float64()),
            "stop": pa.array([["\n"], None, None, None, []], pa.list_(pa.string())),
            "metadata": pa.array([[("k", "v")], None, None, None, []], pa.map_(pa.string(), pa.string())),
            "deadline": pa.array([dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc), None, None, None, None],
                                 pa.timestamp("ms", tz="UTC")),
            "temperature": pa.array([0, 1, 1, 1, 1], pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=2)
    items = list(iter_input(path))
    assert [outcome(i) for i in items] == [
        (1, "ok", "a"),
        (2, "ok", "b"),
        (3, errors.INVALID_REQUEST, "line:3"),
        (4, errors.INVALID_REQUEST, "d"),
        (5, "ok", "e"),
    ]
    a, b = items[0].request, items[1].request
    assert (a.prompt, a.max_tokens, a.stop, a.metadata, a.temperature) == ("hello", 8, ["\n"], {"k": "v"}, 0.0)
    assert a.deadline == dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert (b.prompt, b.prompt_token_ids, b.max_tokens) == (None, [1, 2, 3], 16)
    assert "$.max_tokens" in items[3].error.message  # 2.5 is not an integer
    assert items[4].request.stop == [] and items[4].request.metadata == {}


def test_parquet_openai_lines(tmp_path):
    path = tmp_path / "batch.parquet"
    rows = [
        {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 3}},
        {"custom_id": "q2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": None}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    reqs = [i.request for i in iter_input(path)]
    assert [(r.id, r.max_tokens, r.api) for r in reqs] == [("q1", 3, "completions"), ("q2", 16, "completions")]


def test_jsonl_is_streamed(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"id": "r", "prompt": "p" * 200}) + "\n"
    with open(path, "w") as f:
        for _ in range(50_000):  # about 11 MB
            f.write(line)
    tracemalloc.start()
    try:
        it = iter_input(path)
        first = [next(it) for _ in range(100)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(i.request is not None for i in first)
    assert peak < 2_000_000


def test_parquet_logit_bias_as_a_map_or_json_text_and_n_as_float(tmp_path):
    path = tmp_path / "bias.parquet"
    table = pa.table({
        "id": ["m", "t"],
        "prompt": ["x", "y"],
        "n": pa.array([2.0, None], pa.float64()),  # pandas' int column with a missing value
        "logit_bias": pa.array([[(65, 5.0), (66, -100.0)], None], pa.map_(pa.int64(), pa.float64())),
        "presence_penalty": [0.5, None],
    })
    pq.write_table(table, path)
    items = list(iter_input(path))
    assert [i.error for i in items] == [None, None]
    assert (items[0].request.n, items[0].request.logit_bias, items[0].request.presence_penalty) == (
        2, {65: 5.0, 66: -100.0}, 0.5)
    assert items[1].request.n == 1 and items[1].request.logit_bias == {}
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"id": ["t"], "prompt": ["y"], "logit_bias": ['{"70": 1.5}']}), text)
    assert next(iter_input(text)).request.logit_bias == {70: 1.5}
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["b"], "prompt": ["y"], "logit_bias": ['{"70": 500}']}), bad)
    error = next(iter_input(bad)).error
    assert error.code == errors.INVALID_REQUEST and "$.logit_bias" in error.message and error.request_id == "b"
