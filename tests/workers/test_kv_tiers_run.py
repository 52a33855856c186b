"""KV tier flags through `mqinfer run`, as a user runs it: a disk tier on a disk that stays full costs
the run nothing but the tier (every row written, exit 0), and a re-run with --fresh on a working disk
tier takes its prefixes from it with the same outputs."""

from __future__ import annotations

import os
import random
import sys

from tests import zygote
from tests.helpers import rows, write_jsonl


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MQINFER_NUM_THREADS="1", MQINFER_WORKERS="1",
                MQINFER_LOG_LEVEL="warning", **extra)


def job(path):
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(3)]
    write_jsonl(path, [{"id": f"r{i}", "prompt_token_ids": prefixes[i % 3] + [i + 3], "max_tokens": 3,
                        "temperature": 0, "ignore_eos": True} for i in range(9)])


def run(input_path, out, disk, *extra, **environment):
    cmd = [sys.executable, "-m", "mqinfer", "run", str(input_path), "--out", str(out), "--order", "input",
           "--kv-cache-dtype", "int8", "--num-kv-blocks", "8", "--max-num-seqs", "1", "--kv-disk-cache", str(disk),
           *extra]
    return zygote.run(cmd, env=env(**environment), capture_output=True, text=True, timeout=300)


def test_a_full_disk_tier_and_a_re_run_from_disk(tmp_path):
    input_path = tmp_path / "job.jsonl"
    job(input_path)
    full = run(input_path, tmp_path / "full", tmp_path / "kv-full", MQINFER_FAULTS="kv_tier.disk_write=enospc@*")
    assert full.returncode == 0, full.stderr[-3000:]
    assert len(rows(tmp_path / "full" / "results")) == 9
    assert not any(p.name.endswith(".kv") for p in (tmp_path / "kv-full").iterdir())

    first = run(input_path, tmp_path / "out", tmp_path / "kv")
    assert first.returncode == 0, first.stderr[-3000:]
    again = run(input_path, tmp_path / "out", tmp_path / "kv", "--fresh")
    assert again.returncode == 0, again.stderr[-3000:]
    outputs = {r["id"]: r["output_token_ids"] for r in rows(tmp_path / "out" / "results")}
    assert outputs == {r["id"]: r["output_token_ids"] for r in rows(tmp_path / "full" / "results")}
    costs = [c for c in rows(tmp_path / "out" / "costs") if c["kind"] == "request"]
    assert len(costs) == 9
    # Nothing recomputed: each request found its three-block prefix, from disk at least the first time
    # (the new worker's device cache starts empty and, at 8 blocks, evicts as the prefixes rotate).
    assert all(c["cached_prompt_tokens"] == 48 for c in costs)
    assert 3 * 48 <= sum(c["disk_cached_tokens"] for c in costs) <= 9 * 48


def test_run_keeps_tenants_apart_by_default_and_shares_with_global_scope(tmp_path):
    """Two tenants send the same three prompts through `mqinfer run` (one worker, one request at a
    time, with a disk tier): by default each tenant computes every prompt itself; with
    --prefix-cache-scope global the tenant second with a prompt finds it, and the outputs are the same."""
    input_path = tmp_path / "job.jsonl"
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(48)] + [i + 3] for i in range(3)]
    write_jsonl(input_path, [{"id": f"{tenant}-{i}", "tenant": tenant, "prompt_token_ids": p, "max_tokens": 3,
                              "temperature": 0, "ignore_eos": True}
                             for tenant in ("acme", "globex") for i, p in enumerate(prompts)])
    cached, outputs = {}, {}
    for scope in ("default", "global"):
        extra = ["--prefix-cache-scope", scope] if scope == "global" else []
        done = run(input_path, tmp_path / scope, tmp_path / f"kv-{scope}", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        costs = [c for c in rows(tmp_path / scope / "costs") if c["kind"] == "request"]
        cached[scope] = {c["id"]: c["cached_prompt_tokens"] for c in costs}
        outputs[scope] = {r["id"]: r["output_token_ids"] for r in rows(tmp_path / scope / "results")}
    # The worker takes the tenants' lanes in turn, so either tenant may come first with a prompt: by
    # default neither finds the other's; with global the second finds the first's.
    assert all(n == 0 for n in cached["default"].values()) and len(cached["default"]) == 6
    assert all(sorted((cached["global"][f"acme-{i}"], cached["global"][f"globex-{i}"])) == [0, 48]
               for i in range(3))
    assert outputs["default"] == outputs["global"] and len(outputs["default"]) == 6
