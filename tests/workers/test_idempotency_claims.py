"""Idempotency claims on a real server: a read's entries are claimed in one pipeline, in order,
and a server that has lost its scripts (restarted or flushed) gets them again without a lost claim."""

from __future__ import annotations

import msgspec

from mqinfer.ops.metrics import WorkerMetrics
from mqinfer.schemas import keys
from mqinfer.schemas.request import Request
from mqinfer.workers.queue.idempotency import Idempotency

STREAM = "claims-test"


def _request(rid: str, max_tokens: int = 4) -> Request:
    return msgspec.convert({"id": rid, "prompt_token_ids": [1, 2, 3], "max_tokens": max_tokens}, Request)


def _entries(redis_client, count: int) -> list[str]:
    """Live entries of the request stream (a first copy counts only while its entry is there)."""
    return [redis_client.xadd(keys.request_stream(STREAM), {"r": b""}).decode() for _ in range(count)]


def _idempotency(redis_client) -> Idempotency:
    return Idempotency(redis_client, STREAM, ttl_s=60, replies=None, billing=None, metrics=WorkerMetrics())


def test_a_reads_claims_run_in_order_so_a_second_copy_in_the_same_read_is_a_duplicate(redis_client):
    idem = _idempotency(redis_client)
    e = _entries(redis_client, 4)
    claims = idem.claim_many([(e[0], _request("a")), (e[1], _request("a")), (e[2], _request("a", 5)),
                              (e[3], _request("b"))])
    assert [c.outcome for c in claims] == ["new", "same", "conflict", "new"]
    assert claims[1].first == e[0] and claims[2].first == e[0]
    assert set(idem.records) == {e[0], e[3]}


def test_claims_after_the_server_lost_its_scripts_are_loaded_again_and_none_is_lost(redis_client):
    idem = _idempotency(redis_client)
    e = _entries(redis_client, 4)
    assert [c.outcome for c in idem.claim_many([(e[0], _request("c"))])] == ["new"]
    redis_client.script_flush()
    claims = idem.claim_many([(e[1], _request("c")), (e[2], _request("d")), (e[3], _request("d"))])
    assert [c.outcome for c in claims] == ["same", "new", "same"]
    assert claims[0].first == e[0] and claims[2].first == e[2]
    # Each claim ran exactly once: the record of "d" names its first entry, not a rerun's.
    assert redis_client.script_exists(idem._claim.sha) == [True]
