"""`mqinfer run --out s3://...`: the rows go into an S3-compatible store (moto's server, started by
the test), each part visible whole; running again computes nothing; a capped run carries on with
a higher cap, and --fresh starts over, each leaving one row per request in the store; the run's
state stays in the user's cache. Real runs of the built-in tiny model."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.dataset as ds
import pytest
from pyarrow import fs

from mqinfer.kernels import native
from mqinfer.schemas.dataset_uri import visible_parts
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA
from tests import zygote
from tests.helpers import clean_env, write_jsonl

N = 16
PRICE = 3600.0  # one USD per device-second
# One worker, at most 2 requests running and 2 waiting in its engine.
LAYOUT = ("--workers", "1", "--max-num-seqs", "2", "--max-batch", "1")


def _env(tmp_path) -> dict:
    env = clean_env("OMP_NUM_THREADS")
    # The test's own cache folder, with the native kernels the session built linked into it: its
    # workers would otherwise compile them again (a minute of both cores).
    cache = tmp_path / "cache"
    kernels = cache / "mqinfer" / "kernels"
    if native.cache_dir().is_dir() and not kernels.exists():
        kernels.parent.mkdir(parents=True, exist_ok=True)
        kernels.symlink_to(native.cache_dir())
    return dict(env, XDG_CACHE_HOME=str(cache))


def _run(tmp_path, src, out, *flags, code: int = 0) -> subprocess.CompletedProcess:
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", out, "--job-id", "j",
                       "--price-per-device-hour", str(PRICE), *LAYOUT, *flags],
                      env=_env(tmp_path), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


def _table(filesystem, root: str, schema):
    found = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    names = [f.path for f in found if f.type == fs.FileType.File]
    assert not [n for n in names if "/.tmp-" in n]  # nothing but whole parts
    parts = visible_parts([n for n in names if n.rsplit("/", 1)[-1].startswith("part-")])
    if not parts:
        return schema.empty_table()
    return ds.dataset(parts, format="parquet", schema=schema, filesystem=filesystem).to_table()


def _results(filesystem, prefix: str) -> dict[str, dict]:
    rows = _table(filesystem, f"{prefix}/results", RESULT_SCHEMA).to_pylist()
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a request has two rows"
    return by_id


def _request_costs(filesystem, prefix: str) -> list[dict]:
    return [c for c in _table(filesystem, f"{prefix}/costs", COST_SCHEMA).to_pylist() if c["kind"] == "request"]


def test_a_run_writes_into_an_object_store_and_resumes_from_it(s3, tmp_path):
    endpoint, filesystem = s3
    query = f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + (i + k) % 200 for k in range(32)], "max_tokens": 32,
              "temperature": 0, "ignore_eos": True} for i in range(N)]
    src = write_jsonl(tmp_path / "in.jsonl", items)

    # Credentials in the URI (any are good for this server) are never printed.
    first = _run(tmp_path, src, f"s3://AKIDMQ:SHHH-SECRET@fleet/free{query}")
    assert f"{N} of {N} requests have rows: {N} length" in first.stdout
    assert "results: s3://fleet/free/results" in first.stdout
    assert "SHHH-SECRET" not in first.stdout + first.stderr
    results = _results(filesystem, "fleet/free")
    assert sorted(results) == sorted(f"r{i}" for i in range(N))
    costs = _request_costs(filesystem, "fleet/free")
    assert sorted(c["id"] for c in costs) == sorted(results)
    # The state (lock, server, manifest) is in the cache, not in the store nor the working folder.
    assert list((tmp_path / "cache" / "mqinfer" / "runs").glob("*/.mqinfer/jobs/j.json"))
    assert not (tmp_path / "s3:").exists()

    # Again: every request has its row in the store, so nothing is computed.
    again = _run(tmp_path, src, f"s3://fleet/free{query}")
    assert "nothing to compute" in again.stderr and "this run: nothing computed" in again.stdout
    assert len(_request_costs(filesystem, "fleet/free")) == N
    assert _results(filesystem, "fleet/free") == results

    # Capped at an eighth of that: some requests are stopped; a higher cap carries on, and the
    # stopped requests' rows are replaced in the store, not added to.
    cap = sum(c["cost_usd"] for c in costs) / 8
    capped = f"s3://fleet/capped{query}"
    stopped_run = _run(tmp_path, src, capped, "--max-cost-usd", repr(cap))
    before = _results(filesystem, "fleet/capped")
    stopped = {rid for rid, r in before.items() if r["error_code"] == "budget_exceeded"}
    ran = {rid for rid, r in before.items() if r["finish_reason"] == "length"}
    assert len(before) == N and stopped and ran and stopped | ran == set(before)
    assert f"cost cap: {len(stopped)} requests did not run (budget_exceeded)" in stopped_run.stdout
    carried = _run(tmp_path, src, capped, "--max-cost-usd", repr(cap * 100))
    assert f"{len(stopped)} requests a cost cap stopped earlier run now" in carried.stderr
    after = _results(filesystem, "fleet/capped")
    assert len(after) == N and all(r["finish_reason"] == "length" for r in after.values())
    assert all(after[rid]["finished_at"] == before[rid]["finished_at"] for rid in ran)
    assert sorted(c["id"] for c in _request_costs(filesystem, "fleet/capped") if c["cost_usd"] > 0) == sorted(after)

    # --fresh starts over: the job's rows leave the store and are computed once more.
    fresh = _run(tmp_path, src, capped, "--fresh")
    assert f"removed {N} result rows" in fresh.stderr and f"this run: {N} requests" in fresh.stdout
    rerun = _results(filesystem, "fleet/capped")
    assert sorted(rerun) == sorted(after) and all(rerun[r]["finished_at"] > after[r]["finished_at"] for r in rerun)
    assert len(_request_costs(filesystem, "fleet/capped")) == N


def test_a_run_into_a_missing_bucket_stops_with_the_reason(s3, tmp_path):
    endpoint, _ = s3
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "r0", "prompt": "hi", "max_tokens": 2}])
    proc = _run(tmp_path, src, f"s3://nope/out?endpoint_override={endpoint}&scheme=http&region=us-east-1", code=2)
    assert "no bucket or folder 'nope'" in proc.stderr and "Traceback" not in proc.stderr
