"""End to end through real processes: submit → stream → worker → Parquet, and `mqinfer run`."""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest

from mqinfer import keys
from tests.helpers import mqinfer_cmd, rows, start_worker, wait_exit, write_jsonl

STREAM = keys.request_stream("requests")


def test_submit_then_worker_writes_a_row_per_request(redis_url, redis_client, tmp_path):
    good = [{"id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 4 + i, "temperature": 0.0,
             "tenant": "t1" if i % 2 else "t2"} for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", good)
    sub = subprocess.run(mqinfer_cmd("submit", str(src), "--redis", redis_url), capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    assert "submitted 12 requests" in sub.stdout

    out = tmp_path / "out"
    code, err = wait_exit(start_worker(redis_url, out, "--idle-exit-s", "1.5", "--flush-interval-s", "0.1"))
    assert code == 0, err

    results = rows(out / "results")
    assert sorted(r["id"] for r in results) == sorted(g["id"] for g in good)
    by_id = {r["id"]: r for r in results}
    for g in good:
        r = by_id[g["id"]]
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= r["output_tokens"] <= g["max_tokens"]
        if r["finish_reason"] == "length":
            assert r["output_tokens"] == g["max_tokens"]
        assert r["output_tokens"] == len(r["output_token_ids"])
        assert r["tenant"] == g["tenant"] and r["attempt"] == 1
        assert r["prompt_tokens"] == len(g["prompt"].encode()) + 1  # byte tokenizer + BOS
        assert r["enqueued_at"] <= r["started_at"] <= r["finished_at"]
    costs = rows(out / "costs")
    request_costs = [c for c in costs if c["kind"] == "request"]
    assert sorted(c["id"] for c in request_costs) == sorted(g["id"] for g in good)
    assert all(c["device_s"] > 0 and c["cost_usd"] > 0 for c in request_costs)
    assert {c["kind"] for c in costs} >= {"request", "startup", "idle"}
    # Everything acknowledged and trimmed; nothing pending.
    assert redis_client.xlen(STREAM) == 0
    assert redis_client.xpending(STREAM, keys.GROUP)["pending"] == 0


def test_bad_entries_get_error_rows_or_dead_letters_and_good_ones_still_succeed(redis_url, redis_client, tmp_path):
    redis_client.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    pack = msgspec.msgpack.encode

    def add_json(obj):
        redis_client.xadd(STREAM, {"json": obj if isinstance(obj, str) else json.dumps(obj), "v": "1"})

    add_json({"id": "good-1", "prompt": "fine", "max_tokens": 3})
    add_json('{"id": "broken", "prompt": ')                                   # malformed: no usable id
    add_json({"id": "unknown", "prompt": "x", "colour": "blue"})              # unknown field
    add_json({"id": "both", "prompt": "x", "prompt_token_ids": [1, 2]})       # both prompt forms
    add_json({"id": "zero", "prompt": "x", "max_tokens": 0})                  # max_tokens 0
    add_json({"id": "neg-top-p", "prompt": "x", "top_p": -0.5})               # negative top_p
    add_json({"id": "too-long", "prompt_token_ids": [65] * 3000})             # longer than the context
    add_json({"id": "wrong-model", "prompt": "x", "model": "llama-70b"})      # another model
    add_json({"prompt": "who am I"})                                          # no id → dead letter
    redis_client.xadd(STREAM, {"r": b"\xc1\xff\x00garbage", "v": "1"})        # undecodable msgpack
    redis_client.xadd(STREAM, {"r": pack({"id": "good-2", "prompt_token_ids": [256, 65], "max_tokens": 2}), "v": "1"})

    out = tmp_path / "out"
    code, err = wait_exit(start_worker(redis_url, out, "--idle-exit-s", "1.5", "--flush-interval-s", "0.1"))
    assert code == 0, err
    by_id = {r["id"]: r for r in rows(out / "results")}
    assert set(by_id) == {"good-1", "good-2", "unknown", "both", "zero", "neg-top-p", "too-long", "wrong-model"}
    assert by_id["good-1"]["finish_reason"] in ("stop", "length")
    assert by_id["good-2"]["finish_reason"] in ("stop", "length")
    expect = {
        "unknown": ("invalid_request", "colour"),
        "both": ("invalid_request", "prompt"),
        "zero": ("invalid_request", "max_tokens"),
        "neg-top-p": ("invalid_request", "top_p"),
        "too-long": ("prompt_too_long", "3000"),
        "wrong-model": ("model_mismatch", "llama-70b"),
    }
    for rid, (code_, word) in expect.items():
        row = by_id[rid]
        assert row["finish_reason"] == "error", rid
        assert row["error_code"] == code_, (rid, row["error"])
        if word:
            assert word in row["error"], (rid, row["error"])
    dead = redis_client.xrange(keys.dead_letter_stream("requests"))
    # Malformed JSON, the entry without an id, and the undecodable msgpack: no usable id.
    assert len(dead) == 3
    codes = sorted(f[b"error_code"].decode() for _, f in dead)
    assert codes == ["invalid_json", "invalid_json", "invalid_request"]
    no_id = next(f for _, f in dead if f[b"error_code"] == b"invalid_request")
    assert b"id" in no_id[b"error"] and no_id[b"orig_json"] == b'{"prompt": "who am I"}'
    assert redis_client.xlen(STREAM) == 0


def test_run_one_command_on_mixed_file(tmp_path):
    src = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "prompt": "one", "max_tokens": 5, "temperature": 0},
        {"id": "b", "prompt_token_ids": [256, 1, 2, 3], "max_tokens": 3},
        '{"id": "c", "prompt": ',
        {"id": "d", "prompt": "x", "max_tokens": -1},
        {"prompt": "no id"},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 4}},
        {"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "n": 2}},
    ])
    out = tmp_path / "out"
    proc = subprocess.run(mqinfer_cmd("run", str(src), "--out", str(out), "--num-threads", "1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "7 requests: 3 ok, 4 error" in proc.stdout
    by_id = {r["id"]: r for r in rows(out / "results")}
    assert set(by_id) == {"a", "b", "line:3", "d", "line:5", "e", "f"}  # malformed lines have no usable id
    assert by_id["line:3"]["error_code"] == "invalid_json"
    assert by_id["f"]["error_code"] == "unsupported_parameter" and "n" in by_id["f"]["error"]
    assert by_id["line:5"]["error_code"] == "invalid_request"
    assert len({r["job_id"] for r in by_id.values()}) == 1
    costs = [c for c in rows(out / "costs") if c["kind"] == "request"]
    assert sorted(c["id"] for c in costs) == sorted(by_id)


def test_run_fails_clearly_on_missing_input(tmp_path):
    proc = subprocess.run(mqinfer_cmd("run", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")),
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no such input file" in proc.stderr
