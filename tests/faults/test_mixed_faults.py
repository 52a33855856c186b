"""A worker killed while interactive requests (with latency targets, in their tenant's lane) run
beside a bulk backlog: another worker takes over, and after compaction every request has exactly
one row and one billed cost row; the interactive rows carry ``slo_met``."""

from __future__ import annotations

from tests.faults.faultkit import compact_and_check, killed, record, requests, spawn, submit, wait_claimable
from tests.helpers import rows


def interactive(n: int) -> list[dict]:
    return [{"id": f"chat{i}", "job_id": "mixed-chat", "tenant": "chat", "prompt_token_ids": [256] + [70 + i] * 5,
             "max_tokens": 80, "ignore_eos": True, "temperature": 0.0, "slo_ttft_ms": 60_000,
             "slo_tpot_ms": 10_000} for i in range(n)]


def test_kill_9_with_interactive_and_bulk_running_then_another_worker_finishes(redis_url, redis_client, tmp_path):
    out = tmp_path / "out"
    expected = submit(redis_url, requests("mixed-bulk", 10, 60))
    expected |= submit(redis_url, interactive(4))
    # Six at a time: the four interactive requests go ahead of the bulk ones, two bulk ones run
    # beside them, and at step 45 (before any of the six is done) both kinds are under way when
    # the process dies.
    a = spawn(redis_url, out, "A", "--max-num-seqs", "6", "--claim-idle-ms", "1000", "--flush-rows", "1",
              faults="worker.after_step=kill@45")
    a.wait()
    assert killed(a), a.log()
    written_by_a = rows(out / "results")
    assert len(written_by_a) < len(expected), len(written_by_a)

    wait_claimable(redis_client, 1000)
    b = spawn(redis_url, out, "B", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
    assert b.wait() == 0, b.log()

    outcome = compact_and_check(out, expected, redis_client)
    by_key = outcome.by_key
    assert all(r["output_tokens"] == (80 if r["id"].startswith("chat") else 60) for r in by_key.values())
    chat_rows = [r for r in by_key.values() if r["id"].startswith("chat")]
    assert len(chat_rows) == 4 and all(r["slo_met"] is not None for r in chat_rows)
    assert all(r["slo_met"] is None for r in by_key.values() if not r["id"].startswith("chat"))
    # A died holding the interactive requests and bulk ones: B was delivered them a second time.
    assert all(r["attempt"] == 2 for r in chat_rows)
    assert any(r["attempt"] == 2 for r in by_key.values() if not r["id"].startswith("chat"))
    record("kill -9 with interactive and bulk running", submitted=len(expected), rows_before=outcome.rows_before,
           rows_after=outcome.rows_after, lost=0, duplicated=outcome.duplicates_removed, worker_crashes=0,
           injected_kills=1)
