"""Limits on what one request may ask for: entry size and max_tokens are worker settings with safe
defaults (1 MiB; the context length), and a request over them is an error row, not work."""

from __future__ import annotations

import json

from mqinfer.schemas import keys
from mqinfer.schemas.stream import MAX_ENTRY_BYTES
from tests.faults.faultkit import STREAM, spawn
from tests.helpers import rows


def test_entry_size_and_max_tokens_limits_are_worker_settings(redis_url, redis_client, tmp_path):
    from mqinfer.config import WORKER_OPTIONS

    defaults = {o.name: o.default for o in WORKER_OPTIONS}
    assert defaults["max_entry_bytes"] == MAX_ENTRY_BYTES == 1 << 20
    assert defaults["max_tokens_limit"] is None  # bounded by the context length (--max-model-len)

    redis_client.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    for obj in ({"id": "big", "prompt": "A" * 5000},
                {"id": "many", "prompt_token_ids": [256, 65], "max_tokens": 64},
                {"id": "fine", "prompt_token_ids": [256, 65], "max_tokens": 32, "ignore_eos": True}):
        redis_client.xadd(STREAM, {"json": json.dumps(obj), "v": "1"})
    out = tmp_path / "out"
    worker = spawn(redis_url, out, "L", "--max-entry-bytes", "4096", "--max-tokens-limit", "32",
                   "--idle-exit-s", "1.5")
    assert worker.wait() == 0, worker.log()
    by_id = {r["id"]: r for r in rows(out / "results")}
    assert by_id["big"]["error_code"] == "invalid_request" and "over the limit of 4096 bytes" in by_id["big"]["error"]
    assert by_id["many"]["error_code"] == "invalid_request"
    assert "max_tokens 64" in by_id["many"]["error"] and "--max-tokens-limit" in by_id["many"]["error"]
    assert by_id["fine"]["finish_reason"] == "length" and by_id["fine"]["output_tokens"] == 32
