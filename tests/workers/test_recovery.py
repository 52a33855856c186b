"""At-least-once delivery with real processes: a killed worker's entries move on; a live one's don't.

The SIGKILL case here is the long one (``-m slow``): 24 requests of 200 tokens and a kill at a
random point. Its short version runs by default in tests/faults/test_worker_crashes.py (a kill at a
fixed step mid-decode, then another worker takes over)."""

from __future__ import annotations


import pytest
import redis.exceptions

from mqinfer.schemas import keys
from mqinfer.client import Producer
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, start_worker, wait_exit, wait_until

STREAM = keys.request_stream("requests")


@pytest.mark.slow
def test_sigkill_mid_run_then_second_worker_finishes_every_request_once(redis_url, redis_client, tmp_path):
    n = 24
    Producer(redis_url).submit_many(
        {"id": f"k{i}", "prompt_token_ids": [256] + [65 + i % 20] * 8, "max_tokens": 200, "ignore_eos": True,
         "temperature": 0.0} for i in range(n)
    )
    out = tmp_path / "out"
    # A small running set keeps the first worker busy long enough to be killed mid-decode.
    first = start_worker(redis_url, out, "--max-num-seqs", "4", "--claim-idle-ms", "1000", "--flush-rows", "1")
    wait_until(lambda: redis_client.xpending(STREAM, keys.GROUP)["pending"] > 0, timeout=60, what="first reads")
    wait_until(lambda: len(rows(out / "results")) >= 2, timeout=120, what="some rows from the first worker")
    first.kill()
    first.wait()
    pending_after_kill = redis_client.xpending(STREAM, keys.GROUP)["pending"]
    assert pending_after_kill > 0  # it died holding entries

    second = start_worker(redis_url, out, "--claim-idle-ms", "1000", "--idle-exit-s", "3")
    code, err = wait_exit(second, timeout=240)
    assert code == 0, err
    assert redis_client.xpending(STREAM, keys.GROUP)["pending"] == 0

    compact = zygote.run(mqinfer_cmd("compact", str(out)), capture_output=True, text=True)
    assert compact.returncode == 0, compact.stderr
    result_ids = [r["id"] for r in rows(out / "results")]
    assert sorted(result_ids) == sorted(f"k{i}" for i in range(n))  # every id exactly once
    finished = {r["id"]: r for r in rows(out / "results")}
    assert all(r["output_tokens"] == 200 and r["finish_reason"] == "length" for r in finished.values())
    # Requests the second worker took over count a second delivery.
    assert any(r["attempt"] == 2 for r in finished.values())


def test_long_request_is_not_taken_from_its_live_worker(redis_url, redis_client, tmp_path):
    out = tmp_path / "out"
    a = start_worker(redis_url, out, "--claim-idle-ms", "300", "--idle-exit-s", "3", "--consumer", "A")
    b = start_worker(redis_url, out, "--claim-idle-ms", "300", "--idle-exit-s", "3", "--consumer", "B")

    def both_reading():
        try:
            names = {c["name"] for c in redis_client.xinfo_consumers(STREAM, keys.GROUP)}
        except redis.exceptions.ResponseError:  # no stream or group yet
            return False
        return {"A", "B"} <= {n.decode() if isinstance(n, bytes) else n for n in names}

    wait_until(both_reading, timeout=90, what="both workers reading")
    # A thousand decode steps: seconds, many times the 300 ms claim idle time.
    Producer(redis_url).submit({"id": "long", "prompt_token_ids": [256, 66], "max_tokens": 1000,
                                "ignore_eos": True, "temperature": 0.0})
    code_a, err_a = wait_exit(a, timeout=240)
    code_b, err_b = wait_exit(b, timeout=240)
    assert code_a == 0, err_a
    assert code_b == 0, err_b
    result = rows(out / "results")
    assert len(result) == 1, result  # no second computation, even before compaction
    row = result[0]
    assert row["attempt"] == 1 and row["worker"] in ("A", "B")
    assert row["output_tokens"] == 1000
    assert row["finished_at"].timestamp() - row["started_at"].timestamp() > 1.0
