"""Metering: the worker's whole wall time, split into startup, idle and per-request step time.

The timeline is a chain of intervals with no gaps: ``startup`` (process start to the engine
being ready), then alternately idle spans (the engine had nothing to run) and steps. A step's
interval runs from the end of the previous interval to the end of the step, so scheduling,
ingest and sink work done between steps is billed with the step it served. Each step's seconds
are split over the requests in it by a work model:

    work(request) = tokens * linear_flops_per_token + tokens * context_len * attn_flops_per_pair
                    + (lm_head_flops if the request sampled a token this step)

where ``linear_flops_per_token = 2 * (non-embedding parameters)`` and
``attn_flops_per_pair = 4 * num_layers * num_heads * head_dim`` (q.k and p.v). So the
``device_s`` of every row a worker writes adds up to its uptime, and ``cost_usd`` to uptime times
the price.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMeter:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_s: float = 0.0
    kv_block_s: float = 0.0

    @property
    def device_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(slots=True)
class WorkModel:
    linear_flops_per_token: float
    attn_flops_per_pair: float
    lm_head_flops: float

    @classmethod
    def for_model(cls, *, num_params: int, vocab_size: int, hidden_size: int, num_layers: int,
                  num_heads: int, head_dim: int, tied: bool = False) -> "WorkModel":
        embedding = vocab_size * hidden_size * (1 if tied else 2)
        non_embedding = max(num_params - embedding, 1)
        return cls(
            linear_flops_per_token=2.0 * non_embedding,
            attn_flops_per_pair=4.0 * num_layers * num_heads * head_dim,
            lm_head_flops=2.0 * vocab_size * hidden_size,
        )

    def work(self, num_tokens: int, context_len: int, sampled: bool) -> float:
        # Causal attention over a chunk: token i of the chunk sees (context_len - n + i + 1) keys.
        pairs = num_tokens * context_len - num_tokens * (num_tokens - 1) / 2
        return (
            num_tokens * self.linear_flops_per_token
            + pairs * self.attn_flops_per_pair
            + (self.lm_head_flops if sampled else 0.0)
        )


@dataclass
class Meter:
    """Accumulates per-request device time and the worker's idle and startup time."""

    work_model: WorkModel
    start: float
    mark: float = field(init=False)
    idle_s: float = 0.0
    requests: dict[str, RequestMeter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mark = self.start

    def startup_done(self, now: float) -> float:
        """Close the startup interval; returns its length."""
        startup = now - self.mark
        self.mark = now
        return startup

    def idle_until(self, now: float) -> None:
        """The engine had nothing to run from the last mark until ``now``."""
        if now > self.mark:
            self.idle_s += now - self.mark
            self.mark = now

    def take_idle(self) -> float:
        idle, self.idle_s = self.idle_s, 0.0
        return idle

    def step(self, end: float, work: list, blocks_held: dict[str, float]) -> None:
        """Bill the interval (mark, end] to the requests in ``work`` (``StepWork`` records).

        ``blocks_held`` maps a request id to the KV blocks it holds (shared blocks already
        divided among their holders).
        """
        span = max(end - self.mark, 0.0)
        self.mark = max(end, self.mark)
        if not work:
            self.idle_s += span
            return
        weights = [self.work_model.work(w.num_tokens, w.context_len, w.sampled) for w in work]
        total = sum(weights) or 1.0
        for w, weight in zip(work, weights):
            share = span * weight / total
            m = self.requests.get(w.request_id)
            if m is None:
                m = self.requests[w.request_id] = RequestMeter()
            if w.is_prefill:
                m.prefill_s += share
                if w.num_recomputed_tokens and w.num_tokens:
                    m.recomputed_s += share * min(w.num_recomputed_tokens, w.num_tokens) / w.num_tokens
            else:
                m.decode_s += share
            m.kv_block_s += blocks_held.get(w.request_id, 0.0) * span

    def pop(self, request_id: str) -> RequestMeter:
        return self.requests.pop(request_id, None) or RequestMeter()
