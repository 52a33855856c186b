"""How many proposed tokens a request runs in a step: the adaptive rule of speculative decoding.

A proposed token is worth computing when it is expected to pay for itself. Measurements decide:

- **The step's cost per token.** The model runner's time for each step, less any draft model's
  forwards, against the number of tokens it ran, fitted as ``t(n) = a + b * n`` by least squares
  over recent steps (older ones forgotten geometrically). ``a`` is what a step costs whatever it
  runs (reading the weights, launching work), ``b`` what each token adds.
- **The draft's cost per depth** ``c`` (proposers that run a model, such as ``self``): a draft
  runs one forward per proposal depth for all the requests it proposes for, so the step's
  deepest run of proposals ``D`` adds ``c * D`` seconds, measured by the model runner.
- **The request's acceptance rate** ``alpha``: the share of its proposed tokens that were accepted,
  starting from the proposer's recent rate (its prior) and moving to the request's own as it
  checks proposals. The proposer's rate forgets its evidence step by step and leans on a fixed
  prior of its own, so that when nothing is being proposed it drifts back and new requests try
  again: a bad spell never switches speculation off for good.

A step of ``n`` tokens takes ``T = a + b * n + c * D`` seconds and does ``U`` tokens of useful
work: its known tokens, and each proposal weighted by its chance of acceptance. A proposal at
depth ``j`` (the j-th of a request's run) is kept only if all ``j - 1`` before it are, so it adds
``alpha ** j`` useful tokens on average, for ``b`` more seconds, plus ``c`` when it deepens the
step's draft. Adding it keeps the step's useful work per second from falling exactly when

    alpha ** j >= (b + c * [j > D]) * U / T

In a nearly empty step the right side is close to 0 for a proposer that costs nothing (the fixed
part dominates: even unlikely proposals are almost free), and in a step full of prefill chunks
and decodes it approaches 1 (every proposed token displaces one that was sure to be useful), so
speculation fades out as load rises, per request in order of how well it has been guessing. A
draft's forward costs a good part of a step, so its proposals run only while it guesses well.

Until the fit has seen steps of different sizes (or when it finds no cost per token), ``b`` counts
as 0; the fixed ceiling ``SchedulerConfig.speculative_max_batched_tokens`` applies always.
"""

from __future__ import annotations

from dataclasses import dataclass

# A proposer's acceptance rate before it has checked anything, and how many proposed tokens of
# evidence that prior is worth against a request's own record.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0
# Per step, the weight kept by older measurements (about the last 1 / (1 - DECAY) steps count).
DECAY = 0.98
# The weight of each step's draft seconds per forward in their running average.
DRAFT_SMOOTHING = 0.1
# The fit needs its step sizes to spread by at least this many tokens (standard deviation).
MIN_SPREAD_TOKENS = 1.0


@dataclass
class StepCostModel:
    """``t(n) = a + b * n`` by exponentially weighted least squares over the steps recorded."""

    decay: float = DECAY
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        n = float(num_tokens)
        self._w = self._w * d + 1.0
        self._n = self._n * d + n
        self._nn = self._nn * d + n * n
        self._t = self._t * d + seconds
        self._nt = self._nt * d + n * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, or None until the recorded steps differ enough in size to tell them apart."""
        w = self._w
        if w <= 0.0:
            return None
        mean_n = self._n / w
        var_n = self._nn / w - mean_n * mean_n
        if var_n < MIN_SPREAD_TOKENS ** 2:
            return None
        b = (self._nt / w - mean_n * self._t / w) / var_n
        a = self._t / w - b * mean_n
        return max(a, 0.0), b


@dataclass
class AcceptanceRate:
    """A proposer's recent acceptance rate: accepted / proposed tokens with ``PRIOR_WEIGHT`` tokens
    at ``PRIOR_ACCEPTANCE`` added, the evidence forgotten geometrically per step (``age``)."""

    decay: float = DECAY
    _proposed: float = 0.0
    _accepted: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self._proposed += proposed
        self._accepted += accepted

    def age(self) -> None:
        self._proposed *= self.decay
        self._accepted *= self.decay

    @property
    def rate(self) -> float:
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self._proposed + PRIOR_WEIGHT)


class SpeculationPolicy:
    """Per step and request, the most proposed tokens worth computing (see the module docstring)."""

    def __init__(self) -> None:
        self.step_cost = StepCostModel()
        self.acceptance = AcceptanceRate()
        # Seconds per draft forward (None until a draft has run), averaged over recent steps.
        self.draft_forward_s: float | None = None

    def record_step(self, num_tokens: int, seconds: float, draft_seconds: float = 0.0,
                    draft_depth: int = 0) -> None:
        """One step of the model runner: how many tokens it ran and its seconds, of which
        ``draft_seconds`` in ``draft_depth`` forwards of a draft model."""
        if num_tokens > 0 and seconds >= 0.0:
            self.step_cost.record(num_tokens, max(0.0, seconds - draft_seconds))
        if draft_depth > 0 and draft_seconds > 0.0:
            per = draft_seconds / draft_depth
            last = self.draft_forward_s
            self.draft_forward_s = per if last is None else last + DRAFT_SMOOTHING * (per - last)
        self.acceptance.age()

    def record_check(self, proposed: int, accepted: int) -> None:
        """One request's proposals checked in a step."""
        if proposed > 0:
            self.acceptance.record(proposed, accepted)

    def request_rate(self, num_proposed: int, num_accepted: int) -> float:
        """A request's acceptance rate from its own record, the proposer's rate as the prior."""
        prior = self.acceptance.rate
        return (num_accepted + PRIOR_WEIGHT * prior) / (num_proposed + PRIOR_WEIGHT)

    def depth(self, rate: float, limit: int, *, num_tokens: int, useful_tokens: float | None = None,
              draft_depth: int = 0) -> int:
        """How many proposals (at most ``limit``) a request with acceptance ``rate`` adds to a step
        that already has ``num_tokens`` tokens, ``useful_tokens`` of them expected useful (default:
        all) and proposals ``draft_depth`` deep: each next one while ``rate ** j`` is at least its
        marginal seconds times the step's useful tokens per second with it."""
        fitted = self.step_cost.fit()
        a, b = fitted if fitted is not None else (0.0, 0.0)
        b = max(b, 0.0)
        c = self.draft_forward_s or 0.0
        if b == 0.0 and c == 0.0:
            return limit
        useful = float(num_tokens) if useful_tokens is None else useful_tokens
        k = 0
        expected = 1.0
        while k < limit:
            j = k + 1
            expected *= rate
            marginal = b + (c if j > draft_depth else 0.0)
            seconds = a + b * (num_tokens + j) + c * max(draft_depth, j)
            if seconds <= 0.0 or expected * seconds < marginal * (useful + expected):
                break
            useful += expected
            k = j
        return k
