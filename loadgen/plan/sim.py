"""The simulation behind `mqinfer plan`: the real scheduler and batcher on a simulated clock.

Each simulated worker holds a real ``DynamicBatcher`` and a real ``Scheduler`` (scheduler/), both
reading one simulated clock, and runs the worker's loop: read entries from the stream, admit what
the batcher releases, schedule a step. Instead of running the model, a step lasts what the fitted
step-cost model (``model``) says for the step's shape, and every request that needs a token
gets a fake one, so each generates exactly its output length (no EOS, no stop rule). Scheduling,
chunked prefill, the token budget, ``max_num_seqs``, KV blocks, prefix-cache hits and preemption
are therefore the engine's own; only the model's time is predicted.

The stream (Redis) is a FIFO of arrived entries. A worker whose engine is idle blocks on it, and
an arriving entry wakes the worker that has blocked longest, as Redis serves blocked readers. At
every turn of its loop a worker reads what the worker's ingest would (workers/queue/ingest.py):
``room`` from its free sequences and waiting bound, at most ``max_batch``, within an even share
of the outstanding work between the workers.

The loop around the engine is a :class:`WorkerLoop` measured on the real pipeline
(calibrate): between two steps the worker spends a drawn loop gap (Redis round trips,
metering, admitting), more for each request the last step finished and each the step starts
(``gap_per_finished_s``, ``gap_per_started_s``); every step's engine time is scaled by a noise
factor (how a worker's own steps of that modelled size ran against the model; the spread of
repeated engine steps of one shape where no worker's steps were logged). Where the calibration logged when the worker's steps
ran slow, the factors follow that series: where a machine's slow steps come in runs, each machine
of the simulation walks the measured series in stretches of steps, each from a random point of
it, and a step takes its bin's factor at the walked rank; otherwise each factor is an independent
draw. Finished requests buffer two rows each (result and cost), and the
worker flushes them as `mqinfer worker` does: after a step that leaves the engine empty, or
once ``flush_rows`` rows or ``flush_interval_s`` seconds have gathered; a flush (Parquet written
and synced, then acked) stops the loop for a drawn flush time. A blocked worker acts on an
arriving entry a drawn wake-up after it arrives. A fresh worker's first step can carry the extra
seconds of its first steps (kernels loading and compiling on a GPU). Workers that share a machine's
cores (``WorkerSettings.workers_per_machine``) slow each other down: a step that starts while k
others of its machine are in a step lasts the loop's measured contention factor for k longer.
Every draw comes from one generator seeded by ``seed``.

Times of each request (arrival, first scheduled, first token, finished) come out as a
``RequestOutcome``; TTFT and TPOT follow the bench's rules (loadgen/metrics.py).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mqinfer.loadgen.plan.model import StepCostModel, StepShape, WorkerLoop
from mqinfer.scheduler.batcher import DynamicBatcher
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler

# The token every simulated step "samples": any id works, as simulated requests have no EOS.
FAKE_TOKEN = 7
_ARRIVAL, _WORKER = 0, 1
# Rows a finished request buffers: its result row and its cost row.
ROWS_PER_REQUEST = 2


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
    # Latency targets (interactive requests): the scheduler plans steps to them as a worker's does.
    slo_ttft_ms: int | None = None
    slo_tpot_ms: int | None = None


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
    # Whether it had a latency target (an interactive request).
    interactive: bool = False

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
    """What a simulated worker is built from: the engine's scheduler limits, the batcher's
    thresholds and when the worker flushes its rows (`mqinfer worker`'s flags of those names)."""

    scheduler: SchedulerConfig
    max_batch: int = 64
    max_wait_ms: float | str = 10.0
    flush_rows: int = 256
    flush_interval_s: float = 0.5
    # Workers that share one machine (workers 0..k-1 the first, k..2k-1 the next, ...), whose steps
    # slow each other down by the loop's ``contention``; 1: each worker has a machine (or a GPU)
    # of its own.
    workers_per_machine: int = 1

    @property
    def waiting_bound(self) -> int:
        """Requests a worker keeps waiting while its engine is full (``Ingest.waiting_bound``)."""
        return max(self.scheduler.max_num_seqs, 2 * self.max_batch)


@dataclass
class SimResult:
    outcomes: list[RequestOutcome]
    num_workers: int
    busy_s: list[float]  # seconds each worker spent in steps, the loop around them and flushes
    num_steps: int
    num_preemptions: int
    end_s: float  # when the last request finished
    num_flushes: int = 0


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
    rows: int = 0  # rows buffered, not yet flushed
    oldest_row_s: float = 0.0
    fresh: bool = False  # its next step is its first
    finished_last: int = 0  # requests its last step finished (their rows are built before the next)


def step_shape(out: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step, read before ``update_from_output`` advances its requests."""
    return StepShape.of((sr.num_new_tokens, sr.request.num_computed_tokens + sr.num_new_tokens)
                        for sr in out.scheduled)


class _Draws:
    """Seeded draws from the loop's measured samples."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, samples: Sequence[float], empty: float = 0.0) -> float:
        if not samples:
            return empty
        return samples[0] if len(samples) == 1 else samples[self.rng.randrange(len(samples))]


class _SlowPeriods:
    """Each machine's walk through the measured series of step ranks (WorkerLoop.step_noise_series):
    stretches of ``block`` steps, each from a random point of the series."""

    def __init__(self, ranks: Sequence[float], block: int, draws: _Draws) -> None:
        self.ranks, self.block, self.draws = ranks, block, draws
        self.walks: dict[int, tuple[int, int]] = {}  # machine: (next index into ranks, steps left in the stretch)

    def next_rank(self, machine: int) -> float:
        index, left = self.walks.get(machine, (0, 0))
        if left <= 0:
            index, left = self.draws.rng.randrange(max(1, len(self.ranks) - self.block + 1)), self.block
        self.walks[machine] = (index + 1, left - 1)
        return self.ranks[min(index, len(self.ranks) - 1)]


def quantile_at(samples: Sequence[float], rank: float) -> float:
    """The value at ``rank`` (0 to 1) of sorted ``samples``."""
    return samples[min(len(samples) - 1, int(rank * len(samples)))]


class Simulation:
    """One run of ``requests`` through ``num_workers`` simulated workers (see :func:`simulate`)."""

    def __init__(self, requests: Sequence[SimRequest], num_workers: int, settings: WorkerSettings,
                 model: StepCostModel, loop: WorkerLoop, seed: int, fresh: bool) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.requests, self.settings, self.model, self.loop = requests, settings, model, loop
        self.clock = SimClock()
        self.workers = [_Worker(i, Scheduler(settings.scheduler, clock=self.clock),
                                DynamicBatcher(max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
                                               clock=self.clock), fresh=fresh)
                        for i in range(num_workers)]
        self.outcomes = [RequestOutcome(r.id, len(r.prompt_token_ids), r.output_tokens, r.arrival_s,
                                        interactive=r.slo_ttft_ms is not None or r.slo_tpot_ms is not None)
                         for r in requests]
        self.events: list[tuple[float, int, int, int, int]] = []  # (time, kind, sequence, index, token)
        self.seq = 0
        self.stream: deque[int] = deque()
        self.blocked: deque[tuple[int, int]] = deque()  # (worker, its block_seq) in the order they blocked
        self.pending_total = 0  # entries read by some worker and not finished
        self.num_steps = self.num_flushes = 0
        self.draw = _Draws(seed)
        self.slow_periods = (_SlowPeriods(loop.step_noise_series, loop.step_noise_block_steps, self.draw)
                             if loop.step_noise_series else None)

    def push(self, t: float, kind: int, index: int, token: int = 0) -> None:
        heapq.heappush(self.events, (t, kind, self.seq, index, token))
        self.seq += 1

    def run(self, max_events: int) -> SimResult:
        for i, r in enumerate(self.requests):
            self.push(r.arrival_s, _ARRIVAL, i)
        for w in self.workers:  # every worker starts by reading (and blocks if there is nothing yet)
            self.push(0.0, _WORKER, w.index, w.token)
        handled = 0
        while self.events:
            t, kind, _, index, token = heapq.heappop(self.events)
            self.clock.now = t
            handled += 1
            if handled > max_events:
                raise RuntimeError(f"the simulation did not finish within {max_events} events")
            if kind == _ARRIVAL:
                self.arrive(index, t)
                continue
            w = self.workers[index]
            if token != w.token:
                continue  # superseded by an earlier wake-up
            w.blocked = False
            w.timer_at = float("inf")
            self.turn(w, t)
        unfinished = [o.id for o in self.outcomes if o.finished_s is None]
        if unfinished:
            raise RuntimeError(f"the simulation ended with {len(unfinished)} requests unfinished "
                               f"(e.g. {unfinished[:3]})")
        workers = self.workers
        return SimResult(self.outcomes, len(workers), [w.busy_s for w in workers], self.num_steps,
                         sum(w.scheduler.num_preemptions_total for w in workers),
                         max((o.finished_s for o in self.outcomes), default=0.0), self.num_flushes)

    def arrive(self, index: int, t: float) -> None:
        """An entry enters the stream and wakes the worker that has blocked longest."""
        self.stream.append(index)
        while self.blocked:
            wi, bseq = self.blocked.popleft()
            w = self.workers[wi]
            if w.blocked and w.block_seq == bseq:
                w.blocked = False
                w.token += 1
                # A read that times out first returns first.
                self.push(min(t + self.draw(self.loop.wake_samples_s), w.timer_at), _WORKER, w.index, w.token)
                break

    def finish(self, request: EngineRequest, t: float, error: str | None = None) -> None:
        o = self.outcomes[int(request.request_id)]
        o.finished_s = t
        o.error = error
        # Fewer than asked when the context limit ended it first.
        o.output_tokens = request.num_output_tokens
        w = self.workers[o.worker]
        w.held -= 1
        self.pending_total -= 1
        if not w.rows:
            w.oldest_row_s = t
        w.rows += ROWS_PER_REQUEST

    def read(self, w: _Worker) -> int:
        """Take this turn's entries from the stream into the worker's batcher; how many."""
        stream, settings = self.stream, self.settings
        if not stream:
            return 0
        s = w.scheduler
        queued = len(w.batcher)
        startable = 0 if s.num_waiting else max(0, settings.scheduler.max_num_seqs - s.num_running - queued)
        buffered = max(0, settings.waiting_bound - s.num_waiting - queued)
        room = min(max(startable, buffered), settings.max_batch)
        if room <= 1 and startable:
            take = room
        else:
            share = -(-(len(stream) + self.pending_total) // len(self.workers)) - w.held
            take = max(1 if startable else 0, min(room, share))
        take = min(take, len(stream))
        idle = not queued and not s.has_unfinished_requests()
        for _ in range(take):
            index = stream.popleft()
            self.outcomes[index].worker = w.index
            self.outcomes[index].to_idle_worker = idle
            w.batcher.add(index)
            w.held += 1
            self.pending_total += 1
        return take

    def end_step(self, w: _Worker, t: float) -> None:
        """The running step's tokens: first tokens, finished requests."""
        out, needs = w.step, w.needs_sample
        w.step, w.needs_sample = None, []
        done = w.scheduler.update_from_output(out, [FAKE_TOKEN if need else None for need in needs])
        for sr, need in zip(out.scheduled, needs):
            o = self.outcomes[int(sr.request.request_id)]
            if need and o.first_token_s is None:
                o.first_token_s = t
        w.finished_last = len(done)
        for request in done:
            self.finish(request, t)

    def flush_due(self, w: _Worker, t: float) -> bool:
        """`mqinfer worker`'s rule: rows buffered, and the engine empty or the sink's size or age
        threshold reached."""
        if not w.rows:
            return False
        return (not w.scheduler.has_unfinished_requests() or w.rows >= self.settings.flush_rows
                or t - w.oldest_row_s >= self.settings.flush_interval_s)

    def turn(self, w: _Worker, t: float) -> None:
        """One turn of the worker loop at time ``t``: end the running step, flush if due, read,
        admit, step."""
        s = w.scheduler
        if w.step is not None:
            self.end_step(w, t)
        if self.flush_due(w, t):
            seconds = self.draw(self.loop.flush_samples_s)
            w.rows = 0
            self.num_flushes += 1
            if seconds > 0:  # the rest of this turn runs when the flush is done
                w.busy_s += seconds
                self.wait(w, t + seconds)
                return
        took = self.read(w)
        max_len = self.settings.scheduler.max_model_len
        for index in w.batcher.poll(engine_idle=not s.has_unfinished_requests()):
            r = self.requests[index]
            s.add_request(EngineRequest(str(index), list(r.prompt_token_ids),
                                  SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True),
                                  arrival_time=r.arrival_s, priority=r.priority, max_model_len=max_len,
                                  tenant=r.tenant, slo_ttft_ms=r.slo_ttft_ms, slo_tpot_ms=r.slo_tpot_ms))
        if s.has_unfinished_requests() and self.start_step(w, t):
            return
        if self.stream and took:  # more unread entries than this turn took
            self.wait(w, t)
            return
        w.blocked = True
        w.block_seq += 1
        self.blocked.append((w.index, w.block_seq))
        wait = w.batcher.time_until_release(engine_idle=True)
        w.timer_at = float("inf") if wait is None else t + wait
        if wait is not None:
            self.wait(w, w.timer_at)

    def wait(self, w: _Worker, until: float) -> None:
        w.token += 1
        self.push(until, _WORKER, w.index, w.token)

    def others_in_step(self, w: _Worker) -> int:
        """Other workers of ``w``'s machine that are in a step now."""
        per = self.settings.workers_per_machine
        if per <= 1:
            return 0
        first = w.index - w.index % per
        return sum(1 for o in self.workers[first:first + per] if o is not w and o.step is not None)

    def noise_factor(self, w: _Worker, modelled_s: float) -> float:
        """How much slower than modelled ``w``'s next step runs."""
        samples = self.loop.noise_for(modelled_s)
        if self.slow_periods is None or not samples:
            factor = self.draw(samples, 1.0)
        else:
            machine = w.index // max(1, self.settings.workers_per_machine)
            factor = quantile_at(samples, self.slow_periods.next_rank(machine))
        return self.loop.scaled_noise(factor, modelled_s)

    def start_step(self, w: _Worker, t: float) -> bool:
        """Schedule a step and run it (after the loop's gap); False when nothing could run."""
        s, loop = w.scheduler, self.loop
        out = s.schedule()
        for request in out.finished:  # refused (prompt too long, too big for the cache) or expired
            self.finish(request, t, request.error_code or request.status.finish_reason)
        if out.scheduled:
            starting = [o for o in (self.outcomes[int(sr.request.request_id)] for sr in out.scheduled)
                        if o.started_s is None]
            gap = max(0.0, self.draw(loop.gap_samples_s) + loop.step_overhead_s
                      + loop.gap_per_finished_s * w.finished_last + loop.gap_per_started_s * len(starting))
            w.finished_last = 0
            for o in starting:  # a request starts with the engine step that first runs it
                o.started_s = t + gap
            modelled = self.model.step_seconds(step_shape(out))
            engine_s = modelled * self.noise_factor(w, modelled)
            if loop.contention:
                engine_s *= loop.contention_factor(self.others_in_step(w))
            if w.fresh:
                engine_s += loop.first_step_s
                w.fresh = False
            w.step, w.needs_sample = out, [sr.needs_sample for sr in out.scheduled]
            w.busy_s += gap + engine_s
            w.batcher.observe_step(engine_s)
            # As the engine does: the step-time model of latency targets learns from every step.
            s.record_step(engine_s, gap)
            self.num_steps += 1
            self.wait(w, t + gap + engine_s)
            return True
        if s.has_unfinished_requests():
            # Nothing could run this turn (every request refused or held back): try again after
            # an empty step's time rather than spinning at the same instant.
            empty = max(self.model.step_s_fixed + loop.mean_gap_s, 1e-6)
            w.busy_s += empty
            self.wait(w, t + empty)
            return True
        return False


def simulate(requests: Sequence[SimRequest], num_workers: int, settings: WorkerSettings,
             model: StepCostModel, *, loop: WorkerLoop | None = None, seed: int = 0, fresh: bool = False,
             max_events: int = 50_000_000) -> SimResult:
    """Run ``requests`` through ``num_workers`` simulated workers until every one has finished.
    ``loop`` is the worker loop around the engine (none by default: steps back to back, no
    flushes cost time, wake-ups are instant); ``seed`` seeds its draws; ``fresh``: the workers
    have just started (their first step pays ``loop.first_step_s``)."""
    return Simulation(requests, num_workers, settings, model, loop or WorkerLoop(), seed, fresh).run(max_events)
