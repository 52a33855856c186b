"""The hostile corpus through a real worker: every entry ends as an error row or a dead letter with a
reason, the worker never crashes, and a good request sent after them all still completes."""

from __future__ import annotations

import json

from mqinfer.schemas import keys
from tests.faults.faultkit import DEAD, STREAM, spawn
from tests.helpers import rows, wait_until
from tests.hostile.corpus import CASES


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_corpus_ends_as_error_rows_or_dead_letters_and_the_worker_keeps_serving(redis_url, redis_client, tmp_path):
    redis_client.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    entry_of = {case.name: _s(redis_client.xadd(STREAM, case.fields)) for case in CASES}
    redis_client.xadd(STREAM, {"json": '{"id": "good-after", "prompt_token_ids": [256, 72], "max_tokens": 4}',
                               "v": "1"})
    out = tmp_path / "out"
    worker = spawn(redis_url, out, "W", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert worker.wait() == 0, worker.log()

    by_id = {}
    for r in rows(out / "results"):
        assert r["id"] not in by_id, f"two rows for {r['id']!r}"
        by_id[r["id"]] = r
    dead = {_s(f[b"entry_id"]): f for _, f in redis_client.xrange(DEAD)}
    row_cases = [c for c in CASES if c.outcome == "row"]
    dead_cases = [c for c in CASES if c.outcome == "dead"]
    for case in row_cases:
        row = by_id.get(case.rid)
        assert row is not None, f"{case.name}: no row for {case.rid!r}"
        if case.code is None:
            assert row["finish_reason"] in ("stop", "length"), (case.name, row["error"])
        else:
            assert row["finish_reason"] == "error" and row["error_code"] == case.code, (case.name, row)
            assert row["error"], case.name
    for case in dead_cases:
        letter = dead.get(entry_of[case.name])
        assert letter is not None, f"{case.name}: no dead letter"
        assert _s(letter[b"error_code"]) == case.code and _s(letter[b"error"]), (case.name, letter)
    assert set(by_id) == {c.rid for c in row_cases} | {"good-after"}
    assert len(dead) == len(dead_cases)
    assert by_id["good-after"]["finish_reason"] in ("stop", "length")
    assert by_id["good-after"]["output_tokens"] >= 1
    # Everything read was acked; ids that look like paths stayed data.
    assert redis_client.xlen(STREAM) == 0
    assert redis_client.xpending(STREAM, keys.GROUP)["pending"] == 0
    assert sorted(p.name for p in out.iterdir()) == [".mqinfer", "costs", "results"]
    assert sorted(p.relative_to(out).as_posix() for p in (out / ".mqinfer").rglob("*")) == [
        ".mqinfer/workers", ".mqinfer/workers/W.json"]  # the worker's exit summary, and nothing else
    assert not (tmp_path / "etc").exists() and not any("passwd" in p.name for p in tmp_path.rglob("*"))


# The native attention kernel is built without -ffast-math: flush-to-zero must not leak into the process.
def test_number_validation_is_the_same_after_the_first_engine_step(redis_url, redis_client, tmp_path):
    redis_client.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    out = tmp_path / "out"
    worker = spawn(redis_url, out, "F", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    first = {"id": "first", "prompt_token_ids": [256, 72], "max_tokens": 2}
    redis_client.xadd(STREAM, {"json": json.dumps(first), "v": "1"})
    wait_until(lambda: rows(out / "results"), timeout=60, what="the first row (an engine step ran)")
    tiny = {"id": "tiny-top-p", "prompt_token_ids": [256, 72], "max_tokens": 2, "top_p": 1e-320}
    redis_client.xadd(STREAM, {"json": json.dumps(tiny), "v": "1"})
    assert worker.wait() == 0, worker.log()
    row = {r["id"]: r for r in rows(out / "results")}["tiny-top-p"]
    assert row["finish_reason"] in ("stop", "length"), row["error"]  # a valid top_p, however small
