"""Prefix-aware routing of requests to shard streams.

With several shard streams (``--shards N``, one or more workers reading each), a request should go
where the KV blocks of its prompt prefix are likely cached: the shard that already received
requests with the same leading prompt. The route key is that leading prompt, the first
``ROUTE_TOKENS`` token ids (a few KV blocks) or, for text and chats whose tokens the producer
cannot see, the first ``ROUTE_BYTES`` bytes in the prefix-tree encoding of ``prefix_order``.
A prompt shorter than that has no key: it shares no full block with anyone worth chasing, and it
goes to the shard of its id, as without routing (a hash spreads such requests evenly). The key
starts with the request's cache partition under the workers' prefix cache scope
(schemas/cache_scope.py: tenant and ``cache_salt`` under ``tenant``, the default; the salt alone
under ``global``), since requests of two partitions share no KV: a prefix group never spans
partitions, and a worker publishes what its tiers hold under the key of the partition that wrote it.

Balance comes before locality, but within a slack: ``PrefixRouter.assign`` places one
submission's requests group by group (heaviest first) on the group's home shard (where the key
went before, else a stable hash of the key) while that shard stays within ``1 + slack`` of its
share of the work; otherwise the group, or the part of it that does not fit, spills over to the
least loaded shard, which then becomes another home of the key. Work is estimated as prompt
length plus ``max_tokens`` (bytes / 4 for text). The loads add up over the router's lifetime, so
a producer that submits in chunks stays balanced over the chunks; ``spilled`` counts the requests
not sent to their first home, the price of the balance in prefix locality.

Workers with KV tiers (docs/kv-tiers.md) publish the prefixes their tiers hold (the digests of
their route keys, :func:`route_digest`, in :func:`~mqinfer.schemas.keys.kv_tier_prefixes` of their
stream); a router given ``tier_homes`` (:func:`tier_homes_from` reads those sets) makes the shard
that holds a prefix its home when the router has no home for it yet, so that a new producer, or a
re-run of a job, sends a prefix where its KV already is rather than to its hash's shard.

Where a request lives is then no longer a function of its id alone: whoever needs it later
(``cancel``, a resumed job) either remembers the shard or looks in every shard.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Sequence

from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition, check_scope
from mqinfer.schemas.keys import kv_tier_prefixes, shard_index
from mqinfer.schemas.prefix_order import prompt_key
from mqinfer.schemas.request import Request

ROUTE_TOKENS = 64  # four blocks of the default block size
ROUTE_BYTES = 256  # about as much text as ROUTE_TOKENS tokens
DEFAULT_SLACK = 0.1
ROUTES = ("prefix", "id")


def route_key(request: Request, scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> bytes | None:
    """The cache partition (under the prefix cache ``scope``) and leading prompt that decide the
    request's shard, or None when the prompt is shorter. Without a partition (``global``, no
    salt) the key is the leading prompt alone, as before scopes existed."""
    kind, key = prompt_key(request)
    if kind == 0:
        ids = key[:ROUTE_TOKENS]
        if len(ids) < ROUTE_TOKENS:
            return None
        out = b"t" + b"".join(int(t).to_bytes(4, "little", signed=False) for t in ids)
    elif len(key) < ROUTE_BYTES:
        return None
    else:
        out = b"b" + key[:ROUTE_BYTES]
    partition = cache_partition(scope, request.tenant, request.cache_salt)
    return b"p" + len(partition).to_bytes(4, "little") + partition + out if partition else out


def route_digest(key: bytes) -> bytes:
    """The 8 bytes workers publish for a route key whose prefix their KV tiers hold."""
    return hashlib.blake2b(key, digest_size=8).digest()


def queue_tier_lookup(pipe, streams: Sequence[str], route_keys: list[bytes]) -> None:
    """Queue on ``pipe`` (a non-transactional pipeline, sync or asyncio) the lookup of
    ``route_keys`` in each shard's published prefixes; :func:`tier_homes_of` reads its replies."""
    digests = [route_digest(k) for k in route_keys]
    for stream in streams:
        pipe.zmscore(kv_tier_prefixes(stream), digests)


def tier_homes_of(route_keys: list[bytes], replies: Sequence[Sequence[float | None] | None]) -> dict[bytes, int]:
    """For each route key, the shard whose workers saw it last, if any did (``replies``: the
    scores :func:`queue_tier_lookup` asked for, one list per shard)."""
    found: dict[bytes, tuple[float, int]] = {}
    for shard, scores in enumerate(replies):
        for key, score in zip(route_keys, scores or ()):
            if score is not None and (key not in found or score > found[key][0]):
                found[key] = (score, shard)
    return {key: shard for key, (_, shard) in found.items()}


def tier_homes_from(client, streams: Sequence[str]) -> Callable[[list[bytes]], dict[bytes, int]]:
    """A ``PrefixRouter.tier_homes`` reading the workers' published prefixes with ``client`` (a
    redis.Redis): for each route key, the shard whose workers saw it last, if any did."""

    def homes(route_keys: list[bytes]) -> dict[bytes, int]:
        pipe = client.pipeline(transaction=False)
        queue_tier_lookup(pipe, streams, route_keys)
        return tier_homes_of(route_keys, pipe.execute())

    return homes


def work_estimate(request: Request) -> int:
    """Tokens a request will occupy a worker with: prompt plus the most it may generate."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.messages is not None:
        prompt = sum(len(m.content.encode()) for m in request.messages) // 4 + 4 * len(request.messages)
    else:
        prompt = len((request.prompt or "").encode()) // 4
    return max(1, prompt + int(request.max_tokens or 0))


@dataclass
class _Group:
    key: bytes | None
    members: list[int]  # positions in the submission
    work: int


class PrefixRouter:
    """Decides the shard of each request of a submission (see the module docstring).

    ``route="id"`` keeps the plain placement by a hash of (job_id, id); ``prefix_cache_scope`` is the
    workers' (``--prefix-cache-scope``), which decides the partition part of a route key. State: the work sent to
    each shard, the shards each recent key went to (at most ``max_keys``), and ``spilled``.
    """

    def __init__(self, shards: int, *, route: str = "prefix", slack: float = DEFAULT_SLACK,
                 max_keys: int = 100_000, tier_homes: Callable[[list[bytes]], dict[bytes, int]] | None = None,
                 prefix_cache_scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.shards = shards
        self.route = route
        # The workers' prefix cache scope: route keys name the partition the KV is cached in.
        self.prefix_cache_scope = check_scope(prefix_cache_scope)
        self.slack = slack
        self.max_keys = max_keys
        self.load = [0] * shards
        self.spilled = 0
        self.routed = 0
        self._homes: OrderedDict[bytes, list[int]] = OrderedDict()
        # Where the workers' KV tiers hold a prefix (see the module docstring), asked for the keys
        # the router has no home for; and how many groups went to such a home.
        self.tier_homes = tier_homes
        self.tier_routed = 0

    @property
    def by_prefix(self) -> bool:
        """Whether a request's shard may depend on more than its id."""
        return self.route == "prefix" and self.shards > 1

    def assign(self, requests: Sequence[Request]) -> list[int]:
        """The shard of each request, in the order given."""
        if not self.by_prefix:
            out = [shard_index(r.id, r.job_id, self.shards) for r in requests]
            for req, shard in zip(requests, out):
                self.load[shard] += work_estimate(req)
            self.routed += len(requests)
            return out
        groups: dict[bytes, _Group] = {}
        loose: list[_Group] = []
        for i, req in enumerate(requests):
            key = route_key(req, self.prefix_cache_scope)
            work = work_estimate(req)
            if key is None:
                loose.append(_Group(None, [i], work))
                continue
            group = groups.setdefault(key, _Group(key, [], 0))
            group.members.append(i)
            group.work += work
        if self.tier_homes is not None:
            self._seed_tier_homes([k for k in groups if k not in self._homes])
        out = [0] * len(requests)
        target = (sum(self.load) + sum(g.work for g in groups.values()) + sum(g.work for g in loose)) / self.shards
        limit = target * (1.0 + self.slack)
        # Heaviest groups first: they are the hardest to fit, and the light ones fill the gaps.
        for group in sorted(groups.values(), key=lambda g: -g.work):
            self._place(group, requests, out, limit)
        for group in loose:
            req = requests[group.members[0]]
            shard = shard_index(req.id, req.job_id, self.shards)
            out[group.members[0]] = shard
            self.load[shard] += group.work
        self.routed += len(requests)
        return out

    def _seed_tier_homes(self, new_keys: list[bytes]) -> None:
        """Make the shard whose workers' tiers hold a prefix its home; routing goes on by hash when
        the lookup fails (it is an optimisation, never a reason to refuse a submission)."""
        if not new_keys:
            return
        try:
            found = self.tier_homes(new_keys)
        except Exception:
            return
        self.add_tier_homes(found)

    def unhomed_keys(self, requests: Sequence[Request]) -> list[bytes]:
        """The distinct route keys of ``requests`` that have no home yet (none unless routing by
        prefix): what a caller that looks tier homes up itself (the asyncio client) asks for."""
        if not self.by_prefix:
            return []
        scope = self.prefix_cache_scope
        keys = {key for key in (route_key(r, scope) for r in requests) if key is not None and key not in self._homes}
        return list(keys)

    def add_tier_homes(self, found: dict[bytes, int]) -> None:
        """Make each key's shard (whose workers' tiers hold its prefix) its home."""
        for key, shard in found.items():
            if 0 <= shard < self.shards:
                self._homes[key] = [shard]
                self.tier_routed += 1

    def _place(self, group: _Group, requests: Sequence[Request], out: list[int], limit: float) -> None:
        assert group.key is not None
        homes = self._homes.get(group.key)
        if homes is None:
            homes = [zlib.crc32(group.key) % self.shards]
            self._homes[group.key] = homes
            if len(self._homes) > self.max_keys:
                self._homes.popitem(last=False)
        else:
            self._homes.move_to_end(group.key)
        first = homes[0]
        for i in group.members:
            work = work_estimate(requests[i])
            shard = min(homes, key=self.load.__getitem__)
            if self.load[shard] + work > limit and self.load[shard] > 0:
                shard = min(range(self.shards), key=self.load.__getitem__)
                if shard not in homes:
                    homes.append(shard)
            if shard != first:
                self.spilled += 1
            out[i] = shard
            self.load[shard] += work


__all__ = ["DEFAULT_SLACK", "PrefixRouter", "ROUTES", "ROUTE_BYTES", "ROUTE_TOKENS", "route_digest", "route_key",
           "tier_homes_from", "work_estimate"]
