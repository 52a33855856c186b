"""Prefix routing: requests that share a leading prompt go to one shard, within a balance slack."""

from __future__ import annotations

import random

import pytest

from mqinfer.schemas.keys import shard_index
from mqinfer.schemas.request import Request
from mqinfer.schemas.routing import ROUTE_BYTES, ROUTE_TOKENS, PrefixRouter, route_key, work_estimate


def _req(rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(id=rid, prompt_token_ids=prompt, max_tokens=max_tokens)


def _job(num_prefixes: int, per_prefix: int, seed: int = 0, prefix_len=(256, 1024)) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 32000) for _ in range(rng.randint(*prefix_len))] for _ in range(num_prefixes)]
    reqs = [_req(f"p{p}s{s}", prefixes[p] + [rng.randrange(3, 32000) for _ in range(rng.randint(8, 64))])
            for p in range(num_prefixes) for s in range(per_prefix)]
    rng.shuffle(reqs)
    return reqs


def _prefix_of(req: Request) -> str:
    return req.id.split("s")[0]


def test_the_key_is_the_leading_prompt_and_short_prompts_have_none():
    a = _req("a", list(range(3, 3 + ROUTE_TOKENS)) + [7, 8])
    b = _req("b", list(range(3, 3 + ROUTE_TOKENS)) + [9])
    assert route_key(a) == route_key(b) is not None
    assert route_key(_req("c", list(range(3, 2 + ROUTE_TOKENS)))) is None
    text = "You are a careful assistant. " * 20
    assert len(text.encode()) > ROUTE_BYTES
    assert route_key(Request(id="t1", prompt=text + "Q1")) == route_key(Request(id="t2", prompt=text + "Q2"))
    assert route_key(Request(id="t3", prompt="short")) is None
    assert work_estimate(a) == len(a.prompt_token_ids) + a.max_tokens


def test_requests_sharing_a_prefix_meet_on_one_shard_and_the_shards_stay_balanced():
    reqs = _job(64, 16)
    router = PrefixRouter(2)
    shards = router.assign(reqs)
    homes: dict[str, set[int]] = {}
    for req, shard in zip(reqs, shards):
        homes.setdefault(_prefix_of(req), set()).add(shard)
    split = [p for p, s in homes.items() if len(s) > 1]
    # Whole groups fit: at most a group or two straddles two shards to even out the load.
    assert len(split) <= 2, split
    total = sum(router.load)
    assert max(router.load) <= total / 2 * (1 + router.slack) + max(work_estimate(r) for r in reqs)
    assert router.spilled < len(reqs) * 0.1
    assert router.routed == len(reqs)
    # Round robin by id would have split every prefix over both shards.
    by_id = [shard_index(r.id, None, 2) for r in reqs]
    assert sum(len({s for r, s in zip(reqs, by_id) if _prefix_of(r) == p}) > 1 for p in homes) > 50


def test_one_prefix_for_the_whole_job_spills_over_instead_of_loading_one_shard():
    reqs = _job(1, 200, seed=1)
    router = PrefixRouter(4)
    shards = router.assign(reqs)
    assert set(shards) == {0, 1, 2, 3}
    total = sum(router.load)
    assert max(router.load) <= total / 4 * (1 + router.slack) + max(work_estimate(r) for r in reqs)
    assert router.spilled > 100  # three quarters of the job left the prefix's first shard


def test_a_prefix_keeps_its_shard_across_submissions_and_loads_add_up():
    reqs = _job(40, 8, seed=2)
    router = PrefixRouter(3)
    first = dict(zip((r.id for r in reqs[:160]), router.assign(reqs[:160])))
    second = dict(zip((r.id for r in reqs[160:]), router.assign(reqs[160:])))
    home = {}
    for rid, shard in first.items():
        home.setdefault(rid.split("s")[0], shard)
    moved = [rid for rid, shard in second.items() if rid.split("s")[0] in home and home[rid.split("s")[0]] != shard]
    assert len(moved) <= len(second) // 10
    assert sum(router.load) == sum(work_estimate(r) for r in reqs)


def test_short_prompts_and_route_id_go_by_the_request_id():
    short = [_req(f"r{i}", [5, 6, 7], 4) for i in range(50)]
    assert PrefixRouter(3).assign(short) == [shard_index(r.id, None, 3) for r in short]
    reqs = _job(8, 4, seed=3)
    assert PrefixRouter(3, route="id").assign(reqs) == [shard_index(r.id, None, 3) for r in reqs]
    assert not PrefixRouter(1).by_prefix and PrefixRouter(1).assign(reqs) == [0] * len(reqs)
    with pytest.raises(ValueError, match="route"):
        PrefixRouter(2, route="round-robin")


def test_the_key_names_the_cache_partition_of_the_scope():
    ids = list(range(3, 3 + ROUTE_TOKENS))

    def req(rid, tenant="default", salt=None):
        return Request(id=rid, prompt_token_ids=ids + [1], tenant=tenant, cache_salt=salt)

    acme, acme2, beta = req("a", "acme"), req("a2", "acme"), req("b", "beta")
    # Default scope (tenant): one key per tenant and salt, so a group never spans tenants.
    assert route_key(acme) == route_key(acme2) != route_key(beta)
    assert route_key(acme) != route_key(req("s", "acme", salt="x")) != route_key(req("s2", "beta", salt="x"))
    # Global: the tenant plays no part, and without a salt the key is the leading prompt alone.
    assert route_key(acme, "global") == route_key(beta, "global") == b"t" + b"".join(
        t.to_bytes(4, "little") for t in ids)
    assert route_key(req("s", "acme", salt="x"), "global") == route_key(req("s2", "beta", salt="x"), "global")
    assert route_key(req("s", salt="x"), "global") != route_key(acme, "global")
    # A router groups by those keys.
    assert len(PrefixRouter(2).unhomed_keys([acme, acme2, beta])) == 2
    assert len(PrefixRouter(2, prefix_cache_scope="global").unhomed_keys([acme, acme2, beta])) == 1
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        PrefixRouter(2, prefix_cache_scope="everyone")
