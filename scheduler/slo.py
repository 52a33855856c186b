"""Latency targets beside a bulk backlog: steps sized so that interactive requests keep theirs.

A request with a latency target (``slo_ttft_ms``, ``slo_tpot_ms``) is *interactive*; one without
is *bulk*. Every running sequence normally gets a token each step, so a step's time grows with the
backlog beside it, and so does an interactive request's time per output token. While interactive
requests are in the scheduler, or one left less than ``RECENT_S`` seconds ago, each step is
planned here (:meth:`SloScheduling.plan`):

* The step's time is predicted by :class:`StepTimeModel`, a linear model of the step's shape
  (tokens, sequences, causal attention pairs of prompt chunks, context of decode tokens: the
  features of `mqinfer plan`'s model, loadgen/plan/model.py), fitted by exponentially weighted
  least squares on relative errors to the engine's own measured steps, so it follows the machine
  and the model as they are now. Until it has seen ``MIN_STEPS`` steps no step is planned.
* The target step time is the tightest TPOT target among the running interactive requests (else
  among the waiting ones; with TTFT targets only, a ``TTFT_STEPS``-th of the tightest TTFT; after
  the last one left, the last target). A step may be predicted to take that, times ``SAFETY``,
  less the worker's measured time between steps (rows, replies, reading the stream), which a
  running request waits for too.
* Interactive requests come first in the scheduling order (scheduler.py), so they are served and
  admitted first, and are never the victim of a preemption made for a bulk request. Their prompts
  are never chunked by the plan (only by ``max_num_batched_tokens``, as without targets): a TPOT
  target is a mean over the request's output tokens (as ``slo_met`` measures it), and a prompt
  cut into several steps costs the running interactive decodes the same compute, plus each
  step's fixed time, as one longer step, while its own first token comes steps later. What a
  planned step leaves out to keep the target is bulk work.
* Bulk decodes then ride in the step while the predicted time stays within the target, those
  that have waited longest first; the rest are left out of the step, keep their KV blocks, and
  resume where they were in a later step. Bulk prompt chunks (running ones and admissions) get
  the time that is left, and at least ``MIN_BULK_PROMPT_TOKENS`` tokens per step.
* A step that runs an interactive request's prompt takes no bulk work beyond what the starvation
  bound below requires (and those ``MIN_BULK_PROMPT_TOKENS``), so that its first token comes about
  as soon as it would without the backlog: bulk time within the target would add to every
  first token, while it costs the backlog one lean step per interactive request.
* No starvation: a running bulk sequence sits out at most about ``BULK_MAX_WAIT_S`` seconds of
  planned steps in a row. In steps, that is ``bulk_min_every(target)``: the wait over the target
  step time, between ``BULK_MIN_EVERY`` and ``BULK_MAX_EVERY`` steps, so that a bulk sequence's
  minimum rate does not grow the steps with the backlog (256 bulk decodes at one in 8 steps would
  put 32 in every step, twice a small step's time on two cores). Each step runs at least that
  share of the bulk decodes (those that have sat out longest), whatever the time, so that the
  rate is spread over the steps; and a sequence that has sat out one step fewer than the bound
  runs in the next one (a prompt chunk then gets ``MIN_BULK_PROMPT_TOKENS`` tokens whatever the
  time left).

*Light* steps: from ``RECENT_S`` to ``WARM_S`` seconds after the last interactive request left,
steps are composed as without targets (every sequence runs, no decode is left out) except that
bulk prompt chunks are bounded, to what keeps the step within the longest of: the last target
step time; ``LIGHT_FACTOR`` times the step of the running decodes alone; and ``LIGHT_TTFT_SHARE``
of the last tightest TTFT target (at least ``MIN_BULK_PROMPT_TOKENS`` tokens). The next interactive
request of a sporadic producer then arrives during a step that leaves it the rest of its TTFT
target, not behind a step of thousands of prompt tokens. The TTFT bound matters when few bulk
sequences run (after a planned stretch has let the backlog's running set drain, or when a backlog
arrives soon after interactive traffic): bounding the chunks to a decode step's time there would
admit about one bulk prompt a step and keep the running set, and the throughput, small for the
whole warm period.

A request that arrives while a step runs need not wait for its end: the worker watches its streams
during each step and the engine gives the step up between two layers when one arrives
(workers/queue/arrivals.py, workers/engine/core.py); its requests compute the same tokens again in a
later step. The first request of a stream then waits for about one layer of the bulk step in progress,
not all of it, and a request arriving beside running interactive ones about one layer of the planned
step. A step that moves interactive requests along is given up only before its middle layer (later,
waiting for the rest costs everyone less than starting again) and at most twice in a row (two
requests arriving close together share the next step), so that they get a token at least every
third step; a given-up step costs each of them at most half of one step, a small share of a TPOT
target that is a mean over their tokens.

With no interactive request in the scheduler and none within ``WARM_S`` seconds,
:meth:`SloScheduling.plan` returns None and the scheduler composes the step exactly as without this
module; the model still learns from every step, so that it is ready when interactive traffic
arrives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mqinfer.scheduler.request import EngineRequest, RequestStatus

# Longest target accepted, in milliseconds (a day: a longer one is a mistake, not a target).
MAX_SLO_MS = 86_400_000
# Steps the model must have seen before any step is planned.
MIN_STEPS = 8
# Per step, the weight kept by older measurements (about the last 1 / (1 - DECAY) steps count).
DECAY = 0.98
# Share of the target step time that a planned step and the worker's time between steps may be
# predicted to take together: the rest is left for the model's error.
SAFETY = 0.85
# The weight of each new measurement of the worker's time between steps in its running average.
GAP_SMOOTHING = 0.1
# A request with only a TTFT target: its prompt should take about this many steps at most.
TTFT_STEPS = 4
# Seconds after the last interactive request left during which steps are still planned, so that
# the next request of a stream does not arrive behind a full bulk step.
RECENT_S = 2.0
# Seconds after the last interactive request left during which steps are light (module docstring):
# bulk prompt chunks bounded, every sequence still running.
WARM_S = 30.0
# In a light step, bulk prompt chunks may make the step this many times the step of its decodes
# alone (when that is longer than the last target).
LIGHT_FACTOR = 2.0
# ... or this share of the last tightest TTFT target, when longer: an interactive request that
# arrives during the step keeps the rest for its own prompt.
LIGHT_TTFT_SHARE = 0.5
# While steps are planned, a running bulk sequence sits out about this many seconds at most.
BULK_MAX_WAIT_S = 2.0
# ... which in steps of the target time is kept between these two: a running bulk sequence runs
# in at least one of every bulk_min_every(target) consecutive planned steps.
BULK_MIN_EVERY = 8
BULK_MAX_EVERY = 64
# Bulk prompt tokens a planned step runs at least (when any bulk prompt waits for them).
MIN_BULK_PROMPT_TOKENS = 16


def bulk_min_every(target_s: float) -> int:
    """In how many consecutive planned steps of ``target_s`` seconds each running bulk sequence
    runs at least once: ``BULK_MAX_WAIT_S`` over the target, within [BULK_MIN_EVERY, BULK_MAX_EVERY]."""
    if not target_s > 0:
        return BULK_MAX_EVERY
    return max(BULK_MIN_EVERY, min(BULK_MAX_EVERY, math.ceil(BULK_MAX_WAIT_S / target_s)))


# Feature scales, so that the least-squares system is well conditioned.
_SCALES = (1.0, 1.0 / 128, 1.0 / 64, 1.0 / 65536, 1.0 / 8192)


def parse_tenant_slos(text: str | None) -> dict[str, tuple[int, int]]:
    """``tenant=TTFT_MS/TPOT_MS,...`` as tenant -> (ttft_ms, tpot_ms); empty text or None: none.

    Each entry is split at its last ``=``; both targets are whole milliseconds from 1 to a day.
    A tenant named twice, an empty name or a malformed entry is an error naming the entry.
    """
    slos: dict[str, tuple[int, int]] = {}
    if text is None or not str(text).strip():
        return slos
    for position, entry in enumerate(str(text).split(","), start=1):
        item = entry.strip()
        if not item:
            raise ValueError(f"tenant SLOs: entry {position} is empty (expected tenant=TTFT_MS/TPOT_MS,...)")
        tenant, sep, raw = item.rpartition("=")
        tenant, raw = tenant.strip(), raw.strip()
        if not sep or not tenant:
            raise ValueError(f"tenant SLOs: entry {item!r} is not tenant=TTFT_MS/TPOT_MS")
        parts = raw.split("/")
        if len(parts) != 2:
            raise ValueError(f"tenant SLOs: the targets of tenant {tenant!r} must be TTFT_MS/TPOT_MS, got {raw!r}")
        targets = []
        for name, value in zip(("TTFT", "TPOT"), parts):
            value = value.strip()
            if not value.isdigit() or not 1 <= int(value) <= MAX_SLO_MS:
                raise ValueError(f"tenant SLOs: the {name} target of tenant {tenant!r} must be a whole number of "
                                 f"milliseconds from 1 to {MAX_SLO_MS}, got {value!r}")
            targets.append(int(value))
        if tenant in slos:
            raise ValueError(f"tenant SLOs: tenant {tenant!r} is given twice")
        slos[tenant] = (targets[0], targets[1])
    return slos


def format_tenant_slos(slos: Mapping[str, tuple[int, int]]) -> str:
    """The text that :func:`parse_tenant_slos` reads back to the same targets."""
    return ",".join(f"{tenant}={ttft}/{tpot}" for tenant, (ttft, tpot) in slos.items())


@dataclass(slots=True)
class StepShape:
    """What a step's time depends on (loadgen/plan/model.py): its tokens, its sequences, the causal
    (query, key) pairs of its prompt chunks and the summed context of its decode tokens."""

    tokens: int = 0
    seqs: int = 0
    pairs: float = 0.0
    decode_context: int = 0

    def add(self, num_tokens: int, context_len: int) -> None:
        """A sequence running ``num_tokens`` tokens that end at ``context_len``."""
        self.tokens += num_tokens
        self.seqs += 1
        if num_tokens == 1:
            self.decode_context += context_len
        else:
            self.pairs += num_tokens * context_len - num_tokens * (num_tokens - 1) / 2

    def with_prompt(self, num_tokens: int) -> "StepShape":
        """This shape plus a fresh prompt chunk of ``num_tokens`` tokens."""
        shape = StepShape(self.tokens, self.seqs, self.pairs, self.decode_context)
        if num_tokens > 0:
            shape.add(num_tokens, num_tokens)
        return shape

    def features(self) -> tuple[float, ...]:
        raw = (1.0, self.tokens, self.seqs, self.pairs, self.decode_context)
        return tuple(v * s for v, s in zip(raw, _SCALES))

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> "StepShape":
        shape = cls()
        for n, ctx in chunks:
            shape.add(n, ctx)
        return shape


class StepTimeModel:
    """Step seconds as a non-negative linear function of :class:`StepShape`'s features, fitted by
    exponentially weighted least squares on relative errors (each step weighs 1 / seconds², so a
    short decode step counts as much as a long prefill one)."""

    def __init__(self, decay: float = DECAY, min_steps: int = MIN_STEPS) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        k = len(_SCALES)
        self._xtx = [[0.0] * k for _ in range(k)]
        self._xty = [0.0] * k
        self._coef: list[float] | None = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)) or shape.seqs == 0:
            return
        x = shape.features()
        w = 1.0 / (seconds * seconds)
        d = self.decay
        xtx, xty = self._xtx, self._xty
        for i, xi in enumerate(x):
            row = xtx[i]
            wxi = w * xi
            for j, xj in enumerate(x):
                row[j] = d * row[j] + wxi * xj
            xty[i] = d * xty[i] + wxi * seconds
        self.num_steps += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def coefficients(self) -> list[float]:
        """Per scaled feature, seconds (none negative: a feature whose fit is negative is dropped)."""
        if self._coef is None:
            self._coef = _nonnegative_solve(self._xtx, self._xty)
        return self._coef

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), shape.features()))


def _nonnegative_solve(a: Sequence[Sequence[float]], b: Sequence[float]) -> list[float]:
    """Least squares from normal equations ``a x = b`` with x >= 0: solve, drop the most negative
    unknown, solve again (a small ridge keeps collinear features, as in steps all alike, solvable)."""
    k = len(b)
    free = list(range(k))
    x = [0.0] * k
    while free:
        ridge = 1e-9 * max(1e-300, max(a[i][i] for i in free))
        m = [[a[i][j] + (ridge if i == j else 0.0) for j in free] + [b[i]] for i in free]
        sol = _gauss(m)
        if sol is None:
            return [0.0] * k
        worst = min(range(len(free)), key=lambda n: sol[n])
        if sol[worst] >= 0:
            for n, i in enumerate(free):
                x[i] = sol[n]
            return x
        del free[worst]
    return x


def _gauss(m: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on the augmented matrix ``m`` (changed in place)."""
    n = len(m)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(slots=True)
class StepPlan:
    """What one planned step may run: the bulk sequences left out, and the prompt tokens that bulk
    requests may still take (drawn down as the scheduler places them; interactive prompts are not
    limited by the plan)."""

    target_s: float
    skip: set[int] = field(default_factory=set)
    # Bulk sequences that have sat out bulk_min_every(target_s) - 1 steps: they run whatever the
    # time left.
    overdue: set[int] = field(default_factory=set)
    bulk_prompt_tokens: int = 0
    # A light step (module docstring): only bulk prompt chunks are bounded.
    light: bool = False

    def running_tokens(self, request: EngineRequest, num_new: int) -> int:
        """How many of its ``num_new`` tokens a running request runs this step (0: it sits out,
        keeping its KV), taken from the bulk allowance when they are a bulk request's prompt tokens."""
        if id(request) in self.skip:
            return 0
        if num_new > 1:
            num_new = self.prompt_limit(request, num_new)
            self.take(request, num_new)
        return num_new

    def prompt_limit(self, request: EngineRequest, num_new: int) -> int:
        """How many of ``num_new`` prompt tokens ``request`` may run this step (0: it sits out)."""
        if request.interactive:
            return num_new
        n = min(num_new, self.bulk_prompt_tokens)
        if n <= 0 and id(request) in self.overdue:
            n = min(num_new, MIN_BULK_PROMPT_TOKENS)
        return n

    def take(self, request: EngineRequest, num_tokens: int) -> None:
        """``request`` runs ``num_tokens`` prompt tokens: a bulk one's are drawn from the allowance."""
        if not request.interactive:
            self.bulk_prompt_tokens = max(0, self.bulk_prompt_tokens - num_tokens)


class SloScheduling:
    """Plans steps while interactive requests are in the scheduler (module docstring).

    The scheduler tells it of every request that arrives (``add``) and ends (``end``), asks for a
    plan at the start of each step, reports what the step scheduled (``scheduled``) and then how
    long it took (``record``).
    """

    def __init__(self, max_num_batched_tokens: int, model: StepTimeModel | None = None) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = model or StepTimeModel()
        # Unfinished interactive requests by id.
        self._interactive: dict[str, EngineRequest] = {}
        self._last_interactive_at = -math.inf
        self._last_target_s: float | None = None
        self._last_ttft_s: float | None = None
        # Steps planned or not, counted; and the step each running bulk sequence last ran in
        # (kept only while steps are planned).
        self._step = 0
        self._last_run: dict[str, int] = {}
        self._shape: StepShape | None = None
        # The bulk sequences of the step last scheduled and when each had run before it.
        self._last_run_before: list[tuple[str, int | None]] = []
        # Running average of the worker's seconds between the end of a step and the next one.
        self.gap_s = 0.0
        self.num_planned_steps = 0
        self.num_light_steps = 0

    # -- requests in and out ------------------------------------------------------------------
    def add(self, request: EngineRequest, now: float) -> None:
        if request.interactive:
            self._interactive[request.request_id] = request
            self._last_interactive_at = now

    def end(self, request: EngineRequest, now: float) -> None:
        self._last_run.pop(request.request_id, None)
        if self._interactive.pop(request.request_id, None) is not None:
            self._last_interactive_at = now

    def active(self, now: float) -> bool:
        """Whether steps are planned now: an interactive request is in, or one left recently."""
        return bool(self._interactive) or now - self._last_interactive_at < RECENT_S

    # -- one step -----------------------------------------------------------------------------
    def warm(self, now: float) -> bool:
        """Whether steps are at least light now (module docstring)."""
        return now - self._last_interactive_at < WARM_S

    def plan(self, running: Sequence[EngineRequest], now: float) -> StepPlan | None:
        """The plan of the step about to be scheduled, or None: compose it as without targets."""
        self._step += 1
        if not self.active(now):
            self._last_run.clear()
            return self._light_plan(running) if self.warm(now) else None
        model = self.model
        if not model.ready:
            return None
        target = self._target_s(running)
        if target is None:
            return None
        budget = target * SAFETY - self.gap_s
        plan = StepPlan(target_s=target)
        every = bulk_min_every(target)
        shape = StepShape()
        decodes: list[tuple[int, int, EngineRequest]] = []
        forced = 0  # overdue bulk decodes
        prompt = 0  # interactive prompt tokens this step runs: all of them (module docstring)
        step = self._step
        for position, request in enumerate(running):
            num_new = request.num_tokens - request.num_computed_tokens
            if request.interactive:
                if num_new <= 1:
                    shape.add(1, request.num_tokens)
                else:
                    prompt += num_new
                continue
            last = self._last_run.setdefault(request.request_id, step - 1)
            overdue = step - last >= every
            if overdue:
                plan.overdue.add(id(request))
            if num_new <= 1:
                if overdue:
                    shape.add(1, request.num_tokens)
                    forced += 1
                else:
                    decodes.append((last, position, request))
        for request in self._interactive.values():
            if request.status is not RequestStatus.RUNNING:
                prompt += request.num_tokens - request.num_computed_tokens
        shape = shape.with_prompt(min(prompt, self.max_num_batched_tokens))
        if prompt:
            # A step with interactive prompt tokens: bulk work only as the starvation bound needs,
            # so that the first token comes about as soon as without the backlog.
            budget = min(budget, model.predict(shape))
        # Bulk decodes, those that have sat out longest first: a share of them whatever the time
        # (so that the minimum rate is spread over the steps rather than met all at once by the
        # overdue), then more while the step stays in budget.
        decodes.sort(key=lambda d: (d[0], d[1]))
        quota = -(-(len(decodes) + forced) // every) - forced
        n = 0
        for _, _, request in decodes:
            trial = StepShape(shape.tokens, shape.seqs, shape.pairs, shape.decode_context)
            trial.add(1, request.num_tokens)
            if n >= quota and model.predict(trial) > budget:
                break
            shape = trial
            n += 1
        plan.skip = {id(request) for _, _, request in decodes[n:]}
        plan.bulk_prompt_tokens = max(MIN_BULK_PROMPT_TOKENS, self._prompt_fit(shape, budget))
        self.num_planned_steps += 1
        return plan

    def scheduled(self, scheduled: Iterable[tuple[EngineRequest, int]], planned: bool) -> None:
        """What the step scheduled, as (request, tokens) before the model runs: its shape, for
        ``record``; in a planned step, when each bulk sequence ran."""
        shape = StepShape()
        step = self._step
        last_run = self._last_run
        before: list[tuple[str, int | None]] = []
        for request, n in scheduled:
            shape.add(n, request.num_computed_tokens + n)
            if planned and not request.interactive:
                before.append((request.request_id, last_run.get(request.request_id)))
                last_run[request.request_id] = step
        self._shape = shape
        self._last_run_before = before

    def discard_step(self) -> None:
        """The step last scheduled did not run to its end: its time teaches the model nothing, and
        the bulk sequences in it did not run (they count as waiting since they last did)."""
        self._shape = None
        for request_id, last in self._last_run_before:
            if last is None:
                self._last_run.pop(request_id, None)
            else:
                self._last_run[request_id] = last
        self._last_run_before = []

    def record(self, seconds: float, gap_s: float | None = None) -> None:
        """The measured time of the step last scheduled, and the worker's time between the step
        before it and this one (None when the worker was idle in between)."""
        if self._shape is not None:
            self.model.observe(self._shape, seconds)
            self._shape = None
        if gap_s is not None and gap_s >= 0 and math.isfinite(gap_s):
            self.gap_s += GAP_SMOOTHING * (gap_s - self.gap_s)

    # -- internals ----------------------------------------------------------------------------
    def _light_plan(self, running: Sequence[EngineRequest]) -> StepPlan | None:
        """A light step (module docstring): nothing left out, bulk prompt chunks bounded."""
        target = self._last_target_s
        if target is None or not self.model.ready:
            return None
        shape = StepShape()
        for request in running:
            if request.num_tokens - request.num_computed_tokens <= 1:
                shape.add(1, request.num_tokens)
        limit = max(target * SAFETY - self.gap_s, LIGHT_FACTOR * self.model.predict(shape))
        if self._last_ttft_s is not None:
            limit = max(limit, self._last_ttft_s * LIGHT_TTFT_SHARE - self.gap_s)
        plan = StepPlan(target_s=target, light=True)
        plan.bulk_prompt_tokens = max(MIN_BULK_PROMPT_TOKENS, self._prompt_fit(shape, limit))
        self.num_light_steps += 1
        return plan

    def _target_s(self, running: Sequence[EngineRequest]) -> float | None:
        """The step time to keep to (module docstring)."""
        tpot = [r.slo_tpot_ms for r in running if r.interactive and r.slo_tpot_ms is not None]
        if not tpot:
            tpot = [r.slo_tpot_ms for r in self._interactive.values() if r.slo_tpot_ms is not None]
        ttft = [r.slo_ttft_ms for r in self._interactive.values() if r.slo_ttft_ms is not None]
        if ttft:
            self._last_ttft_s = min(ttft) / 1000.0
        elif self._interactive:
            self._last_ttft_s = None
        if tpot:
            self._last_target_s = min(tpot) / 1000.0
        elif ttft:
            self._last_target_s = min(ttft) / 1000.0 / TTFT_STEPS
        return self._last_target_s

    def _prompt_fit(self, shape: StepShape, budget: float) -> int:
        """The most prompt tokens that a step of ``shape`` can add and stay within ``budget``."""
        predict = self.model.predict
        lo, hi = 0, self.max_num_batched_tokens
        if predict(shape.with_prompt(1)) > budget:
            return 0
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predict(shape.with_prompt(mid)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo
