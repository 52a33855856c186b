"""Publishing the prompt prefixes a worker's KV tiers hold, for prefix routing.

A worker with KV tiers (workers/engine/kv_tiers.py) writes every full prompt block through to them, so once
it has run a request whose prompt is at least a route key long (``schemas/routing.py``: the first 64
token ids, or 256 bytes of text), its tiers hold that prefix. It records the route key's digest and,
about once a second, adds what it recorded to the sorted set
:func:`~mqinfer.schemas.keys.kv_tier_prefixes` of its stream, scored by the time; producers that route
by prefix read those sets (``tier_homes_from``) and send the prefix to this worker's shard. The set
keeps the newest ``max_prefixes`` entries and expires a week after the last write: it is a hint, and a
wrong or stale one costs only a prefix computed again.
"""

from __future__ import annotations

from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE
from mqinfer.schemas.keys import kv_tier_prefixes
from mqinfer.schemas.request import Request
from mqinfer.schemas.routing import route_digest, route_key

PUBLISH_EVERY_S = 1.0
MAX_PREFIXES = 100_000
TTL_S = 7 * 86_400


class TierPrefixes:
    def __init__(self, client, stream: str, *, max_prefixes: int = MAX_PREFIXES, ttl_s: int = TTL_S,
                 prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> None:
        self.client = client
        # The worker's scope: a prefix is published under the route key of the cache partition
        # its KV was written in, so only producers routing that partition find it.
        self.prefix_cache_scope = prefix_cache_scope
        self.key = kv_tier_prefixes(stream)
        self.max_prefixes = max_prefixes
        self.ttl_s = ttl_s
        self._pending: set[bytes] = set()
        self._last = float("-inf")

    def add(self, request: Request) -> None:
        """A request this worker ran to the end: its prompt's prefix is in the tiers now."""
        key = route_key(request, self.prefix_cache_scope)
        if key is not None:
            self._pending.add(route_digest(key))

    def publish(self, now: float) -> None:
        """Add the prefixes recorded since the last call (at most once per ``PUBLISH_EVERY_S``)."""
        if not self._pending or now - self._last < PUBLISH_EVERY_S:
            return
        digests, self._pending = self._pending, set()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.key, {d: now for d in digests})
        pipe.zremrangebyrank(self.key, 0, -self.max_prefixes - 1)
        pipe.expire(self.key, self.ttl_s)
        try:
            pipe.execute()
        except Exception:
            self._pending |= digests  # Redis away: the worker's reconnect logic handles it; try again later
            raise
        self._last = now


__all__ = ["TierPrefixes"]
