"""Many worker processes on one stream: every request done once, shared fairly by the workers
joining as the test goes, then scale-down with SIGTERM losing nothing.

Each test runs in phases, so that its worker processes are started once (each start costs seconds
of CPU on a small machine): each phase submits its own job and waits for all its rows. The default
run grows from one worker to two and scales down to one; ``-m slow`` grows to four and scales down
to two.
"""

from __future__ import annotations

import collections
import signal

import pytest
import redis.exceptions

from mqinfer.schemas import keys
from mqinfer.client import Producer
from tests.helpers import blocked_in, rows, start_worker, wait_exit, wait_until

STREAM = keys.request_stream("requests")


def _consumers(client) -> set[str]:
    try:
        infos = client.xinfo_consumers(STREAM, keys.GROUP)
    except redis.exceptions.ResponseError:  # no stream or group yet
        return set()
    return {c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in infos}


def _submit(redis_url: str, job: str, n: int, max_tokens: int) -> None:
    Producer(redis_url).submit_many(
        ({"id": f"{job}-{i}", "prompt_token_ids": [256] + [65 + i % 26] * 6, "max_tokens": max_tokens,
          "ignore_eos": True, "temperature": 0.0} for i in range(n)), job_id=job)


def _wait_job(redis_client, job: str, n: int, timeout: float = 180) -> None:
    key = keys.job_done_set("requests", job)
    wait_until(lambda: redis_client.scard(key) >= n, timeout=timeout, what=f"every row of {job}")


def _share_then_scale_down(redis_url, redis_client, out, plan: list[tuple[str, list[str]]], leaving: list[str]):
    """Workers join per ``plan`` (job name, newcomers), each job shared by every worker so far;
    then ``leaving`` get SIGTERM while a longer job runs, and the others finish it."""
    # At most four requests run per worker, and a worker reads what it can start plus a short
    # waiting queue, within its fair share of the backlog: the rest stays in the stream for
    # whichever worker has room. A short drain makes SIGTERM hand work back.
    args = ("--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-interval-s", "0.1",
            "--drain-timeout-s", "0.2")
    workers = {}

    def join(*names: str) -> None:
        for name in names:
            workers[name] = start_worker(redis_url, out, "--consumer", name, *args)
        # A worker joins the group before its model loads; it reads once loaded, and a job
        # submitted before then would go to the others by design.
        wait_until(lambda: _consumers(redis_client) >= set(workers)
                   and blocked_in(redis_client, "xreadgroup") >= len(workers), timeout=120,
                   what="every worker reading")

    n = 24
    try:
        for job, newcomers in plan:
            join(*newcomers)
            _submit(redis_url, job, n, max_tokens=24)
            _wait_job(redis_client, job, n)

        # Scale down while a longer job runs.
        _submit(redis_url, "down", n, max_tokens=96)
        wait_until(lambda: sum(r["job_id"] == "down" for r in rows(out / "results")) >= 4, timeout=120,
                   what="the last job under way")
        for name in leaving:
            workers[name].send_signal(signal.SIGTERM)
        for name in leaving:
            code, err = wait_exit(workers.pop(name), timeout=60)
            assert code == 0, err
            # What it held and did not finish went back: nothing stays pending under its name.
            assert redis_client.xpending_range(STREAM, keys.GROUP, "-", "+", 10, consumername=name) == []
        _wait_job(redis_client, "down", n)
    finally:
        for w in workers.values():
            w.send_signal(signal.SIGTERM)
    for w in workers.values():
        code, err = wait_exit(w, timeout=60)
        assert code == 0, err

    results = rows(out / "results")
    by_job = collections.defaultdict(list)
    for r in results:
        by_job[r["job_id"]].append(r)
    active, joined = {}, set()
    for job, newcomers in plan:
        joined = joined | set(newcomers)
        active[job] = joined
    for job, members in active.items():
        got = by_job[job]
        assert sorted(r["id"] for r in got) == sorted(f"{job}-{i}" for i in range(n))  # once each
        assert all(r["output_tokens"] == 24 and r["attempt"] == 1 for r in got)
        per_worker = collections.Counter(r["worker"] for r in got)
        assert set(per_worker) == members, (job, per_worker)  # nobody idled
        assert min(per_worker.values()) >= n / len(members) / 2, (job, per_worker)
    down = by_job["down"]
    assert sorted(r["id"] for r in down) == sorted(f"down-{i}" for i in range(n))  # no loss, no duplicate
    assert all(r["output_tokens"] == 96 for r in down)
    per_worker = collections.Counter(r["worker"] for r in down)
    assert all(per_worker[name] > 0 for name in joined - set(leaving)), per_worker  # those staying took over
    assert redis_client.xlen(STREAM) == 0
    assert redis_client.xpending(STREAM, keys.GROUP)["pending"] == 0


def test_one_then_two_workers_share_a_stream_fairly_and_scale_down(redis_url, redis_client, tmp_path):
    _share_then_scale_down(redis_url, redis_client, tmp_path / "out", [("one", ["w0"]), ("two", ["w1"])],
                           leaving=["w0"])


@pytest.mark.slow
def test_one_two_then_four_workers_share_a_stream_fairly_and_scale_down(redis_url, redis_client, tmp_path):
    _share_then_scale_down(redis_url, redis_client, tmp_path / "out",
                           [("one", ["w0"]), ("two", ["w1"]), ("four", ["w2", "w3"])], leaving=["w0", "w1"])
