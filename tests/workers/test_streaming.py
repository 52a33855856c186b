"""Token streaming end to end through a real server and real worker processes: deltas as they are
generated, a final message equal to the Parquet row, and a restart when another worker takes over."""

from __future__ import annotations

import os
import subprocess

from mqinfer.client import Client, Delta, Final, Restart
from mqinfer.schemas.rows import RESULT_SCHEMA, rows_to_table
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, start_worker, wait_exit



def _as_parquet_row(row) -> dict:
    """What the results dataset holds for a ResultRow (timestamps in microseconds, UTC)."""
    return rows_to_table([row], RESULT_SCHEMA).to_pylist()[0]


def _stored(row: dict) -> dict:
    """A results dataset row without its hive partition column."""
    return {k: v for k, v in row.items() if k != "date"}


def _check_deltas(deltas: list[Delta], row) -> None:
    position = 0
    for d in deltas:
        assert d.index == position, (d, position)
        position += len(d.token_ids)
    assert [t for d in deltas for t in d.token_ids] == row.output_token_ids
    assert "".join(d.text for d in deltas) == row.text


def test_tokens_stream_as_generated_and_the_final_row_equals_the_parquet_row(redis_url, redis_client, tmp_path):
    out = tmp_path / "out"
    worker = start_worker(redis_url, out, "--idle-exit-s", "2", "--flush-interval-s", "0.05")
    requests = [
        # temperature 1 over a byte vocabulary: multi-byte characters come up, split over tokens
        {"id": f"s{i}", "prompt": "héllo", "max_tokens": 48, "temperature": 1.0, "seed": i, "ignore_eos": True}
        for i in range(4)
    ] + [
        {"id": "lp", "prompt_token_ids": [256, 72, 105], "max_tokens": 6, "logprobs": 2, "temperature": 0.0},
        # this seed's output reaches an "e" at its 23rd token: the text ends before the stop string
        {"id": "stop", "prompt": "abc", "max_tokens": 40, "temperature": 1.0, "seed": 9, "stop": ["e"]},
    ]
    with Client(redis_url) as client:
        client.submit_many(requests)
        streams = {r["id"]: list(client.stream(r["id"], timeout=120)) for r in requests}
        reply_ttl = redis_client.ttl(client.reply_to)
    code, err = wait_exit(worker)
    assert code == 0, err

    parquet = {r["id"]: _stored(r) for r in rows(out / "results")}
    multibyte = 0
    for rid, events in streams.items():
        assert isinstance(events[-1], Final) and not any(isinstance(e, Restart) for e in events)
        deltas = events[:-1]
        assert all(isinstance(d, Delta) and d.attempt == 1 for d in deltas)
        row = events[-1].row
        _check_deltas(deltas, row)
        assert _as_parquet_row(row) == parquet[rid]
        if rid in ("s0", "s1", "s2", "s3"):
            # A message per step, one byte token each: a character of several bytes spans several
            # messages, yet the texts concatenate to the final text, so none was split.
            assert len(deltas) == 48 and all(len(d.token_ids) == 1 for d in deltas)
            multibyte += sum(1 for c in row.text if ord(c) > 127 and c != "\ufffd")
    assert multibyte > 0
    stop = parquet["stop"]
    assert stop["finish_reason"] == "stop" and stop["output_token_ids"][-1] == ord("e") and "e" not in stop["text"]
    assert parquet["lp"]["logprobs"] is not None and len(parquet["lp"]["logprobs"]) == 6
    assert 0 < reply_ttl <= 3600


def test_a_redelivered_request_announces_a_restart_and_streams_again(redis_url, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_LOG_LEVEL="warning",
               MQINFER_FAULTS="worker.after_step=kill@12")
    first = zygote.popen(
        mqinfer_cmd("worker", "--redis", redis_url, "--out", str(out), "--consumer", "first",
                "--claim-idle-ms", "300"),
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    with Client(redis_url) as client:
        client.submit({"id": "r", "prompt": "again", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True})
        code, _ = wait_exit(first)
        assert code == -9  # killed mid-generation by the fault point
        second = start_worker(redis_url, out, "--consumer", "second", "--claim-idle-ms", "300",
                              "--idle-exit-s", "2", "--flush-interval-s", "0.05")
        events = list(client.stream("r", timeout=120))
    code, err = wait_exit(second)
    assert code == 0, err

    restart_at = next(i for i, e in enumerate(events) if isinstance(e, Restart))
    before, after = events[:restart_at], events[restart_at + 1:-1]
    assert before and all(isinstance(e, Delta) and e.worker == "first" and e.attempt == 1 for e in before)
    assert events[restart_at].attempt == 2 and events[restart_at].worker == "second"
    assert all(isinstance(e, Delta) and e.worker == "second" for e in after)
    final = events[-1]
    assert isinstance(final, Final) and final.row.attempt == 2 and final.row.worker == "second"
    _check_deltas(after, final.row)  # what came after the restart is the whole output
    # Greedy decoding: the first worker's partial output was a prefix of the same tokens.
    partial = [t for e in before for t in e.token_ids]
    assert final.row.output_token_ids[:len(partial)] == partial
    (row,) = rows(out / "results")
    assert _as_parquet_row(final.row) == _stored(row)
