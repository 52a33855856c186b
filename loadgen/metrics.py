"""Benchmark arithmetic: per-request timings in, throughput and latency percentiles out.

Owns ``RequestTiming`` (one request's token counts and timestamps, whichever system ran it),
``summarize`` and the rules every system is measured by, so that our engine and the Hugging Face
baselines are compared on the same terms:

- throughput = tokens the requests asked for (never more than each asked for, padding and
  overshoot do not count) / (last finished - first started);
- time to first token (TTFT) = first token - enqueued; end-to-end (e2e) = finished - enqueued;
- time per output token (TPOT) = (finished - first token) / (output tokens - 1), for requests
  with at least two tokens;
- percentiles interpolate linearly between order statistics (numpy's default).

Error rows count as errors, not as tokens or latencies. ``timings_from_results`` reads the rows
of a results dataset (a ``pyarrow.Table``) written by the workers.

``ttft_budget`` is the online latency goal: p99 TTFT at most the batcher's wait plus three
engine steps (roughly: the batcher's threshold, the step already running when the request
arrives, its own prefill step, and one more for a prefill split over two steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTiming:
    id: str
    prompt_tokens: int
    requested_tokens: int  # max_tokens of the request
    output_tokens: int  # what the system produced for it
    enqueued_at: float  # unix seconds
    started_at: float
    first_token_at: float | None
    finished_at: float
    ok: bool = True

    @property
    def counted_tokens(self) -> int:
        return min(self.output_tokens, self.requested_tokens) if self.ok else 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.enqueued_at

    @property
    def e2e(self) -> float:
        return self.finished_at - self.enqueued_at

    @property
    def tpot(self) -> float | None:
        if self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float
    max: float
    count: int


@dataclass(frozen=True)
class RunSummary:
    num_requests: int
    num_errors: int
    requested_tokens: int  # counted tokens of the ok requests
    span_s: float  # first started -> last finished
    throughput: float  # requested tokens / span
    ttft: Percentiles | None
    tpot: Percentiles | None
    e2e: Percentiles | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TtftBudget:
    """The online latency goal for one run: ``ttft_p99_s <= max_wait_s + steps * step_s``."""

    ttft_p99_s: float
    max_wait_s: float  # the batcher's wait threshold (for an adaptive wait, its upper bound)
    step_s: float  # one engine step, as measured in the same run
    steps: int
    budget_s: float
    met: bool


def ttft_budget(ttft_p99_s: float, max_wait_s: float, step_s: float, steps: int = 3) -> TtftBudget:
    """Whether a p99 TTFT is within ``max_wait_s + steps * step_s`` (all in seconds)."""
    for name, value in (("ttft_p99_s", ttft_p99_s), ("max_wait_s", max_wait_s), ("step_s", step_s)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    budget = max_wait_s + steps * step_s
    return TtftBudget(ttft_p99_s, max_wait_s, step_s, steps, budget, ttft_p99_s <= budget)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def percentiles(values: Iterable[float | None]) -> Percentiles | None:
    """p50/p90/p99, mean and max of the values that are not None; None when there are none."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    return Percentiles(p50=percentile(data, 50), p90=percentile(data, 90), p99=percentile(data, 99),
                       mean=sum(data) / len(data), max=data[-1], count=len(data))


def summarize(timings: Sequence[RequestTiming]) -> RunSummary:
    ok = [t for t in timings if t.ok]
    errors = len(timings) - len(ok)
    if not ok:
        return RunSummary(len(timings), errors, 0, 0.0, 0.0, None, None, None)
    span = max(t.finished_at for t in ok) - min(t.started_at for t in ok)
    tokens = sum(t.counted_tokens for t in ok)
    return RunSummary(
        num_requests=len(timings),
        num_errors=errors,
        requested_tokens=tokens,
        span_s=span,
        throughput=tokens / span if span > 0 else 0.0,
        ttft=percentiles(t.ttft for t in ok),
        tpot=percentiles(t.tpot for t in ok),
        e2e=percentiles(t.e2e for t in ok),
    )


def _seconds(value: Any) -> float | None:
    """Unix seconds from a row value: datetime (pyarrow timestamps), number, or None."""
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return float(value)


def timings_from_rows(rows: Iterable[Mapping[str, Any]], requested: Mapping[str, int]) -> list[RequestTiming]:
    """Timings of result rows (dicts with the results dataset's columns) for the requests in
    ``requested`` (id -> max_tokens); rows of other ids are ignored."""
    out = []
    for row in rows:
        rid = row["id"]
        if rid not in requested:
            continue
        ok = row.get("finish_reason") not in ("error", "expired", "cancelled")
        finished = _seconds(row.get("finished_at"))
        enqueued = _seconds(row.get("enqueued_at"))
        started = _seconds(row.get("started_at"))
        if finished is None:
            raise ValueError(f"result row {rid!r} has no finished_at")
        if enqueued is None:
            enqueued = started if started is not None else finished
        if started is None:
            started = enqueued
        out.append(RequestTiming(
            id=rid,
            prompt_tokens=int(row.get("prompt_tokens") or 0),
            requested_tokens=int(requested[rid]),
            output_tokens=int(row.get("output_tokens") or 0),
            enqueued_at=enqueued,
            started_at=started,
            first_token_at=_seconds(row.get("first_token_at")),
            finished_at=finished,
            ok=ok,
        ))
    return out


def timings_from_results(table, requested: Mapping[str, int]) -> list[RequestTiming]:
    """``timings_from_rows`` over a ``pyarrow.Table`` of the results dataset."""
    columns = [c for c in ("id", "finish_reason", "prompt_tokens", "output_tokens", "enqueued_at", "started_at",
                           "first_token_at", "finished_at") if c in table.column_names]
    return timings_from_rows(table.select(columns).to_pylist(), requested)


@dataclass(frozen=True)
class Agreement:
    """How far two systems' greedy outputs agree, over the requests both produced."""

    compared: int
    first_token: float  # share of requests whose first generated token is the same
    identical: float  # share of requests whose whole output is the same
    common_prefix: float  # mean share of each output before the first difference


def token_agreement(a: Mapping[str, Sequence[int]], b: Mapping[str, Sequence[int]]) -> Agreement | None:
    """Compare generated token ids per request id; None when no id is in both with tokens.

    Greedy decoding in bf16 on two implementations may pick different tokens where two logits
    are nearly tied (random-weight models have many such ties), so low agreement after the first
    few tokens is not by itself a bug; a first token that rarely agrees is.
    """
    firsts = identical = 0
    prefix_share = 0.0
    compared = 0
    for rid, x in a.items():
        y = b.get(rid)
        if y is None or not x or not y:
            continue
        compared += 1
        firsts += x[0] == y[0]
        identical += list(x) == list(y)
        n = min(len(x), len(y))
        same = next((i for i in range(n) if x[i] != y[i]), n)
        prefix_share += same / max(len(x), len(y))
    if not compared:
        return None
    return Agreement(compared, firsts / compared, identical / compared, prefix_share / compared)
