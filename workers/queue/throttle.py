"""The throttle: requests of rate-limited tenants, held between ingest and the batcher until their
tenant's bucket (:mod:`.buckets`) gives them their tokens.

Each limited tenant has its own first-come-first-served queue here, so a tenant over its limit
holds back only its own requests: other tenants' requests, limited or not, go past it. A tenant's
queue asks its bucket once per :meth:`Throttle.release` at most, for up to ``max_take`` requests at
a time, and after a refusal not again before the bucket says the next one would fit, so a
throttled tenant costs one script call per refill interval, not one per loop turn. A request held
here has never reached the engine; once its ``deadline`` passes it is given back as expired (the
worker ends it with error ``rate_limited``). Requests of tenants without a limit never come here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from mqinfer.workers.queue.buckets import TokenBuckets
from mqinfer.workers.tenant_limits import TenantLimit


@dataclass(slots=True)
class Held:
    """A request waiting here: its entry, tenant, token cost, deadline and since when it waits."""

    entry_id: str
    tenant: str
    tokens: int
    deadline: float | None
    since: float
    # Refused by its bucket at least once (it waited on the limit, not only for its turn).
    throttled: bool = False


@dataclass(slots=True)
class _Queue:
    waiting: dict[str, Held] = field(default_factory=dict)  # in arrival order
    # Not before this time may the tenant's bucket be asked again.
    retry_at: float = -math.inf


@dataclass(slots=True)
class Released:
    """What one :meth:`Throttle.release` gives back: entries whose tokens were taken, in order,
    and entries whose deadline passed while they waited."""

    admitted: list[Held] = field(default_factory=list)
    expired: list[Held] = field(default_factory=list)


class Throttle:
    def __init__(self, limits: Mapping[str, TenantLimit], buckets: TokenBuckets, *, max_take: int, metrics,
                 clock: Callable[[], float]) -> None:
        self.limits = dict(limits)
        self.buckets = buckets
        self.max_take = max_take
        self.metrics = metrics
        self.clock = clock
        # One queue per limited tenant, made once: the dict never changes size, so the metrics'
        # scrape thread may read the queues' lengths at any time.
        self.queues = {tenant: _Queue() for tenant in self.limits}
        self._deadlines: list[tuple[float, str, str]] = []  # (deadline, entry id, tenant)
        self._held = 0
        # What release() has taken out of the queues and not yet handed over: kept across a call
        # that a Redis error interrupted, so that nothing taken is lost.
        self._out = Released()

    def __len__(self) -> int:
        return self._held

    def limits_tenant(self, tenant: str) -> bool:
        return tenant in self.queues

    def waiting_by_tenant(self) -> dict[str, int]:
        """Requests held per limited tenant (safe to call from another thread)."""
        return {tenant: len(q.waiting) for tenant, q in self.queues.items()}

    def add(self, entry_id: str, tenant: str, tokens: int, deadline: float | None) -> None:
        """Hold a request of a limited tenant until its bucket gives it ``tokens``."""
        self.queues[tenant].waiting[entry_id] = Held(entry_id, tenant, tokens, deadline, self.clock())
        self._held += 1
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, entry_id, tenant))

    def remove(self, entry_id: str, tenant: str) -> Held | None:
        """Take a request out (cancelled, or no longer this worker's); None when not held here."""
        queue = self.queues.get(tenant)
        held = queue.waiting.pop(entry_id, None) if queue is not None else None
        if held is not None:
            self._held -= 1
            self._left(held, self.clock())
        return held

    def entries(self) -> Iterable[Held]:
        """Every request held, tenant by tenant, each tenant's in arrival order."""
        for queue in self.queues.values():
            yield from queue.waiting.values()

    def release(self, now: float) -> Released:
        """Ask the buckets of the tenants whose turn has come, and give back what they admitted
        and what waited past its deadline. A Redis error propagates; what was taken before it
        comes back from the next call."""
        out = self._out
        for tenant, queue in self.queues.items():
            if not queue.waiting or now < queue.retry_at:
                continue
            head = []
            for held in queue.waiting.values():
                head.append(held)
                if len(head) == self.max_take:
                    break
            taken, wait_s = self.buckets.take(tenant, [h.tokens for h in head])
            for held in head[:taken]:
                del queue.waiting[held.entry_id]
                self._left(held, now)
                out.admitted.append(held)
            self._held -= taken
            if taken < len(head):
                queue.retry_at = now + wait_s
                for held in head[taken:]:
                    self._refused(held)
            else:
                queue.retry_at = -math.inf
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, entry_id, tenant = heapq.heappop(deadlines)
            held = self.queues[tenant].waiting.pop(entry_id, None)
            if held is None:
                continue  # admitted or removed before its deadline
            self._held -= 1
            self._refused(held)
            self._left(held, now)
            out.expired.append(held)
        if len(deadlines) > 2 * self._held + 64:  # entries left behind by admitted requests
            self._deadlines = [d for d in deadlines if d[1] in self.queues[d[2]].waiting]
            heapq.heapify(self._deadlines)
        self._out = Released()
        return out

    def time_until_retry(self, now: float) -> float | None:
        """Seconds until some tenant's bucket is to be asked again (0: now); None when nothing waits."""
        times = [q.retry_at for q in self.queues.values() if q.waiting]
        times += [self._deadlines[0][0]] if self._deadlines and self._held else []
        if not times:
            return None
        return max(0.0, min(times) - now)

    def _refused(self, held: Held) -> None:
        if not held.throttled:
            held.throttled = True
            self.metrics.rate_limit_throttled(held.tenant, held.tokens)

    def _left(self, held: Held, now: float) -> None:
        if held.throttled:
            self.metrics.rate_limit_waited(held.tenant, max(0.0, now - held.since))
