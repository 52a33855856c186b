"""The waiting queue: requests by tenant, and fair share between tenants by virtual token counters.

Each tenant has a counter of the service it has received, divided by its weight
(``SchedulerConfig.tenant_weights``, 1 when not named): ``PROMPT_TOKEN_WEIGHT`` per prompt token
computed at a request's first admission (prefix-cache hits are free, and recomputing after a
preemption is not charged to the tenant) plus ``OUTPUT_TOKEN_WEIGHT`` per token generated. This is
the virtual token counter idea of "Fairness in Serving Large Language Models" (OSDI 2024).

Each tenant's waiting requests are a heap by the scheduler's order key (priority with aging, then
arrival; see scheduler.py), so a tenant's own requests keep exactly the scheduler's order. Which
tenant goes next:

* Among the tenants whose next request has the best (lowest) priority, the one with the smallest
  counter (ties: the earlier order key). Requests with a latency target (interactive) rank before
  all others whatever their priority (scheduler/slo.py), so priority levels are compared within
  the best latency class. A request of a better priority therefore always goes
  before one of a worse priority, whatever the counters, and within a level the tenant that has
  received the least weighted service goes first.
* Except when, in the plain order key, the first request of all has a worse priority than that:
  it has aged past the best level (``priority_aging_s``), and goes first, so that aging still
  guarantees that nothing starves.

With one tenant waiting this is the plain order, exactly as without tenants.

Idling earns no credit: a tenant that comes back (a new request while it has none unfinished) has
its counter lifted to the smallest counter among the tenants that have unfinished requests, or,
when there are none, to the counter of the last tenant that had some. Without this, a tenant idle
for an hour would then take every admission until its counter caught up with the others'.

Cost: with one tenant waiting, a heap operation per admission as before. With several, each
admission pass orders the waiting tenants once (O(T) for T waiting tenants) and each admission
then costs O(log T). Counters of idle tenants that the lift would overwrite anyway are forgotten
from time to time, so memory follows the active tenants, not every tenant ever seen.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from itertools import islice

from mqinfer.scheduler.request import EngineRequest

# The scheduler's order key: (latency class: 0 for a request with a latency target, 1 without;
# arrival_time + priority * aging (or the priority without aging), priority, arrival_time,
# sequence number). Smallest first; no two requests share one.
OrderKey = tuple[int, float, int, float, int]
Entry = tuple[OrderKey, EngineRequest]

# Service charged per prompt token computed and per output token generated (before dividing by
# the tenant's weight): a generated token costs a step of its own, a prompt token a share of one.
PROMPT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0

# Idle tenants' counters are swept once more than this many tenants are known (and then each time
# the number known has doubled).
_FORGET_SLACK = 256


class _Tenant:
    __slots__ = ("name", "weight", "counter", "waiting", "num_unfinished")

    def __init__(self, name: str, weight: float, counter: float) -> None:
        self.name = name
        self.weight = weight
        # Service received, divided by the weight.
        self.counter = counter
        # Heap of (order key, request) of its waiting requests. A request that finishes while
        # waiting leaves its entry behind, skipped once it reaches the top.
        self.waiting: list[Entry] = []
        # Requests of this tenant in the scheduler, waiting or running.
        self.num_unfinished = 0

    def head(self) -> Entry | None:
        """The first waiting entry, stale ones at the top dropped; None when none waits."""
        waiting = self.waiting
        while waiting:
            entry = waiting[0]
            if not entry[1].status.is_finished:
                return entry
            heapq.heappop(waiting)
        return None


class _TenantOrder:
    """The next tenant to serve, among tenants each given with its first request's order key and
    its counter: two heaps holding one live entry per tenant (older entries of a tenant are stale
    and skipped), one by (priority, counter, order key) for the fair choice within the best
    level, one by order key for the plain order."""

    __slots__ = ("_fair", "_plain", "_version")

    def __init__(self) -> None:
        self._fair: list[tuple[int, int, float, OrderKey, int, _Tenant]] = []
        self._plain: list[tuple[OrderKey, int, _Tenant]] = []
        self._version: dict[_Tenant, int] = {}

    def set(self, tenant: _Tenant, key: OrderKey, counter: float) -> None:
        """Enter the tenant, or replace its entry, with its head's key and its counter."""
        version = self._version.get(tenant, 0) + 1
        self._version[tenant] = version
        # Keys are unique, so the comparisons never reach the tenant objects.
        heapq.heappush(self._fair, (key[0], key[2], counter, key, version, tenant))
        heapq.heappush(self._plain, (key, version, tenant))

    def remove(self, tenant: _Tenant) -> None:
        if tenant in self._version:
            self._version[tenant] += 1

    def next(self) -> _Tenant | None:
        plain, fair, version = self._plain, self._fair, self._version
        while plain and plain[0][1] != version[plain[0][2]]:
            heapq.heappop(plain)
        if not plain:
            return None
        while fair[0][4] != version[fair[0][5]]:
            heapq.heappop(fair)
        first_key, _, first = plain[0]
        best_class, best_priority, _, _, _, fairest = fair[0]
        # The plain order's first request has a worse priority than the best level (of the best
        # latency class): it has aged past that level, and goes first.
        return first if (first_key[0], first_key[2]) > (best_class, best_priority) else fairest


def _walk(heap: list[Entry]) -> Iterator[Entry]:
    """The heap's live entries, smallest first, without popping: a best-first walk down from the
    root visits k entries in O(k log k), however big the heap is."""
    size = len(heap)
    if not size:
        return
    frontier = [(heap[0][0], 0)]
    while frontier:
        _, i = heapq.heappop(frontier)
        entry = heap[i]
        if not entry[1].status.is_finished:
            yield entry
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child][0], child))


class WaitingQueue:
    """The scheduler's waiting requests, per tenant, taken in fair-share order (module docstring).

    ``arrive`` / ``leave`` follow each request through the scheduler (for the idle lift);
    ``push`` / ``peek`` / ``pop`` are the queue; ``charge`` and ``charge_output`` add service.
    """

    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self._weight_of = weight_of
        # Tenants with a counter worth keeping (active ones, and idle ones above the lift floor).
        self._tenants: dict[str, _Tenant] = {}
        # Tenants with unfinished requests in the scheduler.
        self._active: dict[str, _Tenant] = {}
        # Tenants with entries in their waiting heap (possibly only stale ones).
        self._waiting: dict[str, _Tenant] = {}
        # The counter of the last tenant to go idle when none is left active: the lift target then.
        self._idle_floor = 0.0
        # The order over the waiting tenants, built when first needed with several of them and
        # kept up to date until the counters change outside an admission pass.
        self._order: _TenantOrder | None = None
        # Sweep idle tenants' counters once more than this many tenants are known.
        self._forget_at = _FORGET_SLACK

    # -- requests in and out of the scheduler ---------------------------------------------------
    def arrive(self, request: EngineRequest) -> None:
        """A new request of group ``request.fair_key``; a group coming back from idle is lifted first."""
        name = request.fair_key
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name, self._weight_of(request.tenant), 0.0)
        if tenant.num_unfinished == 0:
            floor = self._lift_floor()
            if tenant.counter < floor:
                tenant.counter = floor
            self._active[name] = tenant
        tenant.num_unfinished += 1

    def leave(self, request: EngineRequest) -> None:
        """A request that ``arrive`` saw has finished (from waiting or running)."""
        name = request.fair_key
        tenant = self._active.get(name)
        if tenant is None:
            return
        tenant.num_unfinished -= 1
        if tenant.num_unfinished:
            return
        del self._active[name]
        # Nothing of it waits any more: whatever its heap holds is stale.
        tenant.waiting.clear()
        if self._waiting.get(name) is tenant:
            del self._waiting[name]
        if self._order is not None:
            self._order.remove(tenant)
        if not self._active:
            self._idle_floor = max(self._idle_floor, tenant.counter)
        if len(self._tenants) > self._forget_at:
            self._forget_idle()
            # The next sweep once the known tenants have doubled again: amortized O(1) per request.
            self._forget_at = max(2 * len(self._tenants), _FORGET_SLACK)

    def _lift_floor(self) -> float:
        """What a tenant coming back from idle is lifted to. It never decreases: tenants join at
        or above it, counters only grow, and leaving can only raise the minimum of the rest."""
        active = self._active
        if not active:
            return self._idle_floor
        return min(t.counter for t in active.values())

    def _forget_idle(self) -> None:
        """Drop idle tenants whose counter is at or below the lift floor: when they come back
        they are lifted to at least that, so their own counter no longer matters."""
        floor = self._lift_floor()
        for name in [n for n, t in self._tenants.items() if not t.num_unfinished and t.counter <= floor]:
            del self._tenants[name]

    # -- the queue ------------------------------------------------------------------------------
    def push(self, entry: Entry) -> None:
        """Queue a waiting request (new, preempted, or held back); ``arrive`` came first."""
        tenant = self._tenants[entry[1].fair_key]
        heapq.heappush(tenant.waiting, entry)
        self._waiting[tenant.name] = tenant
        if self._order is not None and tenant.waiting[0] is entry:
            self._order.set(tenant, entry[0], tenant.counter)

    def peek(self) -> Entry | None:
        """The next waiting entry in fair-share order, or None; ``pop`` takes it."""
        waiting = self._waiting
        while waiting:
            if len(waiting) == 1:
                tenant = next(iter(waiting.values()))
            else:
                if self._order is None:
                    self._order = self._build_order()
                tenant = self._order.next()
                if tenant is None:  # every heap held only stale entries; they are gone now
                    return None
            heap = tenant.waiting
            if heap and not heap[0][1].status.is_finished:
                return heap[0]
            self._refresh(tenant)
        return None

    def pop(self, request: EngineRequest) -> Entry:
        """Take the entry ``peek`` returned."""
        tenant = self._tenants[request.fair_key]
        entry = heapq.heappop(tenant.waiting)
        if entry[1] is not request:
            raise ValueError(f"request {request.request_id!r} is not the next of tenant {tenant.name!r}")
        self._refresh(tenant)
        return entry

    def _refresh(self, tenant: _Tenant) -> None:
        """After the tenant's heap or counter changed: re-rank it, or drop it when nothing waits."""
        entry = tenant.head()
        if entry is None:
            if self._waiting.get(tenant.name) is tenant:
                del self._waiting[tenant.name]
            if self._order is not None:
                self._order.remove(tenant)
        elif self._order is not None:
            self._order.set(tenant, entry[0], tenant.counter)

    def _build_order(self) -> _TenantOrder:
        order = _TenantOrder()
        for tenant in list(self._waiting.values()):
            entry = tenant.head()
            if entry is None:
                del self._waiting[tenant.name]
            else:
                order.set(tenant, entry[0], tenant.counter)
        return order

    def reorder(self) -> None:
        """Drop the kept order (its stale entries with it); the next ``peek`` builds it afresh."""
        self._order = None

    # -- service --------------------------------------------------------------------------------
    def charge(self, tenant_name: str, service: float) -> None:
        """Add ``service`` (already weighted by token kind) to a tenant, divided by its weight."""
        tenant = self._tenants.get(tenant_name)
        if tenant is None:
            return
        tenant.counter += service / tenant.weight
        if self._order is not None and self._waiting.get(tenant_name) is tenant:
            self._refresh(tenant)

    def charge_output(self, tokens_by_tenant: Mapping[str, int]) -> None:
        """Charge the tokens generated in one step, per tenant."""
        tenants = self._tenants
        for name, count in tokens_by_tenant.items():
            tenant = tenants.get(name)
            if tenant is not None:
                tenant.counter += count * OUTPUT_TOKEN_WEIGHT / tenant.weight
        self._order = None

    @property
    def num_groups(self) -> int:
        """Groups with unfinished requests (waiting or running)."""
        return len(self._active)

    def heads(self) -> Iterator[Entry]:
        """The first waiting entry of each group that has one, in no particular order."""
        for tenant in list(self._waiting.values()):
            entry = tenant.head()
            if entry is not None:
                yield entry

    def slot_shares(self, slots: int) -> dict[str, float]:
        """Each group with unfinished requests (waiting or running) and its fair share of ``slots``
        running sequences: its weight over the total weight of those groups."""
        active = self._active
        total = sum(t.weight for t in active.values())
        return {name: slots * t.weight / total for name, t in active.items()} if total else {}

    def counter(self, tenant_name: str) -> float | None:
        """The tenant's counter (service received / weight), or None when it has none kept."""
        tenant = self._tenants.get(tenant_name)
        return None if tenant is None else tenant.counter

    # -- the head of the queue --------------------------------------------------------------------
    def head(self, limit: int) -> list[EngineRequest]:
        """The first ``limit`` waiting requests in the order they would be admitted, were each
        admitted in turn: the fair choice is replayed on copies of the counters, each request
        adding its prompt (new requests only) to its tenant's. Output tokens generated meanwhile
        are not foreseen. Nothing is changed."""
        waiting = self._waiting
        if limit <= 0 or not waiting:
            return []
        if len(waiting) == 1:
            tenant = next(iter(waiting.values()))
            return [request for _, request in islice(_walk(tenant.waiting), limit)]
        order = _TenantOrder()
        walks: dict[_Tenant, tuple[Iterator[Entry], list]] = {}
        for tenant in waiting.values():
            walk = _walk(tenant.waiting)
            first = next(walk, None)
            if first is not None:
                walks[tenant] = (walk, [first, tenant.counter])
                order.set(tenant, first[0], tenant.counter)
        out: list[EngineRequest] = []
        while len(out) < limit:
            tenant = order.next()
            if tenant is None:
                break
            walk, state = walks[tenant]
            request = state[0][1]
            out.append(request)
            if request.num_cached_tokens < 0:  # a first admission charges its prompt
                state[1] += request.num_prompt_tokens * PROMPT_TOKEN_WEIGHT / tenant.weight
            state[0] = next(walk, None)
            if state[0] is None:
                order.remove(tenant)
            else:
                order.set(tenant, state[0][0], state[1])
        return out
