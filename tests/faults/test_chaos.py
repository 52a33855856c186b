"""The long version: random faults at random times on a bigger job, then exactly once.

Workers come and go while the job runs: each may start with a fault point armed at a random hit,
and every second or two one of them is sent SIGKILL, SIGTERM or SIGSTOP (resumed after the claim
idle time). At the end a clean worker finishes what is left; compaction must leave every request
exactly once, and no worker may have exited in a way no fault explains (a crash).
``MQINFER_CHAOS_S`` (seconds of faults, default 60) and ``MQINFER_CHAOS_SEED`` size and pin a run.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from mqinfer.schemas import lanes
from tests.faults.faultkit import compact_and_check, pending_by_consumer, record, spawn, submit
from tests.helpers import rows

# Exit codes a fault explains: drained or idle (0), rows unwritable (3), killed (-9), and SIGTERM
# while Python has no handler for it (still importing, or already shutting down: -15), which is a
# kill like -9 for what the worker leaves behind. Anything else (1, 2: an exception) is a crash.
EXPLAINED = {0, 3, -signal.SIGKILL, -signal.SIGTERM}
TENANTS = ["default", "t1", "t2", "t3"]
FAULTS = [None, None, "worker.after_step=kill@{n}", "sink.after_write=kill@{k}", "sink.results.before_rename=kill@{k}",
          "sink.costs.before_rename=kill@{k}", "sink.results.before_rename=enospc@{k}"]


@pytest.mark.slow
def test_random_faults_on_a_long_job_still_give_every_request_exactly_once(redis_url, redis_client, tmp_path):
    seed = int(os.environ.get("MQINFER_CHAOS_SEED", str(int(time.time()))))
    duration = float(os.environ.get("MQINFER_CHAOS_S", "60"))
    rng = random.Random(seed)
    # Four tenants: three lanes and the plain stream (the default tenant's), so faults hit lanes too.
    items = [{"id": f"c{i}", "job_id": "chaos", "prompt_token_ids": [256] + [65 + i % 26] * rng.randint(1, 40),
              "max_tokens": rng.randint(4, 96), "ignore_eos": True, "temperature": 0.0, "tenant": TENANTS[i % 4]}
             for i in range(200)]
    expected = submit(redis_url, items)
    out = tmp_path / "out"
    live, exits, faults_sent, counter, born = [], [], [], 0, {}
    common = ("--claim-idle-ms", "1000", "--max-num-seqs", "16", "--flush-rows", str(rng.choice([1, 8, 64])))

    def start():
        nonlocal counter
        counter += 1
        fault = rng.choice(FAULTS)
        fault = fault.format(n=rng.randint(1, 400), k=rng.randint(1, 6)) if fault else None
        live.append(spawn(redis_url, out, f"w{counter}", *common, faults=fault))
        born[f"w{counter}"] = time.monotonic()

    def reap():
        for w in list(live):
            if w.proc.poll() is not None:
                code = w.proc.returncode
                exits.append((w.name, code))
                assert code in EXPLAINED, f"worker {w.name} crashed ({code}):\n{w.log()}"
                w.close()
                live.remove(w)

    try:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            reap()
            while len(live) < 3:
                start()
            time.sleep(rng.uniform(1.0, 3.0))  # a random time between faults: the test's point
            # Mostly workers past their start (a few seconds of imports), so that faults hit work.
            started = [w for w in live if time.monotonic() - born[w.name] > 4.0]
            victim = rng.choice(started if started and rng.random() < 0.9 else live)
            action = rng.choice(["kill", "kill", "term", "stop"])
            faults_sent.append(action)
            if action == "kill":
                victim.kill()
            elif action == "term":
                victim.signal(signal.SIGTERM)
                victim.proc.wait(timeout=60)
            else:
                victim.signal(signal.SIGSTOP)
                time.sleep(1.5)  # stopped past the claim idle time on purpose: others take its entries over
                victim.signal(signal.SIGCONT)
        for w in live:
            w.signal(signal.SIGTERM)
            w.proc.wait(timeout=120)
        reap()
        final = spawn(redis_url, out, "final", "--claim-idle-ms", "1000", "--idle-exit-s", "3")
        assert final.wait(timeout=600) == 0, final.log()
    finally:
        for w in live:
            w.kill()
    for stream in lanes.stream_keys(redis_client, "requests"):
        assert pending_by_consumer(redis_client, stream) == {}, stream
    rows_before = len(rows(out / "results"))
    outcome = compact_and_check(out, expected, redis_client)
    record(f"chaos: random faults for {duration:.0f} s (seed {seed})", submitted=len(expected),
           rows_before=rows_before, rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed,
           worker_crashes=0, workers_started=counter + 1, signals=len(faults_sent),
           exits={str(code): sum(1 for _, c in exits if c == code) for code in sorted({c for _, c in exits})})
