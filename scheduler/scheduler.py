"""The continuous-batching scheduler: which requests run this step, with how many tokens each.

One token budget per step and no separate prefill and decode phases. Each step first serves
the running requests, in scheduling order, each asking for ``num_tokens - num_computed_tokens``
tokens (a long prompt is cut into chunks; every running request is left at least one token of
the budget, so decodes never stall behind a chunked prompt), then admits waiting requests in
fair-share order (below) while the budget, the free KV blocks and ``max_num_seqs`` allow.

Scheduling order, with priority aging (``SchedulerConfig.priority_aging_s`` = A): a request's
effective priority is ``priority - waited_s / A``, the lowest first; ties go to the lower
``priority``, then to the earlier arrival. Every request ages at the same rate, so the order
never changes while requests wait and equals sorting by ``arrival_time + priority * A``: a
request with priority p is served as if it had arrived p * A seconds later than it did. A
request of any priority therefore gets ahead of everything that arrives more than (its
priority - the best priority) * A seconds after it: nothing starves. Without aging (None) the
order is priority, then arrival.

Fair share between tenants (scheduler/fair.py): each tenant's waiting requests keep that order
among themselves, and admission takes the next request of the tenant that has received the least
service (prompt and output tokens, divided by its ``SchedulerConfig.tenant_weights`` weight)
among the tenants whose next request has the best priority. A better priority still goes first
whatever the counters, and so does the first waiting request in the order above when it has a
worse priority than the best level's (it has aged past that level): across tenants, aging's
promise becomes "a request goes before every request of a better priority once it is the first
waiting request in that order", so still nothing starves. With a single tenant this is exactly
the order above. Groups are tenants, or, for requests given a ``share_group`` (a job's lane), those
groups, each with its tenant's weight.

Fair share of the running slots: when the slots (``max_num_seqs``) or the KV blocks are full, a
waiting request of a group below its share of the slots (its weight over the total weight of the
groups with unfinished requests) preempts the last running request, in scheduling order, of the
group furthest above its share, provided that group stays at or above its share without it, the
victim's priority is not better, and either the waiting request's group runs fewer than half its
share (that half is guaranteed at once) or the victim's group has received more service (counters
above) than the waiting request's group. Without it, a backlog admitted while the engine was idle would hold
every slot until it finished, and a tenant arriving behind it would wait for a whole round of it.
Slots are not taken back and forth: the victim's group stays at or above its share, so it has no
claim on a slot of a group below its share. Requests admitted in the same pass are not taken
back, and a group whose request found no room is not tried again in that pass.

When the KV cache has no room for a running request, the scheduler preempts the running
request that comes last in scheduling order, which returns to the waiting queue in its old
place. By recompute (the default), it gives its blocks back; full computed blocks stay in the
prefix cache, so it usually gets most of its KV back for free when it is re-admitted. By swap
(``preemption_mode="swap"``), its KV is copied to host-memory blocks and back when it is
re-admitted (``SchedulerOutput.swap_out`` / ``swap_in``); when the host pool is full it falls
back to recompute.

Prefix blocks that waiting requests will use are the last to be evicted. During a step, while
requests wait, every allocation that has to evict a cached free block first evicts those that
none of the first ``PROTECTED_WAITING_REQUESTS`` waiting requests (in admission order) would
take as a prefix-cache hit, and evicts such protected blocks only when nothing else is free.
Without this, the running requests' growth could evict a prefix that a queue of waiting
requests shares just before they are admitted, and each of them would compute it again.

Speculative decoding (``SchedulerConfig.num_speculative_tokens`` K > 0 and a proposer; the step's
part in scheduler/speculative_steps.py): after the running requests and the admissions, while the
step's scheduled tokens stay at or below ``speculative_max_batched_tokens``, each scheduled
request about to sample (and not opted out)
asks the proposer for up to K tokens and, when it proposes some and free blocks hold their
slots, runs them in the same chunk (``ScheduledRequest.spec_token_ids``). Fewer than K, or none,
when the speculation policy (scheduler/speculation.py) finds them not worth their cost: from the
engine's measured step times and the request's acceptance rate so far. Proposals come last,
so they only use what the step has spare: a full step runs none, and they never preempt. No more
are proposed than the request can still emit (its ``max_tokens`` and context limit). In
``update_from_output`` the accepted ones become output tokens like sampled ones; the rejected
ones' computed tokens are rolled back and the blocks only they needed are given back.

Latency targets (scheduler/slo.py): a request with ``slo_ttft_ms`` or ``slo_tpot_ms`` is
interactive and comes before every bulk request in the scheduling order (the first item of the
order key), so it is served and admitted first and never the victim of a preemption made for a
bulk request; when the running slots are full it preempts the last bulk request running. While
interactive requests are in, ``SloScheduling.plan`` returns a ``StepPlan`` that this loop and
admission consult: bulk sequences it leaves out are passed over (they keep their KV), and prompt
chunks run only the tokens it allows (in a light step, for a while after the last interactive
request left, only bulk prompt chunks are bounded). Without one (None) nothing changes.

The engine calls ``schedule()``, runs the model on the returned ``SchedulerOutput``, then calls
``update_from_output()`` with the sampled tokens, strictly in that order.
"""

from __future__ import annotations

import heapq
import time
from bisect import insort
from collections.abc import Callable, Iterable, Sequence

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.fair import PROMPT_TOKEN_WEIGHT, OrderKey, WaitingQueue
from mqinfer.scheduler.kv_cache_manager import KVCacheManager
from mqinfer.scheduler.output import ScheduledRequest, SchedulerOutput, check_step_output, stop_status
from mqinfer.scheduler.request import EngineRequest, RequestStatus
from mqinfer.scheduler.slo import SloScheduling, StepPlan
from mqinfer.scheduler.slot_share import SlotShares
from mqinfer.scheduler.speculation import SpeculationPolicy
from mqinfer.scheduler.speculative_steps import Proposer, add_proposals, apply_proposals

# (latency class, arrival_time + priority * aging, priority, arrival_time, sequence number of
# add_request): the scheduling order, smallest first. The latency class is 0 for a request with a
# latency target and 1 without; without aging, the second item is the priority itself.
_OrderKey = OrderKey

# How many requests at the head of the waiting queue have their prefix-cache hits protected from
# eviction: enough to cover the requests admitted in the next few steps, few enough that the
# protected set stays cheap to build (it is built only in steps that evict a cached block).
PROTECTED_WAITING_REQUESTS = 64


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.time,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.clock = clock
        self.proposer = proposer if config.num_speculative_tokens > 0 else None
        # How many proposals each request runs, from measured step times and acceptance.
        self.speculation = SpeculationPolicy()
        # Step plans while requests with latency targets are in (scheduler/slo.py).
        self.slo = SloScheduling(config.max_num_batched_tokens) if config.slo_step_plans else None
        self.kv_cache_manager = KVCacheManager(
            config.block_size, config.num_kv_blocks, enable_prefix_caching=config.enable_prefix_caching,
            num_swap_blocks=config.num_swap_blocks if config.preemption_mode == "swap" else 0,
            prefix_cache_scope=config.prefix_cache_scope,
        )
        # Unfinished requests by id.
        self._requests: dict[str, EngineRequest] = {}
        self._order: dict[str, _OrderKey] = {}
        self._seq = 0
        # Running requests, kept sorted by their order key: the preemption victim is the last.
        self._running: list[EngineRequest] = []
        # Waiting (new and preempted) requests: a heap of (order key, request) per tenant, taken in
        # fair-share order. A request that finishes while waiting leaves a stale entry behind,
        # skipped when it reaches the top.
        self._waiting = WaitingQueue(config.weight_of)
        self._num_waiting = 0
        # Entries taken off the waiting queue for the duration of one admission pass (requests held
        # back while another request computes their next prefix block); they still wait.
        self._held: list[tuple[_OrderKey, EngineRequest]] = []
        # (deadline, sequence number, request) for every request that has a deadline.
        self._deadlines: list[tuple[float, int, EngineRequest]] = []
        # Requests refused by add_request, reported by the next schedule().
        self._rejected: list[EngineRequest] = []
        self.num_preemptions_total = 0
        # Preemptions that kept the KV in host memory (a subset of num_preemptions_total).
        self.num_swaps_total = 0

    # -- public state -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (once per request)."""
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache (once per request)."""
        return self.kv_cache_manager.prefix_cache_hits

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache's blocks in use (0 to 1)."""
        return self.kv_cache_manager.usage

    def owned_blocks(self, request_id: str) -> list:
        """The KV blocks a request holds, in position order (a copy, for billing and inspection)."""
        return self.kv_cache_manager.owned_blocks(request_id)

    def has_unfinished_requests(self) -> bool:
        # Rejected requests still count: the next schedule() has to report them.
        return bool(self._running or self._num_waiting or self._rejected)

    def get_request(self, request_id: str) -> EngineRequest | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def unstarted_request_ids(self) -> list[str]:
        """Ids of the waiting requests that have never run (preempted ones have, and are not here)."""
        return [rid for rid, request in self._requests.items() if request.status is RequestStatus.WAITING]

    def tenant_counter(self, tenant: str) -> float | None:
        """The tenant's fair-share counter: service received (prompt tokens computed plus output
        tokens, the latter weighted) divided by its weight; None for a tenant idle long enough
        that its counter was dropped (it would be lifted on its return anyway)."""
        return self._waiting.counter(tenant)

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request. One whose prompt can never run is reported by the next schedule().

        The request's ``max_model_len`` is lowered to the scheduler's when that is smaller.
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed), got {request.status.name}")
        if request.max_model_len > self.config.max_model_len:
            request.max_model_len = self.config.max_model_len

        error = self._admission_error(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error_code, request.error = error
            self._rejected.append(request)
            return

        key = self._order_key(request, self._seq)
        self._seq += 1
        self._requests[rid] = request
        self._order[rid] = key
        self._waiting.arrive(request)
        self._waiting.push((key, request))
        self._num_waiting += 1
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, key[-1], request))
        if self.slo is not None:
            self.slo.add(request, self.clock())

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus,
        error_code: str | None = None,
        error: str | None = None,
    ) -> list[EngineRequest]:
        """End requests from outside (stop string matched, cancelled, failed); frees their blocks.

        Unknown or already finished ids are ignored. Returns the requests ended by this call.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        ended = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._running.remove(request)
            else:
                self._num_waiting -= 1
            request.error_code = error_code
            request.error = error
            self._end(request, status)
            ended.append(request)
        return ended

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work and allocate its KV slots; may preempt or end requests."""
        out = SchedulerOutput()
        if self._rejected:
            out.finished.extend(self._rejected)
            self._rejected.clear()
        if self._deadlines:
            self._expire(self.clock(), out)
            # Requests that ended before their deadline leave entries behind; drop them once
            # they dominate, so a far deadline does not pin a finished request's memory.
            if len(self._deadlines) > 2 * len(self._requests) + 64:
                self._deadlines = [e for e in self._deadlines if not e[2].is_finished]
                heapq.heapify(self._deadlines)

        kv = self.kv_cache_manager
        if self._num_waiting and kv.enable_prefix_caching:
            kv.protect_prefix_hits(self._waiting_head)
        slo = self.slo
        plan = slo.plan(self._running, self.clock()) if slo is not None else None
        try:
            self._schedule_step(out, plan)
        finally:
            kv.protect_prefix_hits(None)
        if slo is not None:
            slo.scheduled(((sr.request, sr.num_new_tokens) for sr in out.scheduled),
                          plan is not None and not plan.light)
        return out

    def record_step(self, seconds: float, gap_s: float | None = None) -> None:
        """The engine's measured time for the step last scheduled (schedule to results) and the
        time between the previous step's end and its start (None after an idle spell), which keep
        the step-time model of latency targets current (scheduler/slo.py)."""
        if self.slo is not None:
            self.slo.record(seconds, gap_s)

    def step_interrupted(self) -> None:
        """The step last scheduled was given up (nothing advances): its time is not a step's."""
        if self.slo is not None:
            self.slo.discard_step()

    def _schedule_step(self, out: SchedulerOutput, plan: StepPlan | None = None) -> None:
        """Serve the running requests (preempting when the cache is full), then admit waiting ones."""
        kv = self.kv_cache_manager
        running = self._running
        scheduled = out.scheduled
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(running):
            request = running[i]
            # Leave one token for each running request after this one; the config guarantees
            # max_num_batched_tokens >= max_num_seqs, so the cap is always at least one.
            cap = budget - (len(running) - i - 1)
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new > cap:
                num_new = cap
            if plan is not None and num_new > 0:
                # A planned step (latency targets): a bulk sequence left out (0) keeps its KV.
                num_new = plan.running_tokens(request, num_new)
                if num_new == 0:
                    i += 1
                    continue
            if num_new <= 0:
                # Only reachable if a sampled token went missing; skip rather than schedule nothing.
                i += 1
                continue
            while True:
                if kv.allocate_slots(request, num_new):
                    scheduled.append(ScheduledRequest(request, num_new))
                    budget -= num_new
                    i += 1
                    break
                victim = running.pop()
                if victim is request and i == 0:
                    # Alone, it holds the whole cache and still cannot grow: it can never go on.
                    self._end(request, RequestStatus.FINISHED_LENGTH)
                    out.finished.append(request)
                    break
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is request:
                    break

        # Admissions go on after a preemption: a victim needs at least the blocks it gave up to
        # come back, more than are left, so it cannot bounce straight back in; only one whose
        # prefix blocks are shared with a running request needs less, and may come back at once
        # (for swap, the runner's out-before-in copy order keeps that correct).
        self._admit(out, budget, plan)
        if self.proposer is not None:
            add_proposals(out, self.config, self.kv_cache_manager, self.proposer,
                          self.speculation if self.config.speculative_adaptive else None)

    def record_step_time(self, num_tokens: int, seconds: float, draft_seconds: float = 0.0,
                         draft_depth: int = 0) -> None:
        """The model runner's time for a step of ``num_tokens`` tokens, ``draft_seconds`` of it in
        ``draft_depth`` draft forwards, for the speculation policy's cost model
        (scheduler/speculation.py)."""
        self.speculation.record_step(num_tokens, seconds, draft_seconds, draft_depth)

    def _waiting_head(self) -> list[EngineRequest]:
        """The first ``PROTECTED_WAITING_REQUESTS`` waiting requests, in the order they would be
        admitted (``WaitingQueue.head``: O(k log k) for k requests with one tenant waiting,
        however long the queue is). Requests that an admission pass in progress has held back are
        off the queue until it ends; they were taken from its front, so they come first.
        """
        limit = PROTECTED_WAITING_REQUESTS
        head = [request for _, request in self._held][:limit]
        if len(head) < limit:
            head += self._waiting.head(limit - len(head))
        return head

    def _admit(self, out: SchedulerOutput, budget: int, plan: StepPlan | None = None) -> None:
        kv = self.kv_cache_manager
        running = self._running
        waiting = self._waiting
        if not (self._num_waiting and budget > 0):
            return
        if len(running) >= self.config.max_num_seqs and waiting.num_groups < 2 and not (
                (head := waiting.peek()) is not None and head[1].interactive):
            return  # full, and no other group (or interactive request) to take a slot back for
        # Prefix blocks being computed now (the next full block of every request still in its
        # prompt): a waiting request whose next block is one of them is held back this step,
        # to find it cached in a later step instead of computing it a second time. It waits
        # only while another request computes that block, and other requests go ahead of it.
        computing = {h for r in running if r.num_computed_tokens < r.num_prompt_tokens
                     and (h := kv.next_block_hash(r, r.num_computed_tokens // kv.block_size)) is not None}
        held = self._held
        waiting.reorder()
        try:
            self._admit_from_queue(out, budget, computing, held, plan)
        finally:
            for entry in held:
                waiting.push(entry)
            held.clear()

    def _admit_from_queue(self, out: SchedulerOutput, budget: int, computing: set, held: list,
                          plan: StepPlan | None) -> None:
        running = self._running
        waiting = self._waiting
        max_num_seqs = self.config.max_num_seqs
        shares = SlotShares(running, waiting, self.config, self._preempt)
        while budget > 0:
            # The next request in fair-share order (stale entries of requests that ended while
            # waiting are passed over).
            entry = waiting.peek()
            if entry is None:
                break
            request = entry[1]
            while True:
                limit = budget
                if plan is not None:
                    # A planned step (latency targets): interactive requests come first in the
                    # order, and a bulk one runs only the prompt tokens the plan leaves it.
                    limit = min(budget, plan.prompt_limit(request, request.num_tokens - request.num_computed_tokens))
                    if limit <= 0:
                        return
                placed = self._place(request, limit, computing, held, out) if len(running) < max_num_seqs else None
                if placed is not None:
                    break
                # No slot or no blocks for it: a group below its share of the running slots takes
                # one from a group above its share; otherwise the pass ends here (head-of-line:
                # later requests must not overtake it).
                freed = shares.make_room(request, out)
                if freed < 0:
                    # The head's group has its share already: the head of a group below its
                    # share may still take a slot from a group above it.
                    request = shares.below_share_head(request)
                    if request is None:
                        return
                    continue
                budget += freed
            if placed > 0:
                shares.admitted(request)
                budget -= placed
                if plan is not None:
                    plan.take(request, placed)

    def _place(self, request: EngineRequest, budget: int, computing: set, held: list,
               out: SchedulerOutput) -> int | None:
        """Admit the head of the waiting queue with at most ``budget`` tokens: how many it runs,
        0 when it left the queue without running (held back, or ended), None when its KV blocks
        do not fit."""
        kv = self.kv_cache_manager
        running = self._running
        waiting = self._waiting
        charge = 0
        if kv.num_blocks_for(request.num_tokens) > kv.num_blocks:
            # Only a preempted request can get here (prompts are checked on arrival): it grew
            # past the whole cache before it was preempted.
            waiting.pop(request)
            self._num_waiting -= 1
            self._end(request, RequestStatus.FINISHED_LENGTH)
            out.finished.append(request)
            return 0
        # Keep one free block per running request, so that the running ones can each cross
        # their next block boundary without preempting the request admitted here.
        if kv.is_swapped_out(request):
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            pairs = kv.swap_in(request, num_new, num_reserved_blocks=len(running))
            if pairs is None:
                return None
            out.swap_in.extend(pairs)
        else:
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            next_hash = kv.next_block_hash(request, len(hits))
            if next_hash is not None and next_hash in computing:
                held.append(waiting.pop(request))
                return 0
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not kv.allocate_slots(request, num_new, hits, num_reserved_blocks=len(running)):
                return None
            if request.num_cached_tokens < 0:
                # The first admission: the tenant is charged the prompt tokens it computes.
                request.num_cached_tokens = num_hit_tokens
                charge = request.num_prompt_tokens - num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            if next_hash is not None:
                computing.add(next_hash)
        waiting.pop(request)
        if charge:
            waiting.charge(request.fair_key, charge * PROMPT_TOKEN_WEIGHT)
        self._num_waiting -= 1
        request.status = RequestStatus.RUNNING
        insort(running, request, key=lambda r: self._order[r.request_id])
        out.scheduled.append(ScheduledRequest(request, num_new))
        return num_new

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: list[int | None],
                           num_accepted: Sequence[int] | None = None) -> list[EngineRequest]:
        """Apply one model step: advance computed tokens, append sampled ones, apply stop rules.

        ``sampled_token_ids`` is aligned with ``output.scheduled``: a token where the request
        needed a sample, None where it did not. ``num_accepted`` (also aligned; None when no
        request had proposals) says how many leading proposed tokens each request keeps: its
        output grows by those and then its sampled token, one at a time, up to the first that
        meets a stop rule. Requests ended from outside while the step ran are skipped. Returns
        the requests that finished in this update, their blocks freed.
        """
        scheduled = output.scheduled
        check_step_output(scheduled, sampled_token_ids, num_accepted)
        finished: list[EngineRequest] = []
        # Output tokens per fair-share group, for its counter.
        generated: dict[str, int] = {}
        for i, (sr, token) in enumerate(zip(scheduled, sampled_token_ids)):
            request = sr.request
            if request.status is not RequestStatus.RUNNING:
                continue
            spec = sr.spec_token_ids
            if not spec:
                request.num_computed_tokens += sr.num_new_tokens
                if token is None:
                    continue
                request.append_output_token(token)
                tenant = request.fair_key
                generated[tenant] = generated.get(tenant, 0) + 1
                status = stop_status(request, token)
                if status is not None:
                    request.status = status
                    finished.append(request)
                continue
            accepted = num_accepted[i] if num_accepted is not None else 0
            num_before = request.num_tokens
            status = apply_proposals(sr, token, accepted, self.speculation, self.kv_cache_manager)
            tenant = request.fair_key
            generated[tenant] = generated.get(tenant, 0) + request.num_tokens - num_before
            if status is not None:
                request.status = status
                finished.append(request)
        if generated:
            self._waiting.charge_output(generated)
        if finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
            for request in finished:
                self._end(request, request.status)
        return finished

    # -- internals ----------------------------------------------------------------------------
    def _admission_error(self, request: EngineRequest) -> tuple[str, str] | None:
        num_prompt = request.num_prompt_tokens
        if num_prompt > request.max_model_len:
            return (
                "prompt_too_long",
                f"prompt has {num_prompt} tokens but the context limit (max_model_len) is {request.max_model_len}",
            )
        kv = self.kv_cache_manager
        num_blocks = kv.num_blocks_for(num_prompt)
        if num_blocks > kv.num_blocks:
            bs = kv.block_size
            return (
                "kv_cache_too_small",
                f"prompt has {num_prompt} tokens and needs {num_blocks} KV blocks of {bs} tokens, but the "
                f"whole KV cache has {kv.num_blocks} blocks ({kv.num_blocks * bs} tokens)",
            )
        return None

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        deadlines = self._deadlines
        expired_running = False
        while deadlines and deadlines[0][0] <= now:
            _, _, request = heapq.heappop(deadlines)
            if request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                expired_running = True
            else:
                self._num_waiting -= 1
            self._end(request, RequestStatus.FINISHED_EXPIRED)
            out.finished.append(request)
        if expired_running:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]

    def _order_key(self, request: EngineRequest, seq: int) -> _OrderKey:
        aging = self.config.priority_aging_s
        rank = request.arrival_time + request.priority * aging if aging is not None else float(request.priority)
        return (0 if request.interactive else 1, rank, request.priority, request.arrival_time, seq)

    def _preempt(self, request: EngineRequest, out: SchedulerOutput) -> None:
        request.status = RequestStatus.PREEMPTED
        kv = self.kv_cache_manager
        pairs = kv.swap_out(request) if self.config.preemption_mode == "swap" else None
        if pairs is not None:
            out.swap_out.extend(pairs)
            request.num_swaps += 1
            self.num_swaps_total += 1
        else:
            kv.free(request)  # caches its computed blocks, so reads num_computed_tokens
            request.num_recompute_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.push((self._order[request.request_id], request))
        self._num_waiting += 1
        # The waiting head has changed: protect the prefix hits of the requests in it now, the
        # victim's own included, for the allocations still to come in this step.
        kv.protect_prefix_hits(self._waiting_head)

    def _end(self, request: EngineRequest, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller has taken it off running/waiting."""
        request.status = status
        self.kv_cache_manager.free(request)
        rid = request.request_id
        if self._requests.pop(rid, None) is not None:
            self._waiting.leave(request)
            if self.slo is not None:
                self.slo.end(request, self.clock())
        self._order.pop(rid, None)
