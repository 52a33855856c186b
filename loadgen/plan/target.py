"""What a plan's workers must achieve and how a worker count is judged and searched: the target
(an online rate with SLOs, or a bulk job with or without a deadline), one simulated count's
figures by the bench's rules (``summarize``), whether they meet the target (``judge``), and the
fewest workers that do (``fewest_workers``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mqinfer.loadgen.plan.model import Calibration
from mqinfer.loadgen.plan.report import ms_text
from mqinfer.loadgen.plan.sim import RequestOutcome, SimRequest, SimResult, WorkerSettings

# The online goal when --rate comes without an SLO: p99 TTFT at most this many times an idle
# worker's (the batcher's wait plus the request's own prefill steps), a latency any rate reaches
# with enough workers.
IDLE_TTFT_FACTOR = 2.0
# The search gives up once doubling the workers improves the failing figure by less than this.
MIN_IMPROVEMENT = 0.02
# Never simulate more workers than this (a target no count below it meets is reported unmet).
MAX_WORKERS = 1024


@dataclass(frozen=True)
class Target:
    """What the workers must achieve: an online rate with SLOs, or a bulk job with or without a deadline."""

    rate: float | None = None
    slo_ttft_p99_s: float | None = None
    slo_tpot_p99_s: float | None = None
    deadline_s: float | None = None
    # The batcher's wait (seconds) and the p99 TTFT of the requests on an idle worker: the default
    # online goal is IDLE_TTFT_FACTOR times the latter.
    max_wait_s: float = 0.010
    idle_ttft_p99_s: float = 0.0

    @property
    def default_goal_s(self) -> float:
        return IDLE_TTFT_FACTOR * self.idle_ttft_p99_s

    @property
    def online(self) -> bool:
        return self.rate is not None

    @property
    def has_goal(self) -> bool:
        return self.online or self.deadline_s is not None

    def describe(self) -> str:
        if self.online:
            parts = []
            if self.slo_ttft_p99_s is not None:
                parts.append(f"p99 TTFT <= {ms_text(self.slo_ttft_p99_s)}")
            if self.slo_tpot_p99_s is not None:
                parts.append(f"p99 TPOT <= {ms_text(self.slo_tpot_p99_s)}")
            goal = ", ".join(parts) or (f"p99 TTFT <= {ms_text(self.default_goal_s)} ({IDLE_TTFT_FACTOR:g}x an idle "
                                        f"worker's p99: batcher wait + own prefill)")
            return f"{self.rate:g} requests/s, {goal}"
        if self.deadline_s is not None:
            return f"bulk job done within {self.deadline_s:g} s of the workers' start"
        return "bulk job (no deadline)"


@dataclass
class Evaluation:
    """One simulated worker count and what it achieved."""

    workers: int
    num_requests: int
    num_errors: int
    prompt_tokens: int
    output_tokens: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    output_tokens_per_s: float
    utilisation: float
    window_s: float  # first arrival -> last finished
    end_s: float  # simulation start -> last finished (a bulk job's run, start-up excluded)
    num_steps: int
    num_preemptions: int
    met: bool = True
    why: str = ""
    # The worst achieved / required ratio among the target's checks (<= 1 when met).
    excess: float = 0.0
    # Over the interactive requests (those with latency targets) alone; None without any.
    interactive_ttft_p99_s: float | None = None
    interactive_tpot_p99_s: float | None = None


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    from mqinfer.loadgen.metrics import percentile

    if not values:
        return None, None
    values.sort()
    return percentile(values, 50), percentile(values, 99)


def _interactive_p99s(done: Sequence[RequestOutcome]) -> tuple[float | None, float | None]:
    """p99 TTFT and TPOT of the interactive requests among ``done`` (None, None without any)."""
    mine = [o for o in done if o.interactive]
    _, ttft99 = _percentiles([o.ttft_s for o in mine if o.ttft_s is not None])
    _, tpot99 = _percentiles([o.tpot_s for o in mine if o.tpot_s is not None])
    return ttft99, tpot99


def summarize(sim: SimResult) -> Evaluation:
    """Latency, throughput and busy share of a simulated run, by the bench's rules."""
    done = [o for o in sim.outcomes if o.error is None]
    ttft50, ttft99 = _percentiles([o.ttft_s for o in done if o.ttft_s is not None])
    tpot50, tpot99 = _percentiles([o.tpot_s for o in done if o.tpot_s is not None])
    output = sum(o.output_tokens for o in done)
    starts = [o.started_s for o in done if o.started_s is not None]
    span = sim.end_s - min(starts) if starts else 0.0
    first_arrival = min((o.arrival_s for o in sim.outcomes), default=0.0)
    window = sim.end_s - first_arrival
    interactive_ttft, interactive_tpot = _interactive_p99s(done)
    return Evaluation(
        interactive_ttft_p99_s=interactive_ttft, interactive_tpot_p99_s=interactive_tpot,
        workers=sim.num_workers, num_requests=len(sim.outcomes), num_errors=len(sim.outcomes) - len(done),
        prompt_tokens=sum(o.prompt_tokens for o in done), output_tokens=output,
        ttft_p50_s=ttft50, ttft_p99_s=ttft99, tpot_p50_s=tpot50, tpot_p99_s=tpot99,
        output_tokens_per_s=output / span if span > 0 else 0.0,
        utilisation=sum(sim.busy_s) / (sim.num_workers * window) if window > 0 else 0.0,
        window_s=window, end_s=sim.end_s, num_steps=sim.num_steps, num_preemptions=sim.num_preemptions,
    )


def summarize_pooled(sims: Sequence[SimResult]) -> Evaluation:
    """One evaluation of several simulations of the same requests (different draws): percentiles
    over every simulation's requests together, throughput and time figures their means."""
    evs = [summarize(sim) for sim in sims]
    if len(evs) == 1:
        return evs[0]
    done = [o for sim in sims for o in sim.outcomes if o.error is None]
    ttft50, ttft99 = _percentiles([o.ttft_s for o in done if o.ttft_s is not None])
    tpot50, tpot99 = _percentiles([o.tpot_s for o in done if o.tpot_s is not None])

    def mean(name: str) -> float:
        return sum(getattr(ev, name) for ev in evs) / len(evs)

    interactive_ttft, interactive_tpot = _interactive_p99s(done)
    return replace(evs[0], interactive_ttft_p99_s=interactive_ttft, interactive_tpot_p99_s=interactive_tpot,
                   ttft_p50_s=ttft50, ttft_p99_s=ttft99, tpot_p50_s=tpot50, tpot_p99_s=tpot99,
                   output_tokens_per_s=mean("output_tokens_per_s"), utilisation=mean("utilisation"),
                   window_s=mean("window_s"), end_s=mean("end_s"), num_steps=round(mean("num_steps")),
                   num_preemptions=round(mean("num_preemptions")))


def judge(ev: Evaluation, target: Target, startup_s: float) -> Evaluation:
    """``ev`` with whether it meets ``target``, by how much, and a line saying what was checked."""
    checks: list[tuple[float | None, float, str]] = []  # (achieved, required, label)
    if target.online:
        if target.slo_ttft_p99_s is None and target.slo_tpot_p99_s is None:
            checks.append((ev.ttft_p99_s, target.default_goal_s, "p99 TTFT"))
        if target.slo_ttft_p99_s is not None:
            checks.append((ev.ttft_p99_s, target.slo_ttft_p99_s, "p99 TTFT"))
        if target.slo_tpot_p99_s is not None:
            checks.append((ev.tpot_p99_s or 0.0, target.slo_tpot_p99_s, "p99 TPOT"))
        texts = [f"{label} {ms_text(got)} vs {ms_text(need)}" for got, need, label in checks]
    elif target.deadline_s is not None:
        total = startup_s + ev.end_s
        checks.append((total, target.deadline_s, "done after"))
        texts = [f"done after {total:.1f} s (start-up {startup_s:.1f} s) vs deadline {target.deadline_s:g} s"]
    else:
        texts = []
    ratios = [math.inf if got is None else got / need for got, need, _ in checks]
    excess = max(ratios, default=0.0)
    return replace(ev, met=excess <= 1.0, excess=excess, why="; ".join(texts) or "no target")


def idle_ttft_p99(requests: Sequence[SimRequest], settings: WorkerSettings, calibration: Calibration,
                  wait_s: float) -> float:
    """The p99 over ``requests`` of the TTFT each would have alone on an idle worker: the worker's
    mean wake-up and the batcher's wait, then its prompt's prefill steps (chunks of at most the
    step's token budget), each after the loop's mean gap."""
    from mqinfer.loadgen.metrics import percentile
    from mqinfer.loadgen.plan.model import StepShape

    budget = settings.scheduler.max_num_batched_tokens
    model, loop = calibration.model, calibration.loop
    ttfts = []
    for r in requests:
        done, t = 0, loop.mean_wake_s + wait_s
        total = len(r.prompt_token_ids)
        while done < total:
            n = min(budget, total - done)
            t += model.step_seconds(StepShape.of([(n, done + n)])) + loop.mean_gap_s
            done += n
        ttfts.append(t)
    ttfts.sort()
    return percentile(ttfts, 99)


def fewest_workers(evaluate: Callable[[int], Evaluation], *, lower: int = 1, upper: int = MAX_WORKERS
                   ) -> tuple[Evaluation, list[Evaluation]]:
    """The smallest count in ``lower..upper`` whose evaluation meets the target (doubling, then
    bisecting; this assumes that more workers never do worse), with every count tried. When the
    target is out of reach (``upper`` misses it, or doubling the workers no longer improves the
    failing figure by MIN_IMPROVEMENT: the latency of a request's own steps is the floor), the best
    count tried is returned, unmet."""
    tried: dict[int, Evaluation] = {}

    def at(n: int) -> Evaluation:
        if n not in tried:
            tried[n] = evaluate(n)
        return tried[n]

    upper = max(lower, upper)
    n, last_unmet = lower, lower - 1
    while not at(n).met:
        gained = last_unmet < lower or at(n).excess < (1.0 - MIN_IMPROVEMENT) * at(last_unmet).excess
        if n >= upper or not gained:
            best = min(tried.values(), key=lambda e: (e.excess, e.workers))
            return best, sorted(tried.values(), key=lambda e: e.workers)
        last_unmet, n = n, min(upper, 2 * n)
    lo, hi = last_unmet, n  # lo unmet (or below the range), hi met
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid).met:
            hi = mid
        else:
            lo = mid
    return at(hi), sorted(tried.values(), key=lambda e: e.workers)
