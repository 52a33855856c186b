"""Bulk jobs end to end: real `mqinfer jobs worker` (rq) and `mqinfer worker --model tiny` processes
on the embedded server, one long-lived pair for all jobs of this module (several run at once).
The helpers here also serve test_jobs_recovery.py."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mqinfer.ops.jobs import job_info, parse_deadline, submit_job
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, stop_processes, wait_until, write_jsonl

FINAL = ("completed", "failed", "cancelled", "expired")
WORKER_FLAGS = ("--num-kv-blocks", "512", "--claim-idle-ms", "1000", "--max-wait-ms", "5",
                "--flush-interval-s", "0.1")


JOBS = mqinfer_cmd("jobs")


def jobs_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return zygote.run([*JOBS, *args], capture_output=True, text=True, timeout=timeout,
                      env=dict(os.environ, MQINFER_LOG_LEVEL="warning"))


def start(cmd: list[str], log: Path, *, forked: bool = False) -> subprocess.Popen:
    """``cmd`` with its output in ``log``; ``forked``: from the test zygote (tests/zygote.py)."""
    env = dict(os.environ, MQINFER_LOG_LEVEL="warning")
    with open(log, "ab") as f:
        return (zygote.popen if forked else subprocess.Popen)(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                                              stderr=subprocess.STDOUT)


def start_inference(url: str, out: Path, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return start(mqinfer_cmd("worker", "--redis", url, "--out", str(out), *WORKER_FLAGS, *extra),
                 out.parent / f"{out.name}.log", forked=True)


def start_rq(url: str, log: Path, *extra: str) -> subprocess.Popen:
    return start([*JOBS, "worker", "--redis", url, "--sweep-interval-s", "0.5", *extra], log)


def wait_final(client, job_id: str, timeout: float = 120, statuses=FINAL) -> dict:
    def final():
        info = job_info(client, job_id)
        return info if info["status"] in statuses else None

    return wait_until(final, timeout=timeout, interval=0.2, what=f"job {job_id} to reach {statuses}")


def output(out: Path) -> list[dict]:
    return pq.read_table(out / "output.parquet").to_pylist()


def native(n: int, prefix: str = "r", **fields) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": f"prompt {i}", "temperature": 0.0, **fields} for i in range(n)]


@dataclass
class Env:
    url: str
    client: object
    base: Path


@pytest.fixture(scope="module")
def env(redis_server, tmp_path_factory):
    client = redis_server.client()
    client.flushall()
    base = tmp_path_factory.mktemp("jobs")
    worker = start_inference(redis_server.url, base / "wout")
    # Two rq workers: a job's tasks may run on either, never on both at once.
    rqs = [start_rq(redis_server.url, base / f"rq{i}.log") for i in range(2)]
    yield Env(redis_server.url, client, base)
    stop_processes(*rqs, worker)
    client.close()


# -- ordinary jobs ---------------------------------------------------------------------------
def test_happy_path_in_input_order_through_the_cli(env):
    items = native(10, max_tokens=4)
    items[7]["prompt"] = items[2]["prompt"]  # same prompt, greedy: same tokens
    src = write_jsonl(env.base / "happy.jsonl", items)
    out = env.base / "happy"
    done = jobs_cli("submit", str(src), "--out", str(out), "--redis", env.url, "--max-in-flight", "4",
                    "--chunk-size", "3", "--worker-out", str(env.base / "wout"))
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.startswith("job-")
    watched = jobs_cli("status", job_id, "--redis", env.url, "--watch", "--interval", "0.2")
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert f"job {job_id}: completed" in watched.stdout
    assert "total 10: completed 10, failed 0" in watched.stdout

    got = output(out)
    assert [r["id"] for r in got] == [f"r{i}" for i in range(10)]
    assert all(r["job_id"] == job_id and r["finish_reason"] in ("length", "stop") for r in got)
    assert all(1 <= r["output_tokens"] <= 4 and r["model"].startswith("tiny") for r in got)
    assert got[7]["output_token_ids"] == got[2]["output_token_ids"]
    assert not (out / "output.jsonl").exists()  # native input: no OpenAI files

    info = json.loads(jobs_cli("status", job_id, "--redis", env.url, "--json").stdout)
    assert info["counts"]["total"] == 10 and info["counts"]["completed"] == 10
    assert info["counts"]["fed"] == 10 and info["counts"]["skipped"] == 0
    assert info["tokens"]["output"] == sum(r["output_tokens"] for r in got)
    assert info["outputs"]["parquet"] == str(out / "output.parquet")
    # The job's cost is its cost rows' (the real worker's), read by its last task.
    costs = [c for c in rows(env.base / "wout" / "costs") if c["job_id"] == job_id]
    assert len(costs) == 10 and info["cost"]["source"] == "cost_rows" and info["cost"]["rows"] == 10
    assert info["cost_usd"] == pytest.approx(sum(c["cost_usd"] for c in costs)) and info["cost_usd"] > 0
    listed = jobs_cli("list", "--redis", env.url)
    assert job_id in listed.stdout and "completed" in listed.stdout


def test_bad_lines_are_reported_and_get_error_rows(env):
    lines = [
        {"id": "ok0", "prompt": "a", "max_tokens": 2},
        "{this is not json",
        {"id": "neg", "prompt": "a", "max_tokens": -3},
        {"prompt": "no id at all"},
        "",
        {"id": "ok0", "prompt": "repeated id"},
        {"id": "ok1", "prompt": "b", "max_tokens": 2},
    ]
    src = write_jsonl(env.base / "bad.jsonl", lines)
    out = env.base / "bad"
    job_id = submit_job(env.client, src, out).job_id
    info = wait_final(env.client, job_id)
    assert info["status"] == "completed"
    assert info["counts"]["total"] == 6 and info["counts"]["invalid"] == 4 and info["counts"]["failed"] == 4
    assert [e["line"] for e in info["errors"]] == [2, 3, 4]
    got = output(out)
    assert [(r["id"], r["finish_reason"], r["error_code"]) for r in got] == [
        ("ok0", "length", None), ("line:2", "error", "invalid_json"), ("neg", "error", "invalid_request"),
        ("line:4", "error", "invalid_request"), ("ok0", "error", "invalid_request"), ("ok1", "length", None)]
    assert got[2]["error"].startswith("line 3: ") and "max_tokens" in got[2]["error"]
    assert "repeats line 1" in got[4]["error"]


def _openai_line(cid: str, prompt: str, max_tokens: int, chat: bool = False, **body) -> dict:
    if chat:
        payload = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        url = "/v1/chat/completions"
    else:
        payload = {"prompt": prompt, "max_tokens": max_tokens}
        url = "/v1/completions"
    payload.update({"temperature": 0, **body})
    return {"custom_id": cid, "method": "POST", "url": url, "body": payload}


def test_openai_batch_files_match_custom_ids_that_repeat_another_jobs(env):
    first = write_jsonl(env.base / "oa1.jsonl", [_openai_line("a", "one", 3), _openai_line("b", "two", 3),
                                                 _openai_line("c", "three", 3)])
    second = write_jsonl(env.base / "oa2.jsonl", [
        _openai_line("a", "four", 5), _openai_line("b", "five", 5, chat=True),
        _openai_line("c", "six", 5, best_of=2), "[1, 2]"])
    job1 = submit_job(env.client, first, env.base / "oa1").job_id
    job2 = submit_job(env.client, second, env.base / "oa2").job_id
    info1, info2 = wait_final(env.client, job1), wait_final(env.client, job2)
    assert info1["status"] == info2["status"] == "completed"
    assert info1["format"] == info2["format"] == "openai"

    def read(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    ok1 = read(env.base / "oa1" / "output.jsonl")
    assert [o["custom_id"] for o in ok1] == ["a", "b", "c"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in ok1)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in ok1)
    assert all(o["response"]["body"]["object"] == "text_completion" for o in ok1)
    assert read(env.base / "oa1" / "errors.jsonl") == []

    ok2 = read(env.base / "oa2" / "output.jsonl")
    assert [o["custom_id"] for o in ok2] == ["a", "b"]
    assert ok2[0]["response"]["body"]["usage"]["completion_tokens"] == 5
    chat = ok2[1]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] == output(env.base / "oa2")[1]["text"]
    errs = read(env.base / "oa2" / "errors.jsonl")
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [("c", "unsupported_parameter"),
                                                                     (None, "invalid_request")]
    assert "body.best_of" in errs[0]["error"]["message"]
    # The same custom_id in two jobs is two requests, each answered in its own job.
    rows1, rows2 = output(env.base / "oa1"), output(env.base / "oa2")
    assert {r["job_id"] for r in rows1} == {job1} and {r["job_id"] for r in rows2} == {job2}
    assert rows1[0]["output_tokens"] == 3 and rows2[0]["output_tokens"] == 5


def test_small_job_finishes_first_then_the_big_one_is_cancelled(env):
    big_src = write_jsonl(env.base / "big.jsonl", native(16, "big", max_tokens=48, ignore_eos=True))
    big = submit_job(env.client, big_src, env.base / "big", max_in_flight=2).job_id
    wait_until(lambda: job_info(env.client, big)["counts"]["fed"] >= 2, timeout=60, what="big job feeding")
    small_src = write_jsonl(env.base / "small.jsonl", native(2, "small", max_tokens=2))
    small = submit_job(env.client, small_src, env.base / "small").job_id
    info_small = wait_final(env.client, small, timeout=90)
    assert info_small["status"] == "completed"
    big_now = job_info(env.client, big)
    assert big_now["status"] == "in_progress" and big_now["counts"]["completed"] < 16

    wait_until(lambda: job_info(env.client, big)["counts"]["completed"] >= 1, timeout=90, what="a big row")
    cancelled = jobs_cli("cancel", big, "--redis", env.url)
    assert cancelled.returncode == 0 and "cancelling" in cancelled.stdout
    info = wait_final(env.client, big, timeout=90)
    assert info["status"] == "cancelled"
    got = output(env.base / "big")
    assert [r["id"] for r in got] == [f"big{i}" for i in range(16)]
    reasons = [r["finish_reason"] for r in got]
    assert set(reasons) <= {"length", "cancelled"}
    finished = reasons.count("length")
    assert 1 <= finished < 16 and reasons.count("cancelled") == 16 - finished
    assert all(r["output_tokens"] == 48 for r in got if r["finish_reason"] == "length")
    assert info["counts"]["completed"] == finished and info["counts"]["cancelled"] == 16 - finished
    assert info["counts"]["fed"] < 16  # feeding stopped at the cancel
    assert jobs_cli("cancel", big, "--redis", env.url).returncode == 0  # already cancelled: a no-op


def test_deadline_expires_the_job_and_keeps_finished_rows(env):
    items = native(2, "quick", max_tokens=2) + native(6, "slow", max_tokens=2000, ignore_eos=True)
    src = write_jsonl(env.base / "exp.jsonl", items)
    job_id = submit_job(env.client, src, env.base / "exp", max_in_flight=4, deadline=parse_deadline("+5")).job_id
    info = wait_final(env.client, job_id, timeout=90)
    assert info["status"] == "expired"
    got = output(env.base / "exp")
    assert [r["id"] for r in got] == [f"quick{i}" for i in range(2)] + [f"slow{i}" for i in range(6)]
    assert [(r["finish_reason"], r["output_tokens"]) for r in got[:2]] == [("length", 2), ("length", 2)]
    slow = [(r["finish_reason"], r["output_tokens"]) for r in got[2:]]
    # A slow request either finished in time or expired (a running one keeps what it generated).
    assert all(reason == "expired" or (reason, tokens) == ("length", 2000) for reason, tokens in slow), slow
    assert [reason for reason, _ in slow[2:]] == ["expired"] * 4, slow  # started late or never
    assert info["counts"]["expired"] == sum(reason == "expired" for reason, _ in slow)
    assert info["ended_at"] < info["deadline"] + 30
