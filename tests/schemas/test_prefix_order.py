"""Prefix-tree order of a job's requests (schemas/prefix_order.py)."""

from __future__ import annotations

from mqinfer.schemas.prefix_order import prefix_order
from mqinfer.schemas.request import ChatMessage, Request


def _ids(*prompts: list[int]) -> list[Request]:
    return [Request(id=f"r{i}", prompt_token_ids=p) for i, p in enumerate(prompts)]


def test_requests_sharing_a_prefix_become_neighbours_in_tree_order():
    a, b = [5, 6, 7, 8], [9, 9, 9]
    requests = _ids(a + [1], b + [2], a + [3], [4], b + [1], a, a + [1, 0])
    ordered = [r.prompt_token_ids for r in prefix_order(requests)]
    # Depth-first: [4], then the a-subtree (a itself first, then its children in order), then b's.
    assert ordered == [[4], a, a + [1], a + [1, 0], a + [3], b + [1], b + [2]]


def test_the_order_is_stable_and_keeps_every_request():
    same = [Request(id=f"s{i}", prompt="the same prompt") for i in range(5)]
    mixed = [Request(id="t", prompt="zebra"), *same, Request(id="u", prompt="apple")]
    ordered = prefix_order(mixed)
    assert [r.id for r in ordered] == ["u", "s0", "s1", "s2", "s3", "s4", "t"]
    assert sorted(r.id for r in ordered) == sorted(r.id for r in mixed)


def test_chats_group_by_their_first_messages_and_ids_come_before_text():
    system = ChatMessage(role="system", content="You answer in French.")

    def chat(rid: str, *turns: str) -> Request:
        return Request(id=rid, messages=[system, *(ChatMessage(role="user", content=t) for t in turns)])

    requests = [chat("c1", "b"), Request(id="p", prompt="system prompt text"),
                Request(id="other", messages=[ChatMessage(role="system", content="Be brief."),
                                              ChatMessage(role="user", content="a")]),
                chat("c2", "a"), Request(id="ids", prompt_token_ids=[3, 2]), chat("c3", "a", "more")]
    ordered = [r.id for r in prefix_order(requests)]
    assert ordered[0] == "ids"
    # The three chats with the same system message are adjacent, in tree order.
    start = ordered.index("c2")
    assert ordered[start : start + 3] == ["c2", "c3", "c1"]
    assert set(ordered) == {r.id for r in requests}


def test_the_order_keeps_each_cache_partition_together():
    """Under the default scope a prefix group never spans tenants or salts; under global, requests
    without a salt sort by prompt alone, as before scopes existed."""
    def req(rid, tenant, ids, salt=None):
        return Request(id=rid, tenant=tenant, prompt_token_ids=ids, cache_salt=salt)

    requests = [req("a1", "acme", [5, 1]), req("b1", "beta", [5, 2]), req("a2", "acme", [5, 3]),
                req("b2", "beta", [5, 0]), req("s1", "acme", [5, 4], salt="x"), req("a0", "acme", [4])]
    by_tenant = [r.id for r in prefix_order(requests)]
    assert by_tenant == ["a0", "a1", "a2", "s1", "b2", "b1"]
    assert [r.id for r in prefix_order(requests, "tenant")] == by_tenant
    # Global: the salted request apart from the rest, the others by their prompts whatever the tenant.
    assert [r.id for r in prefix_order(requests, "global")] == ["a0", "b2", "a1", "b1", "a2", "s1"]
