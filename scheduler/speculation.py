"""How many proposed tokens a request runs in a step: the adaptive rule of speculative decoding.

A proposed token is worth computing when it is expected to pay for itself. Two measurements decide:

- **The step's cost per token.** The model runner's forward time of each step, against the
  number of tokens it ran, fitted as ``t(n) = a + b * n`` by least squares over recent steps
  (older ones forgotten geometrically). ``a`` is what a step costs whatever it runs (reading the
  weights, launching work), ``b`` what each token adds.
- **The request's acceptance rate** ``alpha``: the share of its proposed tokens that were accepted,
  starting from the proposer's recent rate (its prior) and moving to the request's own as it
  checks proposals. The proposer's rate forgets its evidence step by step and leans on a fixed
  prior of its own, so that when nothing is being proposed it drifts back and new requests try
  again: a bad spell never switches speculation off for good.

With ``n`` tokens scheduled, the step does ``n`` tokens of useful work in ``a + b * n`` seconds.
A proposal at depth ``j`` (the j-th of a request's run) is kept only if all ``j - 1`` before it
are, so it adds ``alpha ** j`` useful tokens on average, for ``b`` more seconds. Adding it keeps
the step's useful work per second from falling exactly when

    alpha ** j >= b * n / (a + b * n)

The right side is the per-token share of the step's time. In a nearly empty step it is close to
0 (weights dominate: even unlikely proposals are almost free), and in a step full of prefill
chunks and decodes it approaches 1 (every proposed token displaces one that was sure to be useful),
so speculation fades out as load rises, per request in order of how well it has been guessing.

Until the fit has seen steps of different sizes (or when it finds no cost per token), only the
fixed ceiling ``SchedulerConfig.speculative_max_batched_tokens`` applies; it applies always.
"""

from __future__ import annotations

from dataclasses import dataclass

# A proposer's acceptance rate before it has checked anything, and how many proposed tokens of
# evidence that prior is worth against a request's own record.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0
# Per step, the weight kept by older measurements (about the last 1 / (1 - DECAY) steps count).
DECAY = 0.98
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

    def token_share(self, num_tokens: int) -> float:
        """``b * n / (a + b * n)``: the part of an n-token step's time that its tokens add, 0 when
        the fit is not ready or finds no cost per token."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        a, b = fitted
        if b <= 0.0:
            return 0.0
        per_token = b * num_tokens
        return per_token / (a + per_token)


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

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """One step of the model runner: how many tokens it ran, and its forward seconds."""
        if num_tokens > 0 and seconds >= 0.0:
            self.step_cost.record(num_tokens, seconds)
        self.acceptance.age()

    def record_check(self, proposed: int, accepted: int) -> None:
        """One request's proposals checked in a step."""
        if proposed > 0:
            self.acceptance.record(proposed, accepted)

    def request_rate(self, num_proposed: int, num_accepted: int) -> float:
        """A request's acceptance rate from its own record, the proposer's rate as the prior."""
        prior = self.acceptance.rate
        return (num_accepted + PRIOR_WEIGHT * prior) / (num_proposed + PRIOR_WEIGHT)

    def depth(self, rate: float, num_tokens: int, limit: int) -> int:
        """How many proposals (at most ``limit``) to add to a step that already has ``num_tokens``:
        each next one while ``rate ** j`` is at least the token share of the step with it."""
        k = 0
        expected = 1.0
        while k < limit:
            expected *= rate
            if expected < self.step_cost.token_share(num_tokens + k + 1):
                break
            k += 1
        return k
