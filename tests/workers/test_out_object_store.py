"""`mqinfer worker --out s3://...`: a worker writes its results and costs datasets into an
S3-compatible object store (moto's server, started by the test) with the layout of a local folder,
each part visible whole by one upload; requests sent again are computed once; a report over the
store equals the report over the same objects copied into a folder. A real worker process of the
built-in tiny model."""

from __future__ import annotations

import signal

import pyarrow.dataset as ds
import pytest
from pyarrow import fs

from mqinfer.client import Producer
from mqinfer.ops.report import cost_report
from mqinfer.schemas import keys
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow
from mqinfer.workers.queue.sink import Sinks
from tests.helpers import start_worker, wait_exit, wait_until

STREAM = keys.request_stream("requests")
N = 10


def _uri(endpoint: str, path: str) -> str:
    return f"s3://{path}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def _objects(filesystem, path: str) -> list[fs.FileInfo]:
    return [f for f in filesystem.get_file_info(fs.FileSelector(path, recursive=True, allow_not_found=True))
            if f.type == fs.FileType.File]


def _read(filesystem, path: str, schema):
    parts = [f.path for f in _objects(filesystem, path) if f.base_name.startswith("part-")]
    return ds.dataset(parts, format="parquet", schema=schema, filesystem=filesystem).to_table()


def _submit(redis_url: str) -> None:
    Producer(redis_url).submit_many(
        ({"id": f"r{i}", "prompt_token_ids": [256] + [65 + i % 26] * (4 + i), "max_tokens": 3 + i % 4,
          "ignore_eos": True, "temperature": 0.0, "metadata": {"team": ("a", "b")[i % 2]}} for i in range(N)),
        job_id="s3job")


def _settled(client) -> bool:
    """Every entry of the stream acked (acked entries leave it)."""
    return client.xlen(STREAM) == 0


def test_a_worker_writes_its_datasets_into_an_object_store(s3, redis_url, redis_client, tmp_path):
    endpoint, filesystem = s3
    out = _uri(endpoint, "fleet/w1")
    worker = start_worker(redis_url, out, "--consumer", "w1", "--flush-interval-s", "0.1",
                          "--price-per-device-hour", "36")
    try:
        _submit(redis_url)
        wait_until(lambda: redis_client.scard(keys.job_done_set("requests", "s3job")) >= N, timeout=180,
                   what="every row")
        # The same requests again: their records say they are done, so nothing is computed twice.
        _submit(redis_url)
        wait_until(lambda: _settled(redis_client), timeout=60, what="the copies acked")
    finally:
        worker.send_signal(signal.SIGTERM)
        code, err = wait_exit(worker)
    assert code == 0, err[-3000:]

    names = [f.path for f in _objects(filesystem, "fleet/w1")]
    assert not [n for n in names if "/.tmp-" in n]  # nothing but whole parts
    assert "fleet/w1/.mqinfer/workers/w1.json" in names  # the exit summary, beside the rows
    results = _read(filesystem, "fleet/w1/results", RESULT_SCHEMA).to_pylist()
    assert sorted(r["id"] for r in results) == sorted(f"r{i}" for i in range(N))  # each once
    assert all(r["finish_reason"] == "length" for r in results)
    costs = _read(filesystem, "fleet/w1/costs", COST_SCHEMA).to_pylist()
    assert sorted(c["id"] for c in costs if c["kind"] == "request") == sorted(f"r{i}" for i in range(N))
    assert all(n.split("/")[3].startswith("date=") for n in names if "/part-" in n)

    # A report over the store is the report over the same parts in a folder.
    fs.copy_files("fleet/w1", str(tmp_path / "copy"), source_filesystem=filesystem)
    remote = cost_report(out, by=["metadata.team"], basis="allocation")
    local = cost_report(tmp_path / "copy", by=["metadata.team"], basis="allocation")
    assert [g.key for g in remote.groups] == [g.key for g in local.groups] and len(remote.groups) == 2
    assert remote.totals.requests == N == local.totals.requests
    assert remote.totals.cost_usd == pytest.approx(local.totals.cost_usd, rel=1e-12) and remote.totals.cost_usd > 0


def test_a_worker_refuses_an_object_store_without_its_bucket(s3, redis_url):
    endpoint, _ = s3
    worker = start_worker(redis_url, _uri(endpoint, "no-such-bucket/out"))
    code, err = wait_exit(worker, timeout=120)
    assert code != 0 and "no bucket or folder 'no-such-bucket'" in err


def _rows(i: int) -> tuple[ResultRow, CostRow]:
    result = ResultRow(job_id="j", id=f"q{i}", model="tiny", finish_reason="length", prompt_tokens=2, output_tokens=1,
                       output_token_ids=[1], finished_at=1_700_000_000.0 + i, worker="w")
    cost = CostRow(kind="request", job_id="j", id=f"q{i}", tenant="t", model="tiny", request_type="default",
                   prompt_tokens=2, output_tokens=1, device_s=0.5, cost_usd=0.25, price_per_device_hour=1.0,
                   worker="w", finished_at=1_700_000_000.0 + i)
    return result, cost


def test_rows_a_failed_upload_kept_are_published_once_by_the_next_flush(s3):
    endpoint, filesystem = s3
    sinks = Sinks(_uri(endpoint, "later/out"), "w")
    for i in range(3):
        sinks.add(*_rows(i))
    with pytest.raises(OSError):
        sinks.flush()  # the bucket is not there yet: nothing is published, nothing is lost
    assert sinks.pending == 6
    filesystem.create_dir("later")
    assert sinks.flush() == 6 and sinks.pending == 0
    assert sorted(_read(filesystem, "later/out/results", RESULT_SCHEMA)["id"].to_pylist()) == ["q0", "q1", "q2"]
    assert _read(filesystem, "later/out/costs", COST_SCHEMA)["cost_usd"].to_pylist() == [0.25] * 3
    # Two writers with one name never replace each other's parts.
    other = Sinks(_uri(endpoint, "later/out"), "w")
    other.add(*_rows(3))
    sinks.add(*_rows(4))
    other.flush(), sinks.flush()
    assert sorted(_read(filesystem, "later/out/results", RESULT_SCHEMA)["id"].to_pylist()) == [
        f"q{i}" for i in range(5)]


def test_a_replacement_cut_short_shows_the_new_part_alone_and_the_next_one_finishes_it(s3):
    from mqinfer.ops.compact import drop_job
    from mqinfer.ops.report import cost_report
    from mqinfer.schemas.dataset_uri import job_table

    endpoint, filesystem = s3
    out = _uri(endpoint, "fleet/cut")
    sinks = Sinks(out, "w")
    for i in range(4):
        sinks.add(*_rows(i))
    sinks.flush()
    [old] = [f.path for f in _objects(filesystem, "fleet/cut/costs")]
    # A replacement whose old part was not deleted yet (the process died in between): readers take
    # the replacement alone.
    with filesystem.open_input_file(old) as f:
        data = f.read()
    filesystem.create_dir(old.rsplit("/", 1)[0])
    with filesystem.open_output_stream(old[:-len(".parquet")] + "~0000000000001abc.parquet") as f:
        f.write(data)
    assert cost_report(out).totals.cost_usd == pytest.approx(1.0)  # 4 x 0.25, not twice that
    # Dropping rows replaces each part that holds some, and deletes what a cut replacement left.
    assert drop_job(out, "j", {"q1", "q2"}) == (2, 2)
    assert [f.path for f in _objects(filesystem, "fleet/cut/costs")] != [old]
    assert len(_objects(filesystem, "fleet/cut/costs")) == 1
    assert sorted(job_table(out, "results", "j", ["id"])["id"].to_pylist()) == ["q0", "q3"]
    assert cost_report(out).totals.cost_usd == pytest.approx(0.5)
    assert drop_job(out, "j") == (2, 2)  # every row of the job: the parts go
    assert _objects(filesystem, "fleet/cut/costs") == [] and job_table(out, "costs", "j", ["id"]) is None
