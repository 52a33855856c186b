"""A bulk job's cost comes from its cost rows (every attempt it paid for), not from the costs the
workers put on its result stream (one attempt per request); the stream figure is shown while the
job runs, as provisional. The job runs in this process (the rq task called directly) against the
embedded server; the workers' part is played by writing real cost rows and result entries."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from mqinfer.jobs_cli import render_status
from mqinfer.ops.job_cost import job_cost
from mqinfer.ops.job_store import JobStore
from mqinfer.ops.job_tasks import run_task
from mqinfer.ops.jobs import job_info, submit_job
from mqinfer.schemas import keys
from mqinfer.schemas.dataset import DatasetWriter
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import COST_SCHEMA, CostRow, ResultRow, rows_to_table
from tests.helpers import write_jsonl

STREAM = keys.request_stream("requests")


def cost(kind: str, job_id: str, rid: str, usd: float, worker: str, at: float) -> CostRow:
    return CostRow(kind=kind, job_id=job_id, id=rid, tenant="acme", model="tiny", request_type="default",
                   prompt_tokens=2, output_tokens=3, device_s=usd * 3600, cost_usd=usd, price_per_device_hour=1.0,
                   worker=worker, finished_at=at)


def step(client, job_id: str) -> str:
    run_task(client, job_id, client.hget(keys.job_key(job_id), "chain").decode(), budget_s=0.2)
    return JobStore(client, job_id).status()


def answer(client, job_id: str, rid: str, usd: float) -> None:
    """What a worker does when it acks a request: done set, and the row with its cost on the job's
    result stream (its cost row is durable before)."""
    row = ResultRow(job_id=job_id, id=rid, model="tiny", finish_reason="length", prompt_tokens=2, output_tokens=3,
                    output_token_ids=[1, 2, 3], finished_at=time.time(), worker="w2")
    client.sadd(keys.job_done_set("requests", job_id), rid)
    client.xadd(keys.job_results_stream(job_id), {"id": rid, "row": msgspec.json.encode(row), "cost_usd": repr(usd)})


def fed(client) -> list[str]:
    return [msgspec.msgpack.decode(f[b"r"], type=Request).id for _, f in client.xrange(STREAM)]


def run_job(client, tmp_path, worker_out):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(3)])
    job_id = submit_job(client, src, tmp_path / "job", worker_out=worker_out).job_id
    while not fed(client):
        step(client, job_id)
    assert sorted(fed(client)) == ["r0", "r1", "r2"]
    now = time.time()
    # r0 ran twice: w1 wrote its rows and was killed before acking, w2 ran it again. w1 also
    # handed back r1 after some work (a duplicate row). Only the attempts that were acked reach
    # the result stream.
    rows = [cost("request", job_id, "r0", 0.30, "w1", now), cost("duplicate", job_id, "r1", 0.05, "w1", now),
            cost("request", job_id, "r0", 0.20, "w2", now + 1), cost("request", job_id, "r1", 0.10, "w2", now + 1),
            cost("request", job_id, "r2", 0.15, "w2", now + 1)]
    wout = tmp_path / "wout"
    DatasetWriter(wout / "costs", COST_SCHEMA, "w1").write(rows[:2])
    DatasetWriter(wout / "costs", COST_SCHEMA, "w2").write(rows[2:])
    # Another job's row in the same folder counts for that job only.
    DatasetWriter(wout / "costs", COST_SCHEMA, "w3").write([cost("request", "other", "r0", 9.0, "w3", now)])
    answer(client, job_id, "r0", 0.20)
    answer(client, job_id, "r1", 0.10)
    step(client, job_id)
    running = job_info(client, job_id)
    answer(client, job_id, "r2", 0.15)
    for _ in range(50):
        if step(client, job_id) == "completed":
            break
    return job_id, running, job_info(client, job_id)


def test_the_cost_of_a_job_is_the_sum_of_its_cost_rows(redis_client, tmp_path):
    job_id, running, done = run_job(redis_client, tmp_path, [str(tmp_path / "wout")])
    # While it runs: the stream's running figure, marked provisional.
    assert running["status"] == "in_progress"
    assert running["cost"]["source"] == "result_stream" and running["cost"]["provisional"] is True
    assert running["cost_usd"] == pytest.approx(0.30)
    assert "provisional" in render_status(running)
    # Once done: every cost row of the job, the wasted attempts included.
    assert done["status"] == "completed"
    assert done["cost_usd"] == pytest.approx(0.30 + 0.05 + 0.20 + 0.10 + 0.15)
    assert done["cost"] == {
        "source": "cost_rows", "provisional": False, "usd": pytest.approx(0.80),
        "request_usd": pytest.approx(0.75), "duplicate_usd": pytest.approx(0.05),
        "device_s": pytest.approx(0.80 * 3600), "rows": 5, "stream_usd": pytest.approx(0.45), "missing_folders": []}
    assert "$0.800000 from 5 cost rows" in render_status(done)
    # The same figure read on demand (`jobs status --worker-out`), and from the rows themselves.
    assert job_info(redis_client, job_id, worker_out=[str(tmp_path / "wout")])["cost_usd"] == pytest.approx(0.80)
    assert job_cost([tmp_path / "wout"], job_id).cost_usd == pytest.approx(0.80)
    assert json.loads(json.dumps(done))["cost"]["rows"] == 5


def test_without_worker_folders_the_cost_is_the_stream_figure_and_says_so(redis_client, tmp_path):
    _, _, done = run_job(redis_client, tmp_path, None)
    assert done["status"] == "completed"
    assert done["cost"]["source"] == "result_stream" and done["cost"]["provisional"] is False
    assert done["cost_usd"] == pytest.approx(0.45)
    assert "no --worker-out" in render_status(done)


def test_days_before_the_job_existed_are_not_read(tmp_path):
    day = 86_400.0
    t = 1_700_000_000.0
    DatasetWriter(tmp_path / "costs", COST_SCHEMA, "w1").write(
        [cost("request", "j", "r0", 1.0, "w1", t - 2 * day), cost("request", "j", "r1", 0.5, "w1", t + 60)])
    assert job_cost([tmp_path], "j").cost_usd == pytest.approx(1.5)
    assert job_cost([tmp_path], "j", since=t).cost_usd == pytest.approx(0.5)


def test_worker_folders_in_object_storage_count_with_local_ones(s3, tmp_path):
    from mqinfer.ops.job_cost import parse_folders
    from mqinfer.schemas.dataset_uri import ObjectDatasetWriter

    endpoint, _ = s3
    uri = f"s3://fleet/w2?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    t = 1_700_000_000.0
    DatasetWriter(tmp_path / "w1" / "costs", COST_SCHEMA, "w1").write([cost("request", "j", "r0", 1.0, "w1", t)])
    remote = ObjectDatasetWriter(f"s3://fleet/w2/costs?endpoint_override={endpoint}&scheme=http&region=us-east-1",
                                 COST_SCHEMA, "w2")
    remote.write_table("date=2023-11-14", rows_to_table([cost("request", "j", "r1", 0.25, "w2", t),
                                                         cost("duplicate", "j", "r0", 0.5, "w2", t),
                                                         cost("request", "k", "r9", 7.0, "w2", t)], COST_SCHEMA))
    folders = parse_folders(f"{tmp_path / 'w1'},{uri}")
    assert folders == [str(tmp_path / "w1"), uri]
    got = job_cost(folders, "j", since=t - 60)
    assert (got.cost_usd, got.request_usd, got.duplicate_usd, got.rows) == (1.75, 1.25, 0.5, 3)
    assert job_cost(folders, "j", since=t + 2 * 86_400).cost_usd == 0.0  # the days before are not read
    nothing = f"s3://fleet/none?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    assert job_cost([nothing], "j").missing == (nothing,)


def test_a_folder_without_cost_rows_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    got = job_cost([tmp_path / "empty"], "j")
    assert (got.cost_usd, got.rows, got.missing) == (0.0, 0, (str(tmp_path / "empty"),))


def test_a_cost_cap_is_on_the_streams_server_before_the_first_request_is_fed(redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "r0", "prompt": "p"}])
    job_id = submit_job(redis_client, src, tmp_path / "job", max_cost_usd=0.5).job_id
    assert float(redis_client.hget(keys.job_cost(job_id), "max_cost_usd")) == 0.5
    assert redis_client.hget(keys.job_key(job_id), "max_cost_usd") == b"0.5"
    assert not fed(redis_client)
    info = job_info(redis_client, job_id)
    assert info["max_cost_usd"] == 0.5 and "cost cap   $0.5 (--max-cost-usd)" in render_status(info)
    other = submit_job(redis_client, src, tmp_path / "free").job_id
    assert job_info(redis_client, other)["max_cost_usd"] is None
    assert "cost cap" not in render_status(job_info(redis_client, other))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--max-cost-usd"):
            submit_job(redis_client, src, tmp_path / f"bad{bad}", max_cost_usd=bad)
