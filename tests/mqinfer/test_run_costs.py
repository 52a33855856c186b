"""The bill of `mqinfer run` adds up to the machine: its cost rows of every kind add up to the wall
time from its first worker's start to its last worker's exit, times the devices (a CPU machine is
one), times the price; whatever the layout, and when a worker is killed mid-run.

Each layout is a real run of the built-in tiny model. What is checked against what the run did not
compute itself: the window it records lies within the test's own clock readings around the run,
every row of every worker lies within the window, no worker bills more than its share of the
machine (its rows add up to its uptime times its share), and the workers' shares together never
exceed the one device."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from mqinfer.machine import RUN_WORKER, machine_records, worker_shares
from mqinfer.ops.compact import compact
from mqinfer.workers.devices import usable_cores
from tests import zygote
from tests.helpers import clean_env, rows, wait_until, write_jsonl

PRICE = 36.0  # USD per device-hour: 0.01 USD per device-second
CORES = usable_cores()


def run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mqinfer", "run", *args]


def run_env() -> dict:
    """No MQINFER_* settings and no OMP_NUM_THREADS from the test's environment: each test's flags
    are the whole layout."""
    return clean_env("OMP_NUM_THREADS")


def requests(n: int, max_tokens: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt_token_ids": [5 + i % 50, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True} for i in range(n)]


def job_id_of(out: Path) -> str:
    (job,) = {r["job_id"] for r in rows(out / "results")}
    return job


def check_machine_bill(out: Path, began: float, ended: float) -> dict:
    """The run's cost rows add up to its window times its devices (1%), and so does cost_usd at the
    price; the workers' rows are each their uptime times their share and lie within the window.
    Returns the run's record with the workers' shares (``shares``: worker -> share)."""
    (record,) = machine_records(out / ".mqinfer", job_id_of(out))
    assert began <= record["started_at"] < record["ended_at"] <= ended
    wall, devices = record["wall_s"], record["devices"]
    assert devices == 1.0  # a CPU machine is one device
    costs = rows(out / "costs")
    total = sum(c["device_s"] for c in costs)
    assert total == pytest.approx(wall * devices, rel=0.01)
    assert sum(c["cost_usd"] for c in costs) == pytest.approx(wall * devices * PRICE / 3600, rel=0.01)
    assert all(c["price_per_device_hour"] == PRICE for c in costs)

    by_worker = defaultdict(list)
    for c in costs:
        by_worker[c["worker"]].append(c)
    ours = by_worker.pop(RUN_WORKER, [])
    shares, spans = {}, {}
    for worker, mine in by_worker.items():
        (share,) = {c["device_share"] for c in mine}
        (startup,) = [c for c in mine if c["kind"] == "startup"]
        begin = startup["finished_at"].timestamp() - startup["device_s"] / share
        end = max(c["finished_at"].timestamp() for c in mine)
        assert record["started_at"] - 0.02 <= begin and end <= record["ended_at"], worker
        if not any(c["kind"] == "lost" for c in mine):  # a killed worker's rows end at its last beat
            assert sum(c["device_s"] for c in mine) == pytest.approx((end - begin) * share, rel=0.005), worker
        shares[worker] = share
        spans[worker] = (begin, end)
    # Together the workers alive at any one time hold at most the machine (a worker the run started
    # again after one died takes the dead one's place).
    for at in (begin for begin, _ in spans.values()):
        alive = [shares[w] for w, (b, e) in spans.items() if b <= at < e]
        assert sum(alive) <= 1.0 + 1e-9, (at, spans, shares)
    # The run's own row: what no worker covered, and nothing more.
    workers_s = sum(c["device_s"] for mine in by_worker.values() for c in mine)
    assert workers_s <= wall * devices * 1.001
    assert [(c["kind"], c["job_id"], c["id"]) for c in ours] == [("idle", None, None)] * len(ours) and len(ours) <= 1
    if ours:
        (idle,) = ours
        assert idle["device_s"] == pytest.approx(wall * devices - workers_s, abs=1e-6)
        assert idle["device_share"] == pytest.approx(idle["device_s"] / wall)
        assert 0 < idle["device_share"] <= devices
    return {**record, "shares": shares}


def run_job(tmp_path: Path, name: str, items: list[dict], *flags: str, env: dict | None = None):
    out = tmp_path / name
    src = write_jsonl(tmp_path / f"{name}.jsonl", items)
    began = time.time()
    proc = zygote.run(run_cmd(str(src), "--out", str(out), "--price-per-device-hour", str(PRICE), *flags),
                      env=env or run_env(), capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows(out / "results")) == len(items)
    return out, began, ended, proc


def test_one_worker_with_every_core_bills_the_machine(tmp_path):
    out, began, ended, proc = run_job(tmp_path, "one", requests(24, 48), "--workers", "1")
    record = check_machine_bill(out, began, ended)
    (share,) = record["shares"].values()
    assert share == 1.0  # its threads default to every usable core
    # The summary line says what the machine was billed.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("machine: "))
    assert f"{record['wall_s']:.1f}s x 1 device = {record['billed_device_s']:.1f} device-seconds billed" in line


def test_two_workers_of_one_thread_bill_what_one_worker_of_two_threads_bills(tmp_path):
    items = requests(24, 48)
    two, began, ended, _ = run_job(tmp_path, "two", items, "--workers", "2", "--num-threads", "1")
    two_record = check_machine_bill(two, began, ended)
    one, began, ended, _ = run_job(tmp_path, "one", items, "--workers", "1", "--num-threads", "2")
    one_record = check_machine_bill(one, began, ended)
    assert sorted(two_record["shares"].values()) == [pytest.approx(min(1 / CORES, 0.5))] * 2
    assert list(one_record["shares"].values()) == [pytest.approx(min(2 / CORES, 1.0))]
    # Both bill the machine's seconds: the old rule (every worker a whole device) billed the two
    # workers about twice the machine.
    for record in (two_record, one_record):
        assert record["billed_device_s"] == pytest.approx(record["wall_s"], rel=0.01)
        assert record["workers_device_s"] <= record["wall_s"] * 1.001


def test_workers_auto_bills_the_machine(tmp_path):
    out, began, ended, proc = run_job(tmp_path, "auto", requests(24, 48), "--workers", "auto")
    record = check_machine_bill(out, began, ended)
    workers = int(re.search(r"^(\d+) workers? x ", proc.stderr, re.M).group(1))  # "2 workers x 1 thread (...)"
    assert len(record["shares"]) == workers
    assert all(s == pytest.approx(min(1 / CORES, 1 / workers)) for s in record["shares"].values())


def test_a_worker_killed_mid_run_is_billed_as_lost_and_the_bill_still_adds_up(tmp_path):
    items = requests(24, 160)
    out = tmp_path / "killed"
    src = write_jsonl(tmp_path / "killed.jsonl", items)
    began = time.time()
    proc = zygote.popen(run_cmd(str(src), "--out", str(out), "--price-per-device-hour", str(PRICE),
                                "--workers", "2", "--num-threads", "1", "--claim-idle-ms", "1000",
                                "--max-num-seqs", "4", "--flush-rows", "1"),
                        env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(rows(out / "results")) >= 6, timeout=180, what="the first rows")
        children = json.loads((out / ".mqinfer" / "run.lock").read_text())["children"]
        doomed = children[0]
        os.kill(doomed, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.time()
    assert proc.returncode == 0, stderr[-3000:]
    assert sorted(r["id"] for r in rows(out / "results")) == sorted(r["id"] for r in items)
    # It died holding requests: the run made them claimable at once and started a worker in its place.
    assert f"(pid {doomed}) died (signal SIGKILL)" in stderr and "started worker" in stderr, stderr[-3000:]
    compact(out)  # the run compacted before its own row; compacting again changes no sum
    record = check_machine_bill(out, began, ended)
    name = next(w for w in record["shares"] if w.startswith(f"{socket.gethostname()}-{doomed}-"))
    lost = [c for c in rows(out / "costs") if c["kind"] == "lost"]
    assert [c["worker"] for c in lost] == [name]  # billed once, by the survivor or by the run
    assert lost[0]["device_share"] == record["shares"][name] and lost[0]["device_s"] > 0


def test_each_worker_of_a_run_gets_its_share_of_the_machine(tmp_path):
    from mqinfer.cli import build_parser
    from mqinfer.config import resolve
    from mqinfer.run import worker_argv

    def opts(*flags):
        args = build_parser().parse_args(["run", "in.jsonl", "--out", str(tmp_path), *flags])
        return resolve(args, args._options, {}, args._required)

    def cpu(n, *flags, cores):
        return worker_shares({**opts(*flags), "workers": n}, [("cpu", None)] * n, cores=cores)

    assert cpu(2, "--num-threads", "1", cores=2) == ([0.5, 0.5], 1.0)
    assert cpu(1, "--num-threads", "1", cores=2) == ([0.5], 1.0)  # the other core is the run's idle row
    assert cpu(1, "--num-threads", "4", cores=2) == ([1.0], 1.0)  # at most the machine
    assert cpu(3, "--num-threads", "2", cores=4) == ([pytest.approx(1 / 3)] * 3, 1.0)  # oversubscribed: equal
    assert cpu(2, "--num-threads", "1", "--tensor-parallel-size", "2", cores=8) == ([0.25, 0.25], 1.0)
    assert cpu(2, "--num-threads", "1", "--device-share", "0.7", cores=2) == ([None, None], 1.0)  # the user's
    # CUDA: a device per rank, split between the workers placed on it.
    cuda = [("cuda:0", None), ("cuda:1", None), ("cuda:0", None)]
    assert worker_shares(opts("--workers", "3"), cuda, cuda_count=2) == ([0.5, 1.0, 0.5], 2.0)
    assert worker_shares(opts("--workers", "2", "--tensor-parallel-size", "2"),
                         [("cuda:0", "0,1"), ("cuda:2", "2,3")], cuda_count=4) == ([2.0, 2.0], 4.0)
    argv = worker_argv(opts("--workers", "2"), tmp_path, 0, "requests", ("cpu", None), device_share=0.5)
    assert argv[argv.index("--device-share") + 1] == "0.5"
    argv = worker_argv(opts("--device-share", "0.7"), tmp_path, 0, "requests", ("cpu", None), device_share=None)
    assert argv[argv.index("--device-share") + 1] == "0.7"
