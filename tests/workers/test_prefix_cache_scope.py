"""The prefix cache's scope with real workers: under the default scope (``tenant``) a tenant's
request after another tenant's identical prompt is charged for its whole prompt, whether the
other's KV sits in the device cache or in the host, disk or shared tier, while requests of one
tenant share as before; ``cache_salt`` separates requests within a scope; ``global`` shares between
tenants as before scopes existed; greedy float32 outputs are the same under every scope."""

from __future__ import annotations

import random

import pytest

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.engine import kv_codec
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from tests.workers.harness import WorkerHarness, submit

BLOCK = 16
PREFIX_TOKENS = 4 * BLOCK
TIERS = ("host_cached_tokens", "disk_cached_tokens", "shared_cached_tokens")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def prompt(seed: int, tail: int) -> list[int]:
    """A 64-token prefix (four full blocks) chosen by ``seed``, then two tokens of its own."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PREFIX_TOKENS)] + [tail, (tail * 7) % 256]


def request(rid: str, tenant: str, seed: int = 1, tail: int = 1, **fields) -> dict:
    return {"id": rid, "job_id": "scope", "tenant": tenant, "prompt_token_ids": prompt(seed, tail),
            "max_tokens": 3, "temperature": 0, "ignore_eos": True, **fields}


def start(redis_url, out, consumer, scope: str | None = None, **engine) -> WorkerHarness:
    settings = dict(num_threads=1, kv_cache_dtype="int8", num_kv_blocks=32, max_num_seqs=2, max_model_len=256)
    if scope is not None:
        settings["prefix_cache_scope"] = scope
    settings.update(engine)
    return WorkerHarness(redis_url, out, consumer=consumer, engine=EngineConfig(**settings)).start()


def run_one(h: WorkerHarness, redis_client, req: dict) -> dict:
    """Submit ``req`` alone and turn the worker until its cost row is written: that row."""
    submit(redis_client, req)

    def row():
        return next((c for c in h.costs() if c["kind"] == "request" and c["id"] == req["id"]), None)

    return h.until(row, max_turns=2000, advance_s=0.01, what=f"the cost row of {req['id']}")


def tier_tokens(cost: dict) -> dict[str, int]:
    return {t: cost[t] or 0 for t in TIERS}


def forget_device_cache(h: WorkerHarness) -> None:
    """Drop the device's prefix cache, so that a lookup can find a prefix only in the tiers."""
    assert h.worker.engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache() > 0


def test_default_scope_shares_nothing_between_tenants_on_the_device(redis_url, redis_client, tmp_path):
    h = start(redis_url, tmp_path / "out", "scope-device")
    assert run_one(h, redis_client, request("a1", "acme"))["cached_prompt_tokens"] == 0
    # acme's prefix is in the device cache: globex's identical prompt finds none of it.
    assert run_one(h, redis_client, request("b1", "globex"))["cached_prompt_tokens"] == 0
    # Within one tenant, sharing is unchanged (and globex now has its own copy).
    assert run_one(h, redis_client, request("a2", "acme", tail=2))["cached_prompt_tokens"] == PREFIX_TOKENS
    assert run_one(h, redis_client, request("b2", "globex", tail=2))["cached_prompt_tokens"] == PREFIX_TOKENS
    h.stop()


def tiered_round(redis_url, redis_client, tmp_path, scope: str | None) -> dict[str, dict]:
    """acme's prompt computed by a worker with host, disk and shared tiers; then, with only the
    tiers holding it, the same prompt from other tenants: on that worker (device cache dropped, so
    the host tier answers first), on a new worker with the disk tier only and on one with the shared
    tier only, each followed by acme again. The cost rows by id."""
    disk, shared = tmp_path / "kv-disk", tmp_path / "kv-shared"
    costs: dict[str, dict] = {}
    h = start(redis_url, tmp_path / "out1", "scope-1", scope, kv_host_cache_gib=0.01, kv_disk_cache=str(disk),
              kv_shared_cache=str(shared))
    costs["a1"] = run_one(h, redis_client, request("a1", "acme"))
    forget_device_cache(h)
    costs["b1"] = run_one(h, redis_client, request("b1", "globex", tail=2))
    forget_device_cache(h)
    costs["a2"] = run_one(h, redis_client, request("a2", "acme", tail=3))
    h.stop()  # flushes the directory tiers
    for name, tier in (("disk", {"kv_disk_cache": str(disk)}), ("shared", {"kv_shared_cache": str(shared)})):
        h = start(redis_url, tmp_path / f"out-{name}", f"scope-{name}", scope, **tier)
        costs[f"c-{name}"] = run_one(h, redis_client, request(f"c-{name}", f"initech-{name}", tail=4))
        forget_device_cache(h)
        costs[f"a-{name}"] = run_one(h, redis_client, request(f"a-{name}", "acme", tail=5))
        h.stop()
    return costs


def test_default_scope_shares_nothing_between_tenants_from_any_tier(redis_url, redis_client, tmp_path):
    costs = tiered_round(redis_url, redis_client, tmp_path, scope=None)
    assert costs["a1"]["cached_prompt_tokens"] == 0
    # Other tenants: nothing from the host tier, the disk tier or the shared tier.
    for rid in ("b1", "c-disk", "c-shared"):
        assert costs[rid]["cached_prompt_tokens"] == 0, rid
        assert tier_tokens(costs[rid]) == dict.fromkeys(TIERS, 0), rid
    # acme itself is served by each tier in turn, as before.
    assert tier_tokens(costs["a2"]) == {"host_cached_tokens": PREFIX_TOKENS, "disk_cached_tokens": 0,
                                        "shared_cached_tokens": 0}
    assert costs["a-disk"]["disk_cached_tokens"] == PREFIX_TOKENS
    assert costs["a-shared"]["shared_cached_tokens"] == PREFIX_TOKENS
    assert all(costs[r]["cached_prompt_tokens"] == PREFIX_TOKENS for r in ("a2", "a-disk", "a-shared"))


def test_global_scope_shares_between_tenants_from_every_tier_as_before(redis_url, redis_client, tmp_path):
    costs = tiered_round(redis_url, redis_client, tmp_path, scope="global")
    assert costs["a1"]["cached_prompt_tokens"] == 0
    assert costs["b1"]["host_cached_tokens"] == PREFIX_TOKENS
    assert costs["c-disk"]["disk_cached_tokens"] == PREFIX_TOKENS
    assert costs["c-shared"]["shared_cached_tokens"] == PREFIX_TOKENS
    assert all(costs[r]["cached_prompt_tokens"] == PREFIX_TOKENS for r in costs if r != "a1")


def test_a_tier_written_under_one_scope_is_not_read_under_the_other(redis_url, redis_client, tmp_path):
    disk = tmp_path / "kv-disk"
    h = start(redis_url, tmp_path / "out1", "scope-global", "global", kv_disk_cache=str(disk))
    run_one(h, redis_client, request("g1", "acme"))
    h.stop()
    h = start(redis_url, tmp_path / "out2", "scope-tenant", "tenant", kv_disk_cache=str(disk))
    cost = run_one(h, redis_client, request("t1", "acme", tail=2))
    assert cost["cached_prompt_tokens"] == 0 and cost["disk_cached_tokens"] == 0
    h.stop()
    # The tenant worker wrote its own blocks beside the global worker's: a global worker finds its own.
    h = start(redis_url, tmp_path / "out3", "scope-global-2", "global", kv_disk_cache=str(disk))
    assert run_one(h, redis_client, request("g2", "acme", tail=3))["disk_cached_tokens"] == PREFIX_TOKENS
    h.stop()


def test_the_tier_blob_identity_names_the_scope(tmp_path):
    """Blobs carry the identity of the scope that wrote them, and a blob of one scope is foreign
    to a worker of the other even under the very key it asks for."""
    blobs, tiers = {}, {}
    for scope in ("tenant", "global"):
        eng = LLMEngine(EngineConfig(kv_cache_dtype="int8", num_kv_blocks=16, max_model_len=256, num_threads=1,
                                     kv_disk_cache=str(tmp_path / scope), prefix_cache_scope=scope))
        tiers[scope] = eng.kv_tiers
        try:
            eng.add_request("r", prompt(1, 1), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
        finally:
            eng.close()
        files = sorted((tmp_path / scope).glob("*.kv"))
        assert len(files) == 4  # the prompt's four full blocks
        assert {kv_codec.peek_key(f.read_bytes())[0] for f in files} == {tiers[scope].identity}
        blobs[scope] = [f.read_bytes() for f in files]
    assert tiers["tenant"].identity != tiers["global"].identity

    def first_block(scope: str, identity: bytes):
        """Decode the global scope's blob of the prompt's first block under ``identity``."""
        tokens = prompt(1, 1)[:BLOCK]
        for blob in blobs["global"]:
            try:
                return kv_codec.decode(blob, identity, kv_codec.peek_key(blob)[1], tokens, tiers[scope].geometry)
            except kv_codec.BlockRejected as exc:
                if exc.reason != "tokens":
                    raise
        raise AssertionError("no blob of the first block")

    assert first_block("global", tiers["global"].identity) is not None
    with pytest.raises(kv_codec.BlockRejected) as rejected:
        first_block("tenant", tiers["tenant"].identity)
    assert rejected.value.reason == "foreign"


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_cache_salt_separates_requests_within_the_scope(redis_url, redis_client, tmp_path, scope):
    h = start(redis_url, tmp_path / "out", f"salt-{scope}", scope)
    run_one(h, redis_client, request("s1", "acme", cache_salt="team-red"))
    # Another salt, or none, shares nothing with it, even within one tenant.
    assert run_one(h, redis_client, request("s2", "acme", tail=2, cache_salt="team-blue"))["cached_prompt_tokens"] == 0
    assert run_one(h, redis_client, request("s3", "acme", tail=3))["cached_prompt_tokens"] == 0
    assert run_one(h, redis_client, request("s4", "acme", tail=4, cache_salt="team-red"))["cached_prompt_tokens"] \
        == PREFIX_TOKENS
    # The same salt from another tenant: shared only under the global scope.
    other = run_one(h, redis_client, request("s5", "globex", tail=5, cache_salt="team-red"))["cached_prompt_tokens"]
    assert other == (PREFIX_TOKENS if scope == "global" else 0)
    h.stop()


def test_a_bad_cache_salt_gets_an_error_row_naming_the_field(redis_url, redis_client, tmp_path):
    h = start(redis_url, tmp_path / "out", "salt-bad")
    submit(redis_client, request("empty", "acme", cache_salt=""))
    submit(redis_client, request("number", "acme", cache_salt=7))
    submit(redis_client, request("fine", "acme", tail=2, cache_salt="ok"))
    h.until(lambda: len(h.results()) == 3, max_turns=2000, advance_s=0.01, what="three rows")
    h.stop()
    rows = {r["id"]: r for r in h.results()}
    for rid in ("empty", "number"):
        assert rows[rid]["finish_reason"] == "error" and rows[rid]["error_code"] == "invalid_request"
        assert "$.cache_salt" in rows[rid]["error"]
    assert rows["fine"]["finish_reason"] == "length"


def test_greedy_float32_outputs_are_the_same_under_every_scope(redis_url, redis_client, tmp_path):
    """Three tenants over two prefixes, salted and not: under ``tenant`` most prefixes are computed
    again, under ``global`` shared; the tokens generated are the same."""
    workload = [request(f"r{i}", ("acme", "globex", "initech")[i % 3], seed=i % 2, tail=i, max_tokens=8,
                        **({"cache_salt": "s"} if i % 4 == 3 else {})) for i in range(8)]
    outputs, cached = {}, {}
    for scope in ("tenant", "global"):
        h = start(redis_url, tmp_path / scope, f"f32-{scope}", scope, dtype="float32", kv_cache_dtype="auto")
        rows = [run_one(h, redis_client, dict(r, job_id=f"f32-{scope}")) for r in workload]
        h.stop()
        cached[scope] = sum(c["cached_prompt_tokens"] for c in rows)
        outputs[scope] = {r["id"]: r["output_token_ids"] for r in h.results()}
    assert cached["global"] > cached["tenant"]  # the scopes did share differently
    assert len(outputs["tenant"]) == len(workload)
    assert outputs["tenant"] == outputs["global"]
