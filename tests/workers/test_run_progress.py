"""`mqinfer run` with real worker processes: its progress line counts the tokens the workers
generated, which add up to the rows' output tokens, and each worker leaves its exit summary."""

from __future__ import annotations

import json
import os
import re
import sys

from mqinfer.run import input_job_id
from mqinfer.schemas import keys
from tests import zygote
from tests.helpers import rows, write_jsonl


def test_run_counts_generated_tokens_and_workers_leave_exit_summaries(redis_url, redis_client, tmp_path):
    items = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7], "max_tokens": 10 + i, "temperature": 0,
              "ignore_eos": True} for i in range(6)]
    src = write_jsonl(tmp_path / "job.jsonl", items)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", MQINFER_NUM_THREADS="1")
    proc = zygote.run([sys.executable, "-m", "mqinfer", "run", str(src), "--out", str(out), "--redis", redis_url,
                       "--workers", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = input_job_id(src)
    results = rows(out / "results")
    output_tokens = sum(r["output_tokens"] for r in results)
    assert len(results) == 6 and output_tokens == sum(10 + i for i in range(6))
    assert int(redis_client.hget(keys.generated_tokens("requests"), job_id)) == output_tokens
    # The last progress line (every request done) shows every token: they are counted with the acks.
    progress = [line for line in proc.stderr.splitlines() if "tokens generated" in line]
    assert re.fullmatch(rf"6/6 requests \(100\.0%\), {output_tokens} tokens generated, elapsed \d+s", progress[-1])
    summaries = [json.loads(p.read_text()) for p in (out / ".mqinfer" / "workers").glob("*.json")]
    assert len(summaries) == 2 and all(s["exit_code"] == 0 for s in summaries)
    assert sum(s["requests_finished"] for s in summaries) == 6
    # Start-up's heap is frozen (torch, the model and the imports are far more than 10,000 objects),
    # so full collections while serving walk only what serving made.
    assert all(s["gc"]["frozen_objects"] > 10_000 for s in summaries), [s["gc"] for s in summaries]
    assert {r["worker"] for r in results} <= {s["consumer"] for s in summaries}
