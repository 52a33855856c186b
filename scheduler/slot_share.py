"""Fair share of the running slots between fair-share groups, within one admission pass.

The rule is described in scheduler/scheduler.py's docstring: when the slots or the KV blocks are
full, the waiting head of a group below its share of the slots preempts a running request of a
group above its share that has received more service.
"""

from __future__ import annotations

from collections.abc import Callable

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.fair import WaitingQueue
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest


class SlotShares:
    """Fair share of the running slots within one admission pass.

    Counts, per fair-share group, the requests running; ``make_room`` preempts one running request
    of the group furthest above its share so that the waiting head of a group below its share can
    run. Built lazily: a pass that never runs out of room costs nothing.
    """

    __slots__ = ("_running", "_waiting", "_config", "_preempt", "_counts", "_shares", "_admitted", "_refused")

    def __init__(self, running: list[EngineRequest], waiting: WaitingQueue, config: SchedulerConfig,
                 preempt: Callable[[EngineRequest, SchedulerOutput], None]) -> None:
        # The running list (in scheduling order) and the waiting queue, changed in place;
        # ``preempt`` puts a request taken off the running list back on the waiting queue.
        self._running = running
        self._waiting = waiting
        self._config = config
        self._preempt = preempt
        self._counts: dict[str, int] | None = None
        self._shares: dict[str, float] = {}
        # Requests admitted in this pass: never taken back in the same pass.
        self._admitted: set[int] = set()
        # Groups whose head found no room in this pass: not tried again in it.
        self._refused: set[str] = set()

    def admitted(self, request: EngineRequest) -> None:
        self._admitted.add(id(request))
        if self._counts is not None:
            key = request.fair_key
            self._counts[key] = self._counts.get(key, 0) + 1

    def _count(self) -> None:
        counts: dict[str, int] = {}
        for r in self._running:
            counts[r.fair_key] = counts.get(r.fair_key, 0) + 1
        self._counts = counts
        self._shares = self._waiting.slot_shares(self._config.max_num_seqs)

    def below_share_head(self, head: EngineRequest) -> EngineRequest | None:
        """The first waiting request of the group furthest below its share of the slots (by
        running requests per unit of weight), among the groups not refused in this pass that
        would stay within their share with one more running and whose first request's priority
        is as good as ``head``'s; None when there is none."""
        if self._counts is None:
            self._count()
        counts, shares = self._counts, self._shares
        best, best_load = None, 0.0
        for _, request in self._waiting.heads():
            key = request.fair_key
            if key in self._refused or key not in shares or request.priority > head.priority:
                continue
            n = counts.get(key, 0)
            if n + 1 <= shares[key] and (best is None or n / shares[key] < best_load):
                best, best_load = request, n / shares[key]
        return best

    def make_room(self, request: EngineRequest, out: SchedulerOutput) -> int:
        """Preempt a request so that ``request`` can be admitted: one of the group with the most
        running requests per unit of weight, when that group stays at or above its share without
        it, ``request``'s group is below its share with it, the victim's priority is not better,
        and either ``request``'s group stays within half its share with it (half a share is
        guaranteed at once: a tenant arriving behind a flood starts without waiting for the
        counters) or the victim's group has received more service (per unit of weight) than
        ``request``'s.
        The victim is that group's last request in scheduling
        order. Returns the tokens the victim had been given in this step (back to the budget),
        or -1 when nothing was preempted (the group is then refused for the rest of the pass)."""
        if request.interactive:
            # An interactive request (with a latency target) takes the slot of the last bulk one
            # running, whatever the groups: it must not wait for a bulk request to finish.
            for victim in reversed(self._running):
                if not victim.interactive and id(victim) not in self._admitted:
                    return self._take(victim, out)
        key = request.fair_key
        waiting = self._waiting
        if waiting.num_groups < 2:
            self._refused.add(key)
            return -1
        if self._counts is None:
            self._count()
        counts, shares = self._counts, self._shares
        if len(shares) < 2 or counts.get(key, 0) + 1 > shares.get(key, 0.0):
            self._refused.add(key)
            return -1
        # The slot shares keep groups from taking slots back and forth (the victim's group stays
        # at or above its share, so it has no claim to take one back); beyond the guaranteed
        # half, the service counters keep a group that has had its due from taking more.
        owed = waiting.counter(key) or 0.0
        guaranteed = counts.get(key, 0) + 1 <= shares[key] / 2
        over = sorted((g for g, n in counts.items() if g != key and g in shares and n - 1 >= shares[g]
                       and (guaranteed or (waiting.counter(g) or 0.0) > owed)),
                      key=lambda g: counts[g] / shares[g], reverse=True)
        running = self._running
        for group in over:
            for victim in reversed(running):
                # An interactive request (one with a latency target) never gives way to a bulk one.
                if (victim.fair_key == group and victim.priority >= request.priority
                        and id(victim) not in self._admitted
                        and (request.interactive or not victim.interactive)):
                    break
            else:
                continue
            return self._take(victim, out)
        self._refused.add(key)
        return -1

    def _take(self, victim: EngineRequest, out: SchedulerOutput) -> int:
        """Preempt ``victim`` (running): the tokens it had been given in this step."""
        self._running.remove(victim)
        freed = 0
        for i, sr in enumerate(out.scheduled):
            if sr.request is victim:
                freed = sr.num_new_tokens
                del out.scheduled[i]
                break
        self._preempt(victim, out)
        out.preempted.append(victim)
        if self._counts is not None:
            self._counts[victim.fair_key] -= 1
        return freed
