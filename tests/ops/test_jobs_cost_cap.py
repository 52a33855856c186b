"""`mqinfer jobs submit --max-cost-usd`: a capped bulk job spends at most its cap plus the requests
in flight when it reached it, the rest get budget_exceeded rows, its status says so, and submitting
it again with a higher cap carries on without computing a finished request again. Real `mqinfer
jobs worker` and `mqinfer worker --model tiny` processes on the embedded server; the cap is an
eighth of what the same requests cost uncapped on this machine a moment before."""

from __future__ import annotations

import json

import pytest

from mqinfer.ops.job_carry_on import drop_rows, stopped_ids
from mqinfer.ops.job_spool import Spool
from mqinfer.schemas import keys
from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow, error_result_row, rows_to_table
from tests.helpers import rows, stop_processes, write_jsonl
from tests.ops.test_jobs_pipeline import Env, jobs_cli, output, start_inference, start_rq, wait_final

PRICE = 3600.0  # one USD per device-second
# At most 2 requests running and 2 waiting in the worker's engine: what can be in flight.
ENGINE = ("--price-per-device-hour", str(PRICE), "--max-num-seqs", "2", "--max-batch", "1")
IN_FLIGHT = 2 + 2
N = 16


@pytest.fixture(scope="module")
def env(redis_server, tmp_path_factory):
    client = redis_server.client()
    client.flushall()
    base = tmp_path_factory.mktemp("capped-jobs")
    worker = start_inference(redis_server.url, base / "wout", *ENGINE)
    rq = start_rq(redis_server.url, base / "rq.log")
    yield Env(redis_server.url, client, base)
    stop_processes(rq, worker)


def _submit(env: Env, src, out, *flags: str):
    done = jobs_cli("submit", str(src), "--out", str(out), "--redis", env.url, "--worker-out",
                    str(env.base / "wout"), "--max-in-flight", "8", *flags)
    return done


def _request_costs(env: Env, job_id: str) -> list[dict]:
    return [c for c in rows(env.base / "wout" / "costs") if c["job_id"] == job_id and c["kind"] == "request"]


def test_a_capped_job_stops_at_its_cap_and_carries_on_when_submitted_again(env):
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + (i + k) % 200 for k in range(48)], "max_tokens": 24,
              "temperature": 0, "ignore_eos": True} for i in range(N)]
    src = write_jsonl(env.base / "in.jsonl", items)
    free = _submit(env, src, env.base / "free")
    assert free.returncode == 0, free.stderr
    wait_final(env.client, free.stdout.strip(), timeout=300)
    cap = sum(c["cost_usd"] for c in _request_costs(env, free.stdout.strip())) / 8
    assert cap > 0

    out = env.base / "capped"
    first = _submit(env, src, out, "--max-cost-usd", repr(cap))
    assert first.returncode == 0, first.stderr
    job_id = first.stdout.strip()
    info = wait_final(env.client, job_id, timeout=300)
    assert info["status"] == "completed"
    results = {r["id"]: r for r in output(out)}
    assert len(results) == N  # every request has its row: none lost
    stopped = {rid for rid, r in results.items() if r["error_code"] == "budget_exceeded"}
    ran = {rid for rid, r in results.items() if r["finish_reason"] == "length"}
    assert stopped and ran and stopped | ran == set(results)
    assert all("cost cap" in results[rid]["error"] for rid in stopped)

    # The spend: the requests that ran, each once; when their running sum reached the cap, at most
    # the requests then in the engine were still running: they finish, nothing starts after them.
    costs = {c["id"]: c for c in _request_costs(env, job_id)}
    assert set(costs) >= ran and all(costs[rid]["cost_usd"] == 0.0 for rid in stopped if rid in costs)
    finished = sorted((costs[rid]["finished_at"].timestamp(), costs[rid]["cost_usd"]) for rid in ran)
    total, reached_at = 0.0, None
    for at, usd in finished:
        total += usd
        if reached_at is None and total >= cap:
            reached_at = at
    # (A cap reached only by the estimate of the requests in the engine stops the job earlier.)
    if reached_at is not None:
        assert len([at for at, _ in finished if at > reached_at]) <= IN_FLIGHT
    else:
        assert total < cap

    # Its status says so, in words and in JSON.
    status = jobs_cli("status", job_id, "--redis", env.url)
    assert f"failed {len(stopped)}" in status.stdout
    assert f"stopped    {len(stopped)} request" in status.stdout and "higher --max-cost-usd" in status.stdout
    described = json.loads(jobs_cli("status", job_id, "--redis", env.url, "--json").stdout)
    assert described["counts"]["budget_exceeded"] == len(stopped) and described["max_cost_usd"] == cap

    # Again, with a cap high enough: the same job carries on; the stopped requests run now, the
    # others keep their rows and are not computed again.
    again = _submit(env, src, out, "--max-cost-usd", repr(cap * 100))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == job_id
    assert f"carries on: {len(stopped)} requests a cost cap stopped run now" in again.stderr
    info = wait_final(env.client, job_id, timeout=300)
    assert info["status"] == "completed" and info["counts"]["budget_exceeded"] == 0
    results2 = {r["id"]: r for r in output(out)}
    assert len(results2) == N and all(r["finish_reason"] == "length" for r in results2.values())
    for rid in ran:
        assert results2[rid]["finished_at"] == results[rid]["finished_at"]
    assert sorted(c["id"] for c in _request_costs(env, job_id) if c["cost_usd"] > 0) == sorted(results2)
    assert float(env.client.hget(keys.job_cost(job_id), "max_cost_usd")) == cap * 100

    # Nothing is left to carry on: a third submission is refused with the reason.
    third = _submit(env, src, out, "--max-cost-usd", repr(cap * 100))
    assert third.returncode != 0 and "no request of it was stopped by a cost cap" in third.stderr


def _row(rid: str, code: str | None = None) -> ResultRow:
    if code is not None:
        return error_result_row(rid, "j", code, "stopped", model="tiny", worker="w", attempt=1, finished_at=1.0)
    return ResultRow(job_id="j", id=rid, model="tiny", finish_reason="length", prompt_tokens=1, output_tokens=1,
                     output_token_ids=[1], finished_at=1.0, worker="w")


def test_carrying_on_drops_only_the_rows_of_requests_that_never_ran(tmp_path):
    spool = Spool(tmp_path)
    # b was stopped, then ran on a retry (its row in another part); c was stopped only; d failed
    # otherwise and is not the cap's to run again.
    spool.write_rows_part("part-000000-a.parquet", rows_to_table(
        [_row("a"), _row("b", "budget_exceeded"), _row("c", "budget_exceeded")], RESULT_SCHEMA))
    spool.write_rows_part("part-000001-b.parquet", rows_to_table([_row("b"), _row("d", "internal_error")], RESULT_SCHEMA))
    parts = spool.existing_rows_parts()
    assert stopped_ids(spool, parts) == {"c"}
    kept = drop_rows(spool, parts, {"c"})
    assert kept == spool.existing_rows_parts() and "part-000001-b.parquet" in kept and len(kept) == 2
    assert sorted(spool.read_rows(kept, ["id"])["id"].to_pylist()) == ["a", "b", "b", "d"]
    assert stopped_ids(spool, kept) == set()
