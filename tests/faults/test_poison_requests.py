"""Requests that take workers down, through a whole `mqinfer run`: a request that crashes every
worker that runs it (a real SIGSEGV, armed by a fault point for that request id) ends with an error
row after --max-deliveries while the run restarts its workers and finishes the rest; grammars built
to crash the compiler, constraints that match nothing and reused ids end as error rows without
any worker dying."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import zygote
from tests.helpers import rows


def _run(src, out, *args: str, faults: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_NUM_THREADS="1")
    if faults:
        env["MQINFER_FAULTS"] = faults
    return zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(out), *args],
                      env=env, capture_output=True, text=True, timeout=timeout)


def _write(path, lines: list[dict]):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _normal(n: int) -> list[dict]:
    return [{"id": f"ok{i}", "prompt_token_ids": [256, 40 + i, 41], "max_tokens": 24, "temperature": 0,
             "ignore_eos": True} for i in range(n)]


def test_a_request_that_crashes_every_worker_ends_with_an_error_row_and_the_rest_finish(tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"id": "poison", "prompt_token_ids": [256, 1], "max_tokens": 4},
                                         *_normal(6)])
    done = _run(src, tmp_path / "out", "--workers", "2", "--claim-idle-ms", "1000",
                faults="worker.admit.poison=segv@*")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "7 of 7 requests have rows: 6 length, 1 error (max_deliveries_exceeded 1)" in done.stdout
    assert "died (signal SIGSEGV)" in done.stderr and "started worker" in done.stderr
    by_id = {r["id"]: r for r in rows(tmp_path / "out" / "results")}
    assert len(by_id) == 7
    poison = by_id["poison"]
    assert poison["finish_reason"] == "error" and poison["error_code"] == "max_deliveries_exceeded"
    assert poison["attempt"] == 4 and "the worker running it alone died" in poison["error"]
    for i in range(6):
        # Held beside the poison when workers died, a request may pass --max-deliveries, but it
        # never ran alone when one died: it gets its own try and its ordinary row.
        row = by_id[f"ok{i}"]
        assert row["finish_reason"] == "length" and row["output_tokens"] == 24 and row["attempt"] <= 6, row
    # Nothing more to do: the error row is the request's row.
    again = _run(src, tmp_path / "out", "--workers", "2")
    assert again.returncode == 0 and "this run: nothing computed" in again.stdout, again.stderr[-2000:]


def test_hostile_constraints_and_reused_ids_end_as_error_rows_in_a_run(tmp_path):
    bomb = "\n".join(["root ::= r0", *(f'r{k} ::= "t{k}" | r{k + 1}' for k in range(5000)), 'r5000 ::= "end"'])
    hostile = [
        {"id": "bomb", "prompt": "x", "max_tokens": 8,
         "response_format": {"type": "grammar", "syntax": "gbnf", "grammar": bomb}},
        {"id": "never", "prompt": "x", "max_tokens": 8, "response_format": {"type": "regex", "regex": "[a&&b]"}},
        {"id": "loop", "prompt": "x", "max_tokens": 8,
         "response_format": {"type": "grammar", "syntax": "gbnf", "grammar": "root ::= x\nx ::= x"}},
        {"id": "cycle", "prompt": "x", "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
            "name": "c", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
        {"id": "fine", "prompt": "x", "max_tokens": 8, "response_format": {"type": "regex", "regex": "[a-z]{3}"}},
    ]
    lines = [*hostile, *_normal(3), {**_normal(1)[0], "max_tokens": 5}, _normal(1)[0]]
    src = _write(tmp_path / "in.jsonl", lines)
    done = _run(src, tmp_path / "out", "--workers", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "died" not in done.stderr
    assert "line 10: id 'ok0' repeats line 6 with the same request: not sent again" in done.stderr
    assert ("9 of 9 requests have rows: 5 error (duplicate_id 1, invalid_response_format 4), 3 length, 1 stop"
            in done.stdout), done.stdout
    by_id = {r["id"]: r for r in rows(tmp_path / "out" / "results")}
    for rid in ("bomb", "never", "loop", "cycle"):
        assert by_id[rid]["error_code"] == "invalid_response_format", by_id[rid]
    assert "over the limit of 1000" in by_id["bomb"]["error"]
    assert "matches no text at all" in by_id["never"]["error"]
    assert by_id["fine"]["finish_reason"] == "stop" and len(by_id["fine"]["text"]) == 3
    reused = by_id["line:9"]
    assert reused["error_code"] == "duplicate_id" and "repeats line 6 with a different request" in reused["error"]
    assert by_id["ok0"]["output_tokens"] == 24  # the first line with the id is the request
