"""Prefix routing follows the KV tiers: a worker publishes the prefixes its tiers hold, and a producer
routing by prefix sends a request with such a prefix to that worker's shard, not to its hash's."""

from __future__ import annotations

import asyncio
import json
import random
import zlib

import pytest

from mqinfer.client import Client
from mqinfer.client_async import AsyncClient
from mqinfer.schemas import keys
from mqinfer.schemas.request import request_from_obj
from mqinfer.schemas.routing import PrefixRouter, route_digest, route_key
from mqinfer.schemas.stream import decode_entry
from mqinfer.workers.config import EngineConfig
from tests.workers.harness import WorkerHarness


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def prompt_homed_on(shard: int, shards: int, seed: int) -> list[int]:
    """A 70-token prompt whose route key's hash sends it to ``shard`` of ``shards``."""
    rng = random.Random(seed)
    while True:
        ids = [rng.randrange(256) for _ in range(70)]
        key = route_key(request_from_obj({"id": "x", "prompt_token_ids": ids}))
        if zlib.crc32(key) % shards == shard:
            return ids


def test_a_prefix_goes_to_the_shard_whose_tiers_hold_it(redis_url, redis_client, tmp_path):
    held = prompt_homed_on(0, 2, seed=1)  # by hash, shard 0; the worker of shard 1 will hold it
    other = prompt_homed_on(0, 2, seed=2)
    engine = EngineConfig(num_threads=1, kv_cache_dtype="int8", num_kv_blocks=32, max_model_len=256,
                          kv_disk_cache=str(tmp_path / "kv"))
    h = WorkerHarness(redis_url, tmp_path / "out", consumer="shard-1", engine=engine, stream="requests-1").start()
    redis_client.xadd(keys.request_stream("requests-1"), {"json": json.dumps(
        {"id": "first", "prompt_token_ids": held + [1, 2], "max_tokens": 2, "temperature": 0}), "v": "1"})
    h.until(lambda: h.results(), max_turns=500, advance_s=0.5, what="the row")
    h.turn(3, advance_s=1.0)  # publishes at most once a second
    published = redis_client.zrange(keys.kv_tier_prefixes("requests-1"), 0, -1)
    key = route_key(request_from_obj({"id": "x", "prompt_token_ids": held}))
    assert published == [route_digest(key)]
    h.stop()

    client = Client(redis_url, shards=2, route="prefix")
    try:
        reqs = [request_from_obj({"id": f"r{i}", "prompt_token_ids": p + [i]})
                for i, p in enumerate((held, other))]
        assert client.router.assign(reqs) == [1, 0]
        assert client.router.tier_routed == 1
    finally:
        client.close()

    # The asyncio client looks the prefixes up too, and its submission lands on the holding shard.
    async def submit_async() -> int:
        aclient = AsyncClient(redis_url, shards=2, route="prefix")
        try:
            await aclient.submit_many([{"id": f"a{i}", "prompt_token_ids": p + [i], "max_tokens": 1}
                                       for i, p in enumerate((held, other))], reply=False)
            return aclient.router.tier_routed
        finally:
            await aclient.close()

    assert asyncio.run(submit_async()) == 1
    assert _ids_in_shard(redis_client, "requests-1") == {"a0"}
    assert _ids_in_shard(redis_client, "requests-0") == {"a1"}


def _ids_in_shard(redis_client, stream: str) -> set[str]:
    """The request ids in a shard's stream and its lanes."""
    ids = set()
    for key in redis_client.scan_iter(match=f"mqinfer:{{{stream}*"):
        name = key.decode() if isinstance(key, bytes) else key
        if not (name == keys.request_stream(stream) or name.startswith(keys.request_stream(stream + ":lane:")[:-1])):
            continue
        if redis_client.type(key) not in ("stream", b"stream"):
            continue
        ids.update(decode_entry(fields).id for _, fields in redis_client.xrange(key))
    return ids


def test_routing_goes_on_by_hash_when_the_lookup_fails():
    def broken(_keys):
        raise ConnectionError("redis away")

    router = PrefixRouter(2, tier_homes=broken)
    ids = prompt_homed_on(1, 2, seed=3)
    assert router.assign([request_from_obj({"id": "a", "prompt_token_ids": ids})]) == [1]
    assert router.tier_routed == 0


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_a_worker_publishes_its_prefixes_under_its_cache_scope(redis_url, redis_client, tmp_path, scope):
    """A producer routing another tenant's identical prompt finds the prefix only under the global
    scope: under the default one the other tenant could not use that KV anyway."""
    held = prompt_homed_on(0, 2, seed=4)
    engine = EngineConfig(num_threads=1, kv_cache_dtype="int8", num_kv_blocks=32, max_model_len=256,
                          kv_disk_cache=str(tmp_path / "kv"), prefix_cache_scope=scope)
    h = WorkerHarness(redis_url, tmp_path / "out", consumer="shard-1", engine=engine, stream="requests-1").start()
    redis_client.xadd(keys.request_stream("requests-1"), {"json": json.dumps(
        {"id": "first", "tenant": "acme", "prompt_token_ids": held + [1, 2], "max_tokens": 2, "temperature": 0}),
        "v": "1"})
    h.until(lambda: h.results(), max_turns=500, advance_s=0.5, what="the row")
    h.turn(3, advance_s=1.0)
    acme = request_from_obj({"id": "a", "tenant": "acme", "prompt_token_ids": held + [3]})
    globex = request_from_obj({"id": "g", "tenant": "globex", "prompt_token_ids": held + [3]})
    assert redis_client.zrange(keys.kv_tier_prefixes("requests-1"), 0, -1) == [route_digest(route_key(acme, scope))]
    h.stop()

    for req, found in ((acme, True), (globex, scope == "global")):
        client = Client(redis_url, shards=2, route="prefix", prefix_cache_scope=scope)
        try:
            client.router.assign([req])
            assert client.router.tier_routed == int(found), (req.tenant, scope)
        finally:
            client.close()
