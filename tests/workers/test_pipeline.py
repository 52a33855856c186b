"""End to end through real processes: submit → stream → worker → Parquet, and `mqinfer run`."""

from __future__ import annotations

import json
import subprocess

import msgspec

from mqinfer.schemas import keys
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, start_worker, wait_exit, write_jsonl

STREAM = keys.request_stream("requests")


def test_submit_then_worker_writes_a_row_per_request(redis_url, redis_client, tmp_path):
    good = [{"id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 4 + i, "temperature": 0.0,
             "tenant": "t1" if i % 2 else "t2"} for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", good)
    sub = zygote.run(mqinfer_cmd("submit", str(src), "--redis", redis_url), capture_output=True, text=True)
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


def test_run_one_command_on_200_mixed_lines(tmp_path):
    bad = [
        '{"id": "c", "prompt": ',                                         # malformed: no usable id
        {"id": "d", "prompt": "x", "max_tokens": -1},
        {"prompt": "no id"},
        {"id": "u", "prompt": "x", "colour": 1},
        {"id": "both", "prompt": "x", "prompt_token_ids": [1]},
        {"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "best_of": 2}},
    ]
    lines, expected = [], {}
    for i in range(200):
        if i % 10 == 3:
            item = bad[(i // 10) % len(bad)]
            if isinstance(item, dict):  # a distinct id per line, so every line is its own request
                item = json.loads(json.dumps(item).replace('"d"', f'"d{i}"').replace('"u"', f'"u{i}"')
                                  .replace('"both"', f'"both{i}"').replace('"f"', f'"f{i}"'))
            lines.append(item)
        elif i % 10 == 7:
            lines.append({"custom_id": f"oa{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": f"hi {i}", "max_tokens": 3, "temperature": 0}})
        else:
            lines.append({"id": f"g{i}", "prompt": f"line {i}", "max_tokens": 3, "temperature": 0.7, "seed": i,
                          "tenant": "a" if i % 2 else "b"})
    src = write_jsonl(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out"
    proc = zygote.run(mqinfer_cmd("run", str(src), "--out", str(out), "--workers", "1", "--num-threads", "1"),
                      capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = rows(out / "results")
    by_id = {r["id"]: r for r in results}
    assert len(results) == len(by_id) == 200  # one row per line, after compaction
    errors = {k: r for k, r in by_id.items() if r["finish_reason"] == "error"}
    assert len(errors) == 20
    summary = proc.stdout.splitlines()[0]
    assert "200 of 200 requests have rows: " in summary and "20 error (" in summary
    # Malformed lines and lines without an id are known by their line number.
    assert by_id["line:4"]["error_code"] == "invalid_json"
    assert by_id["line:24"]["error_code"] == "invalid_request" and "id" in by_id["line:24"]["error"]
    assert all(e["error"] for e in errors.values())
    assert any(e["error_code"] == "unsupported_parameter" and "best_of" in e["error"] for e in errors.values())
    assert len({r["job_id"] for r in results}) == 1
    costs = [c for c in rows(out / "costs") if c["kind"] == "request"]
    assert sorted(c["id"] for c in costs) == sorted(by_id)  # a cost row for every request


def test_run_fails_clearly_on_missing_input(tmp_path):
    proc = zygote.run(mqinfer_cmd("run", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")),
                      capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no such input file" in proc.stderr


def test_standalone_worker_against_mqinfer_redis_serves_submit(tmp_path):
    server = zygote.popen(mqinfer_cmd("redis", "--dir", str(tmp_path / "srv")), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"s{i}", "prompt": "hey", "max_tokens": 2} for i in range(5)])
        sub = zygote.run(mqinfer_cmd("submit", str(src), "--redis", url, "--job-id", "j1"),
                         capture_output=True, text=True)
        assert sub.returncode == 0, sub.stderr
        out = tmp_path / "out"
        code, err = wait_exit(start_worker(url, out, "--idle-exit-s", "1", "--flush-interval-s", "0.1"))
        assert code == 0, err
        got = rows(out / "results")
        assert sorted(r["id"] for r in got) == [f"s{i}" for i in range(5)]
        assert {r["job_id"] for r in got} == {"j1"}
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_submit_reports_invalid_lines_and_sends_the_rest(redis_url, redis_client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "a"}, {"id": "bad", "top_k": -1, "prompt": "a"},
                                              "not json", {"id": "ok", "prompt": "again"}])
    sub = zygote.run(mqinfer_cmd("submit", str(src), "--redis", redis_url), capture_output=True, text=True)
    assert sub.returncode == 1
    assert "line 2: invalid_request" in sub.stderr and "top_k" in sub.stderr
    assert "line 3: invalid_json" in sub.stderr
    assert "line 4: duplicate_id: id 'ok' repeats line 1 with a different request" in sub.stderr
    assert redis_client.xlen(STREAM) == 1
