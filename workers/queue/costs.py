"""Metering: the worker's whole wall time, split into startup, idle and per-request step time.

**The timeline.** A worker's wall time is one chain of intervals with no gaps and no overlaps,
held together by a single ``mark`` (the end of the last interval billed):

* ``startup``: from the process's start (:func:`process_start_time`; interpreter and imports
  included) to the engine being ready (model load, KV cache allocation, warm-up);
* then alternately *idle* spans (the engine had nothing to run; the worker waited on the
  stream or on the batcher's max wait) and *steps*.

A step's interval runs from the end of the previous interval to the end of the step, so the
scheduling, ingest and sink work done between two steps is billed with the step it served.
The step's end is read after the step has synchronised with the device (the sampled tokens are
copied to the host), so on a GPU the interval ends when the device work is really done, and on
the CPU it is the synchronous step itself.

**The work model.** A step's seconds are split over the requests scheduled in it, in
proportion to an estimate of the floating-point work each caused::

    work = n * linear_flops_per_token                      # every linear layer, per token
         + pairs(n, context_len) * attn_flops_per_pair     # q.k and p.v over the context
         + lm_head_flops * rows  (rows: 1 if the request sampled a token this step, 1 + s
                                  with s proposed tokens checked, else 0)

with ``n`` the request's tokens in the step, ``pairs`` the causal (query, key) pairs of a chunk
of ``n`` tokens ending at ``context_len``, ``linear_flops_per_token = 2 * non-embedding
parameters``, ``attn_flops_per_pair = 4 * layers * heads * head_dim``, and ``lm_head_flops =
2 * vocab * hidden``. Two requests of the same shape in the same steps therefore get the same
share, a long prompt's prefill costs more than a decode token, and a long context costs more
per decode token than a short one.

**Per request** (the columns of a ``request`` cost row):

* ``prefill_s``: its share of the steps in which it ran prompt tokens (or recomputed ones), plus
  the seconds spent copying its prompt's prefix up from the KV tiers (docs/kv-tiers.md), which are
  its alone and are taken out of the step before the rest is shared;
* ``decode_s``: its share of the steps in which it generated one token (or checked proposed
  tokens: speculative decoding's rejected tokens are billed here, and counted in the row's
  ``rejected_tokens``);
* ``device_s = prefill_s + decode_s``;
* ``recomputed_s``: the part of ``prefill_s`` spent recomputing KV lost to a preemption (the
  chunk's share, times the fraction of the chunk's tokens computed before);
* ``kv_block_s``: KV blocks held times seconds, integrated over the steps it ran in (the
  blocks it holds at the end of each step; in its last step, when they are already freed, those
  of the step before). A block shared by ``k`` requests (a prefix-cache hit) counts ``1/k`` to
  each holder, so a shared prefix is not counted twice.
* ``cost_usd = device_s * price_per_device_hour / 3600``.

**The device share.** The price is per device-hour, and a worker bills its share of a priced
device: every interval it bills (startup, idle, steps) counts ``device_share`` times its wall
seconds, and every row it writes carries that ``device_share``. On CUDA a worker holds one device
per rank (a share of T, or T x P with P pipeline stages); on a CPU the machine is one device and a worker holds
its threads (all its ranks' threads) over the machine's usable cores, at most all of it (two
one-thread workers on a 2-core machine bill half of it each); ``--device-share`` sets it.

Work that no result row will carry (a request handed back on shutdown, or dropped because
another worker took its entry over) is written as a ``duplicate`` row: work done twice is
billed once. So the ``device_s`` of every row a worker writes adds up to its uptime (from the
start of its ``startup`` row to the ``finished_at`` of its last row) times its ``device_share``,
and ``cost_usd`` to that times the price. A worker killed outright loses what it had not written
yet; the worker that finds it dead writes that time as a ``lost`` row under its name
(:mod:`.uptime`), so that its rows add up to its uptime up to its last heartbeat again (less,
never more).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mqinfer.schemas.rows import CostRow

# Time constant of the batch idle ratio (an exponentially weighted share of recent time).
IDLE_RATIO_TAU_S = 60.0


class _Work(Protocol):
    """What the meter reads from an engine ``StepWork`` record."""

    request_id: str
    num_tokens: int
    context_len: int
    is_prefill: bool
    num_recomputed_tokens: int
    sampled: bool
    num_spec_tokens: int


@dataclass(slots=True)
class RequestMeter:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_s: float = 0.0
    kv_block_s: float = 0.0
    # The request's KV block share at its last step (used for the step in which it finishes,
    # when its blocks are already back in the pool).
    last_blocks: float = 0.0

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

    def work(self, num_tokens: int, context_len: int, sampled: bool | int) -> float:
        """Estimated flops of a chunk; ``sampled``: LM head rows run for it (a bool counts 0 or 1)."""
        # Causal attention over a chunk: token i of the chunk sees (context_len - n + i + 1) keys.
        pairs = num_tokens * context_len - num_tokens * (num_tokens - 1) / 2
        return (
            num_tokens * self.linear_flops_per_token
            + pairs * self.attn_flops_per_pair
            + self.lm_head_flops * int(sampled)
        )


def kv_block_shares(holder, request_ids: Iterable[str]) -> dict[str, float]:
    """KV blocks each request holds now, a block held by ``k`` requests counting ``1/k``.

    Reads ``holder.owned_blocks`` (the engine's, the scheduler's or the KV cache manager's) and
    each block's reference count; changes nothing. A request that holds no blocks (finished and
    freed) maps to 0.
    """
    shares: dict[str, float] = {}
    for rid in request_ids:
        blocks = holder.owned_blocks(rid)
        total = float(len(blocks))
        for block in blocks:
            if block.ref_cnt > 1:  # shared prefix blocks are few; the rest count 1 each
                total -= 1.0 - 1.0 / block.ref_cnt
        shares[rid] = total
    return shares


@dataclass
class Meter:
    """Accumulates per-request device time and the worker's idle and startup time.

    ``idle_s`` is the idle time not yet written as a row (see :meth:`take_idle`);
    ``idle_total_s``, ``busy_total_s`` and ``startup_s`` are running totals for metrics.
    """

    work_model: WorkModel
    start: float
    # Tokens per KV block: estimates blocks held in a request's last step, when they are freed.
    block_size: int = 16
    # The share of a priced device the worker occupies (see the module docstring): billed seconds
    # are wall seconds times this.
    device_share: float = 1.0
    mark: float = field(init=False)
    idle_s: float = 0.0
    startup_s: float = 0.0
    idle_total_s: float = 0.0
    busy_total_s: float = 0.0
    # Exponentially weighted share of recent time spent idle (time constant IDLE_RATIO_TAU_S).
    idle_ratio: float = 0.0
    requests: dict[str, RequestMeter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not (self.device_share > 0 and math.isfinite(self.device_share)):
            raise ValueError(f"device_share must be a number > 0, got {self.device_share}")
        self.mark = self.start

    def startup_done(self, now: float) -> float:
        """Close the startup interval; returns its device seconds (its length times ``device_share``)."""
        startup = max(now - self.mark, 0.0)
        self.mark = max(now, self.mark)
        self.startup_s += startup
        return startup * self.device_share

    def idle_until(self, now: float) -> None:
        """The engine had nothing to run from the last mark until ``now``."""
        if now > self.mark:
            self._idle(now - self.mark)
            self.mark = now

    def take_idle(self) -> float:
        """Idle device seconds not yet written as a row; resets them."""
        idle, self.idle_s = self.idle_s, 0.0
        return idle

    def step(self, end: float, work: Sequence[_Work], blocks_held: dict[str, float]) -> None:
        """Bill the interval (mark, end] to the requests in ``work`` (``StepWork`` records).

        ``blocks_held`` maps a request id to the KV blocks it holds after the step, shared ones
        divided among their holders (:func:`kv_block_shares`). A request missing from it or
        holding none (it finished and its blocks were freed) is billed the blocks it held at its
        previous step, or, in its first and last step at once, the blocks its context needs.
        """
        span = max(end - self.mark, 0.0)
        self.mark = max(end, self.mark)
        if not work:
            self._idle(span)
            return
        self._ewma(span, 0.0)
        self.busy_total_s += span
        model = self.work_model
        weights = [model.work(w.num_tokens, w.context_len, (1 + w.num_spec_tokens) if w.sampled else 0)
                   for w in work]
        total = sum(weights)
        # Seconds spent copying a request's prefix up from the KV tiers are that request's own; the
        # rest of the step is shared by work (scaled down should they exceed the step, never more).
        loads = [getattr(w, "tier_load_s", 0.0) for w in work]
        fixed = sum(loads)
        taken = min(fixed, span)
        own = self.device_share * taken / fixed if fixed > 0 else 0.0
        billed = (span - taken) * self.device_share
        for w, weight, load in zip(work, weights, loads):
            share = billed * weight / total if total > 0 else billed / len(work)
            share += load * own
            m = self.requests.get(w.request_id)
            if m is None:
                m = self.requests[w.request_id] = RequestMeter()
            if w.is_prefill:
                m.prefill_s += share
                if w.num_recomputed_tokens and w.num_tokens:
                    m.recomputed_s += share * min(w.num_recomputed_tokens, w.num_tokens) / w.num_tokens
            else:
                m.decode_s += share
            held = blocks_held.get(w.request_id, 0.0)
            if held <= 0.0:
                held = m.last_blocks or float(math.ceil(w.context_len / self.block_size))
            m.last_blocks = held
            m.kv_block_s += held * span

    def pop(self, request_id: str) -> RequestMeter:
        """The request's totals, forgotten here (call once, when its row is written)."""
        return self.requests.pop(request_id, None) or RequestMeter()

    def _idle(self, seconds: float) -> None:
        self.idle_s += seconds * self.device_share
        self.idle_total_s += seconds
        self._ewma(seconds, 1.0)

    def _ewma(self, seconds: float, value: float) -> None:
        # Exact for a piecewise-constant signal: an interval of length t pulls the average
        # towards its value by 1 - exp(-t / tau).
        if seconds > 0:
            keep = math.exp(-seconds / IDLE_RATIO_TAU_S)
            self.idle_ratio = self.idle_ratio * keep + value * (1.0 - keep)


def process_start_time() -> float | None:
    """Unix time at which this process started (Linux, ~10 ms precision), or None elsewhere.

    The worker's startup interval begins here rather than when its code starts running, so
    that the interpreter and library imports (seconds, for torch) count as startup too.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
        # Field 22 (starttime, in clock ticks since boot) counts from after the ")" closing the
        # command name, which may itself hold spaces.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(age_s, 0.0)


def wasted_work_row(meter: RequestMeter, *, job_id: str | None, request_id: str, tenant: str, model: str,
                    request_type: str, prompt_tokens: int, worker: str, price_per_device_hour: float,
                    finished_at: float, device_share: float, metadata: dict[str, str] | None = None,
                    model_variant: str | None = None) -> CostRow:
    """A ``duplicate`` row for work whose result this worker will not write (handed back, or
    taken over by another worker): it keeps the worker's rows adding up to its uptime and bills
    nobody."""
    return CostRow(
        kind="duplicate", job_id=job_id, id=request_id, tenant=tenant, model=model, request_type=request_type,
        prompt_tokens=prompt_tokens, cached_prompt_tokens=0, output_tokens=0, queue_s=0.0,
        prefill_s=meter.prefill_s, decode_s=meter.decode_s, device_s=meter.device_s,
        recomputed_s=meter.recomputed_s, kv_block_s=meter.kv_block_s,
        cost_usd=meter.device_s * price_per_device_hour / 3600.0, price_per_device_hour=price_per_device_hour,
        worker=worker, finished_at=finished_at, device_share=device_share, metadata=dict(metadata or {}),
        model_variant=model_variant,
    )


def lost_row(worker: str, model: str, price_per_device_hour: float, device_s: float, finished_at: float, *,
             device_share: float) -> CostRow:
    """A ``lost`` row: device time a dead worker used and never wrote, billed to nobody, under its name.
    Every argument comes from the dead worker's record, so two claimers build identical rows."""
    return CostRow(
        kind="lost", job_id=None, id=None, tenant=None, model=model or None, request_type=None, prompt_tokens=0,
        cached_prompt_tokens=0, output_tokens=0, queue_s=0.0, prefill_s=0.0, decode_s=0.0, device_s=device_s,
        recomputed_s=0.0, kv_block_s=0.0, cost_usd=device_s * price_per_device_hour / 3600.0,
        price_per_device_hour=price_per_device_hour, worker=worker, finished_at=finished_at,
        device_share=device_share,
    )


__all__ = [
    "IDLE_RATIO_TAU_S", "Meter", "RequestMeter", "WorkModel", "kv_block_shares", "process_start_time",
    "lost_row", "wasted_work_row",
]
