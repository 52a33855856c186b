"""Hostile input against the two front doors, in process: the stream entry decoder and the input
file reader. Whatever arrives, the answer is a valid Request or a RequestError with a stable code
(never another exception), and an id that comes back out is one that can safely identify a row."""

from __future__ import annotations

import datetime as dt
import math
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import strategies as st

from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.files import iter_input
from mqinfer.schemas.stream import decode_entry
from tests.hostile.corpus import CASES
from tests.hostile.hostile_values import (
    EXAMPLES,
    LONG_EXAMPLES,
    json_bytes,
    check_error,
    check_request,
    entry_fields,
    fuzz,
    request_objects,
)

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corpus_entry_decodes_to_the_expected_verdict(case):
    if case.decode is None:
        check_request(decode_entry(case.fields))
        return
    with pytest.raises(RequestError) as caught:
        decode_entry(case.fields)
    check_error(caught.value)
    assert caught.value.code == case.decode
    expected_id = case.rid if case.outcome == "row" else None
    assert caught.value.request_id == expected_id


def check_entry(fields: dict) -> None:
    try:
        req = decode_entry(fields)
    except RequestError as exc:
        check_error(exc)
        return
    check_request(req)


def test_fuzz_decode_entry():
    fuzz(entry_fields(), check_entry, EXAMPLES)


@pytest.mark.slow
def test_fuzz_decode_entry_long():
    fuzz(entry_fields(), check_entry, LONG_EXAMPLES)


# -- the input file reader ----------------------------------------------------------------------

jsonl_lines = st.lists(
    st.one_of(
        st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
        request_objects().map(lambda obj: (json_bytes(obj) or b"{").replace(b"\n", b" ")),
        st.sampled_from([b"", b"   ", b"\r", BOM + b'{"id": "bom", "prompt": "x"}', b'{"id": "ok", "prompt": "x"}',
                         b'{"id": "a\\u0000b", "prompt": "x"}', b"\xff\xfe\xfd", b"[]", b"null"]),
    ),
    max_size=12,
)


def check_jsonl(lines: list[bytes]) -> None:
    data = b"\n".join(lines)
    nonblank = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if number == 1 and line.startswith(BOM):
            line = line[len(BOM):]
        if line.strip():
            nonblank.append(number)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "in.jsonl"
        path.write_bytes(data)
        items = list(iter_input(path))
    assert [item.line for item in items] == nonblank  # one item per non-blank line, in order
    for item in items:
        assert (item.request is None) != (item.error is None)
        if item.error is not None:
            check_error(item.error)
            assert item.error.request_id is not None  # `line:<N>` when no usable id was found
        else:
            check_request(item.request)


def test_fuzz_jsonl_reader():
    fuzz(jsonl_lines, check_jsonl, EXAMPLES)


@pytest.mark.slow
def test_fuzz_jsonl_reader_long():
    fuzz(jsonl_lines, check_jsonl, LONG_EXAMPLES)


# Parquet columns a producer's pipeline might really write: wrong types, nulls, extreme values.
_ts = pa.timestamp("us")
PARQUET_COLUMNS = {
    "id": [(pa.string(), st.one_of(st.none(), st.text(max_size=10), st.sampled_from(["x\ny", "../p", ""]))),
           (pa.int64(), st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),
           (pa.binary(), st.one_of(st.none(), st.binary(max_size=8)))],
    "prompt": [(pa.string(), st.one_of(st.none(), st.text(max_size=10))), (pa.binary(), st.binary(max_size=8))],
    "prompt_token_ids": [(pa.list_(pa.int64()), st.one_of(st.none(), st.lists(st.integers(-(2**63), 2**63 - 1),
                                                                               max_size=4))),
                         (pa.list_(pa.float64()), st.lists(st.floats(), max_size=3)),
                         (pa.int64(), st.integers(-5, 5))],
    "max_tokens": [(pa.int64(), st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),
                   (pa.float64(), st.one_of(st.none(), st.floats())),
                   (pa.string(), st.text(max_size=4))],
    "temperature": [(pa.float64(), st.floats()), (pa.float32(), st.floats(width=32))],
    "metadata": [(pa.map_(pa.string(), pa.string()), st.one_of(st.none(), st.dictionaries(
                     st.text(max_size=4), st.text(max_size=4), max_size=3).map(lambda d: list(d.items())))),
                 (pa.map_(pa.string(), pa.int64()), st.dictionaries(st.text(max_size=4), st.integers(-9, 9),
                                                                     max_size=2).map(lambda d: list(d.items()))),
                 (pa.string(), st.text(max_size=6))],
    # Every value an Arrow timestamp can hold, most of them outside the years Python's datetime can.
    "deadline": [(_ts, st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1).map(lambda us: pa.scalar(us, _ts)))),
                 (pa.timestamp("us", tz="UTC"), st.datetimes(timezones=st.just(dt.timezone.utc))),
                 (pa.float64(), st.floats())],
    "stop": [(pa.list_(pa.string()), st.lists(st.text(max_size=3), max_size=20)), (pa.string(), st.text(max_size=3))],
    "seed": [(pa.uint64(), st.integers(0, 2**64 - 1)), (pa.float64(), st.floats())],
    "colour": [(pa.string(), st.text(max_size=3))],
}


@st.composite
def parquet_tables(draw) -> pa.Table:
    n = draw(st.integers(min_value=1, max_value=4))
    names = draw(st.lists(st.sampled_from(sorted(PARQUET_COLUMNS)), min_size=1, max_size=6, unique=True))
    columns = {}
    for name in names:
        arrow_type, cell = draw(st.sampled_from(PARQUET_COLUMNS[name]))
        cells = draw(st.lists(cell, min_size=n, max_size=n))
        cells = [c.value if isinstance(c, pa.Scalar) else c for c in cells]
        if pa.types.is_timestamp(arrow_type) and arrow_type.tz is None:
            columns[name] = pa.array(cells, pa.int64()).cast(arrow_type)
        else:
            columns[name] = pa.array(cells, arrow_type)
    return pa.table(columns)


def check_parquet(table: pa.Table) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "in.parquet"
        pq.write_table(table, path)
        items = list(iter_input(path))
    assert [item.line for item in items] == list(range(1, table.num_rows + 1))
    for item in items:
        assert (item.request is None) != (item.error is None)
        if item.error is not None:
            check_error(item.error)
        else:
            check_request(item.request)


def test_fuzz_parquet_reader():
    fuzz(parquet_tables(), check_parquet, EXAMPLES)


@pytest.mark.slow
def test_fuzz_parquet_reader_long():
    fuzz(parquet_tables(), check_parquet, LONG_EXAMPLES)


def test_parquet_rows_with_timestamps_python_cannot_hold_are_error_rows(tmp_path):
    """Arrow timestamps reach far past year 9999; such a row is a per-row error, not a crash."""
    far = pa.array([0, 2**62], pa.int64()).cast(pa.timestamp("us"))
    path = tmp_path / "far.parquet"
    pq.write_table(pa.table({"id": ["near", "far"], "prompt": ["x", "y"], "deadline": far}), path)
    items = list(iter_input(path))
    assert [i.line for i in items] == [1, 2]
    assert items[0].request is not None and math.isclose(items[0].request.deadline, 0.0)
    assert items[1].request is None and items[1].error.request_id == "far"
    assert items[1].error.code == "invalid_request" and "`$.deadline`" in items[1].error.message


def test_a_file_that_is_not_parquet_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "noise.parquet"
    path.write_bytes(b"PAR1 this is not really parquet PAR1")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        list(iter_input(path))


# -- coverage-guided fuzzing, when atheris is installed -------------------------------------------

HARNESS = Path(__file__).with_name("fuzz_entry.py")


def _atheris(runs: int) -> None:
    pytest.importorskip("atheris", reason="atheris is optional (pip install atheris)")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(HARNESS), f"-runs={runs}", "-seed=1", "-rss_limit_mb=4096"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"Done {runs} runs" in done.stderr


def test_atheris_harness():
    _atheris(int(os.environ.get("MQINFER_ATHERIS_RUNS", "3000")))


@pytest.mark.slow
def test_atheris_harness_long():
    _atheris(int(os.environ.get("MQINFER_ATHERIS_RUNS_LONG", "300000")))
