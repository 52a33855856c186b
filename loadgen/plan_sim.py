"""The simulation behind `mqinfer plan`: the real scheduler and batcher on a simulated clock.

Each simulated worker holds a real ``DynamicBatcher`` and a real ``Scheduler`` (scheduler/), both
reading one simulated clock, and runs the worker's loop: read entries from the stream, admit what
the batcher releases, schedule a step. Instead of running the model, a step lasts what the fitted
step-cost model (``plan_model``) says for the step's shape, and every request that needs a token
gets a fake one, so each generates exactly its output length (no EOS, no stop rule). Scheduling,
chunked prefill, the token budget, ``max_num_seqs``, KV blocks, prefix-cache hits and preemption
are therefore the engine's own; only the model's time is predicted.

The stream (Redis) is a FIFO of arrived entries. A worker whose engine is idle blocks on it, and
an arriving entry wakes the worker that has blocked longest, as Redis serves blocked readers. At
every turn of its loop a worker reads what the worker's ingest would (workers/ingest.py):
``room`` from its free sequences and waiting bound, at most ``max_batch``, within an even share
of the outstanding work between the workers. Between steps nothing else costs time: the Redis
round trips, sinks and acks of the real loop are calibrated instead: ``loop_overhead_s`` added to
every step, and ``wake_s``, how long a worker blocked on an empty stream takes to act on an
arriving entry (one figure, or measured ones to draw from with a seeded generator).

Times of each request (arrival, first scheduled, first token, finished) come out as a
``RequestOutcome``; TTFT and TPOT follow the bench's rules (loadgen/metrics.py).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mqinfer.loadgen.plan_model import StepCostModel, StepShape
from mqinfer.scheduler.batcher import DynamicBatcher
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import Request, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler

# The token every simulated step "samples": any id works, as simulated requests have no EOS.
FAKE_TOKEN = 7
_ARRIVAL, _WORKER = 0, 1


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulation needs it: its prompt (prefix caching reads the ids), how many
    tokens it generates, and when it enters the stream (seconds from the start)."""

    id: str
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    arrival_s: float = 0.0
    priority: int = 0
    tenant: str = "default"


@dataclass
class RequestOutcome:
    id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    worker: int = -1
    started_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None  # an error code when the scheduler refused the request
    # Whether the worker that read it had nothing else (no request in its engine or batcher).
    to_idle_worker: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finished_s is None or self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class WorkerSettings:
    """What a simulated worker is built from: the engine's scheduler limits and the batcher's thresholds."""

    scheduler: SchedulerConfig
    max_batch: int = 64
    max_wait_ms: float | str = 10.0

    @property
    def waiting_bound(self) -> int:
        """Requests a worker keeps waiting while its engine is full (``Ingest.waiting_bound``)."""
        return max(self.scheduler.max_num_seqs, 2 * self.max_batch)


@dataclass
class SimResult:
    outcomes: list[RequestOutcome]
    num_workers: int
    busy_s: list[float]  # seconds each worker spent in steps
    num_steps: int
    num_preemptions: int
    end_s: float  # when the last request finished


class SimClock:
    """The simulated time, read by every scheduler and batcher of a run."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Worker:
    index: int
    scheduler: Scheduler
    batcher: DynamicBatcher
    held: int = 0  # entries read and not yet finished
    busy_s: float = 0.0
    step: SchedulerOutput | None = None
    needs_sample: list[bool] = field(default_factory=list)
    token: int = 0  # bumps on every wake-up, so that stale timer events are skipped
    blocked: bool = False
    block_seq: int = 0
    timer_at: float = float("inf")  # when a blocked worker's read times out (the batcher's wait)


def step_shape(out: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step, read before ``update_from_output`` advances its requests."""
    return StepShape.of((sr.num_new_tokens, sr.request.num_computed_tokens + sr.num_new_tokens)
                        for sr in out.scheduled)


def simulate(requests: Sequence[SimRequest], num_workers: int, settings: WorkerSettings,
             model: StepCostModel, *, loop_overhead_s: float = 0.0, wake_s: float | Sequence[float] = 0.0,
             seed: int = 0, max_events: int = 50_000_000) -> SimResult:
    """Run ``requests`` through ``num_workers`` simulated workers until every one has finished;
    ``loop_overhead_s`` is added to every step, and a blocked worker acts on an arriving entry
    ``wake_s`` after it arrives (with several values, one drawn for each wake-up; ``seed`` seeds
    the draws)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    clock = SimClock()
    workers = [_Worker(i, Scheduler(settings.scheduler, clock=clock),
                       DynamicBatcher(max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms, clock=clock))
               for i in range(num_workers)]
    outcomes = [RequestOutcome(r.id, len(r.prompt_token_ids), r.output_tokens, r.arrival_s) for r in requests]
    events: list[tuple[float, int, int, int, int]] = []  # (time, kind, sequence, index, token)
    seq = 0

    def push(t: float, kind: int, index: int, token: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, index, token))
        seq += 1

    for i, r in enumerate(requests):
        push(r.arrival_s, _ARRIVAL, i)
    stream: deque[int] = deque()
    blocked: deque[tuple[int, int]] = deque()  # (worker, its block_seq) in the order they blocked
    pending_total = 0  # entries read by some worker and not finished
    num_steps = 0
    max_seqs = settings.scheduler.max_num_seqs
    max_len = settings.scheduler.max_model_len
    fixed_s = model.step_s_fixed + loop_overhead_s
    wakes = ([float(w) for w in wake_s] if isinstance(wake_s, Sequence) else [float(wake_s)]) or [0.0]
    rng = random.Random(seed)

    def wake_delay() -> float:
        return wakes[0] if len(wakes) == 1 else wakes[rng.randrange(len(wakes))]

    def wake(w: _Worker, t: float) -> None:
        t = min(t, w.timer_at)  # a read that times out first returns first
        w.blocked = False
        w.token += 1
        push(t, _WORKER, w.index, w.token)

    def finish(request: Request, t: float, error: str | None = None) -> None:
        nonlocal pending_total
        o = outcomes[int(request.request_id)]
        o.finished_s = t
        o.error = error
        # Fewer than asked when the context limit ended it first.
        o.output_tokens = request.num_output_tokens
        workers[o.worker].held -= 1
        pending_total -= 1

    def read(w: _Worker) -> int:
        """Take this turn's entries from the stream into the worker's batcher; how many."""
        nonlocal pending_total
        if not stream:
            return 0
        s = w.scheduler
        queued = len(w.batcher)
        startable = 0 if s.num_waiting else max(0, max_seqs - s.num_running - queued)
        buffered = max(0, settings.waiting_bound - s.num_waiting - queued)
        room = min(max(startable, buffered), settings.max_batch)
        if room <= 1 and startable:
            take = room
        else:
            share = -(-(len(stream) + pending_total) // num_workers) - w.held
            take = max(1 if startable else 0, min(room, share))
        take = min(take, len(stream))
        idle = not queued and not s.has_unfinished_requests()
        for _ in range(take):
            index = stream.popleft()
            outcomes[index].worker = w.index
            outcomes[index].to_idle_worker = idle
            w.batcher.add(index)
            w.held += 1
            pending_total += 1
        return take

    def turn(w: _Worker, t: float) -> None:
        """One turn of the worker loop at time ``t``: end the running step, read, admit, step."""
        nonlocal num_steps
        s = w.scheduler
        if w.step is not None:
            out, needs = w.step, w.needs_sample
            w.step, w.needs_sample = None, []
            done = s.update_from_output(out, [FAKE_TOKEN if need else None for need in needs])
            for sr, need in zip(out.scheduled, needs):
                o = outcomes[int(sr.request.request_id)]
                if need and o.first_token_s is None:
                    o.first_token_s = t
            for request in done:
                finish(request, t)
        took = read(w)
        for index in w.batcher.poll(engine_idle=not s.has_unfinished_requests()):
            r = requests[index]
            s.add_request(Request(str(index), list(r.prompt_token_ids),
                                  SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True),
                                  arrival_time=r.arrival_s, priority=r.priority, max_model_len=max_len,
                                  tenant=r.tenant))
        if s.has_unfinished_requests():
            out = s.schedule()
            for request in out.finished:  # refused (prompt too long, too big for the cache) or expired
                finish(request, t, request.error_code or request.status.finish_reason)
            if out.scheduled:
                for sr in out.scheduled:
                    o = outcomes[int(sr.request.request_id)]
                    if o.started_s is None:
                        o.started_s = t
                seconds = model.step_seconds(step_shape(out)) + loop_overhead_s
                w.step, w.needs_sample = out, [sr.needs_sample for sr in out.scheduled]
                w.busy_s += seconds
                w.batcher.observe_step(seconds)
                num_steps += 1
                w.token += 1
                push(t + seconds, _WORKER, w.index, w.token)
                return
            if s.has_unfinished_requests():
                # Nothing could run this turn (every request refused or held back): try again after
                # an empty step's time rather than spinning at the same instant.
                w.busy_s += fixed_s
                w.token += 1
                push(t + max(fixed_s, 1e-6), _WORKER, w.index, w.token)
                return
        if stream and took:  # more unread entries than this turn took
            w.token += 1
            push(t, _WORKER, w.index, w.token)
            return
        w.blocked = True
        w.block_seq += 1
        blocked.append((w.index, w.block_seq))
        wait = w.batcher.time_until_release(engine_idle=True)
        w.timer_at = float("inf") if wait is None else t + wait
        if wait is not None:
            w.token += 1
            push(w.timer_at, _WORKER, w.index, w.token)

    for w in workers:  # every worker starts by reading (and blocks if there is nothing yet)
        push(0.0, _WORKER, w.index, w.token)
    handled = 0
    while events:
        t, kind, _, index, token = heapq.heappop(events)
        clock.now = t
        handled += 1
        if handled > max_events:
            raise RuntimeError(f"the simulation did not finish within {max_events} events")
        if kind == _ARRIVAL:
            stream.append(index)
            while blocked:
                wi, bseq = blocked.popleft()
                w = workers[wi]
                if w.blocked and w.block_seq == bseq:
                    wake(w, t + wake_delay())
                    break
            continue
        w = workers[index]
        if token != w.token:
            continue  # superseded by an earlier wake-up
        w.blocked = False
        w.timer_at = float("inf")
        turn(w, t)
    unfinished = [o.id for o in outcomes if o.finished_s is None]
    if unfinished:
        raise RuntimeError(f"the simulation ended with {len(unfinished)} requests unfinished (e.g. {unfinished[:3]})")
    return SimResult(outcomes, num_workers, [w.busy_s for w in workers], num_steps,
                     sum(w.scheduler.num_preemptions_total for w in workers),
                     max((o.finished_s for o in outcomes), default=0.0))
