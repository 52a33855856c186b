"""Billing: every result row and cost row a worker writes is built here.

A request that ran gets a result row and a ``request`` cost row from its meter, one of each per
choice of a request with ``n`` > 1 choices (each choice's own meter: the first choice computed the
prompt and carries its prefill, the others only the prompt's last partial block they computed
themselves, having taken the rest from the prefix cache); a request that ends without running
(invalid, refused, cancelled before it started, lost) gets an error row and a zero ``request`` cost
row; the worker's own time goes to ``startup`` and ``idle`` rows; device
time that no row of this worker will carry (a request handed back, or taken over by another
worker) becomes a ``duplicate`` row, which bills nobody. So a worker's rows add up to its uptime
(see :mod:`mqinfer.workers.queue.costs`); the ``lost`` row of a worker killed before it wrote its rows is
written by the worker that finds it dead (:mod:`mqinfer.workers.queue.uptime`). A copy of a request answered on its reply stream without
computing it gets a ``duplicate_id`` error row that is sent, never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from mqinfer.schemas import errors
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import CostRow, ResultRow, error_result_row
from mqinfer.workers.queue.costs import RequestMeter, wasted_work_row
from mqinfer.workers.queue.entries import InFlight, entry_time
from mqinfer.workers.queue.slo import LatencyTargets, missed_targets


def tier_columns(tier_cached_tokens: dict[str, int] | None) -> dict[str, int]:
    """A request row's prefix tokens served by each KV tier below the device cache."""
    tiers = tier_cached_tokens or {}
    return {f"{tier}_cached_tokens": tiers.get(tier, 0) for tier in ("host", "disk", "shared")}


class Billing:
    """Builds rows for one worker: its name, its price, and its model and device share (known once
    the engine is up)."""

    def __init__(self, worker: str, price_per_device_hour: float, *, clock: Callable[[], float] = time.time,
                 model: str | None = None, device_share: float = 1.0,
                 targets: LatencyTargets | None = None) -> None:
        self.worker = worker
        self.price = price_per_device_hour
        self.clock = clock
        self.model = model
        # The share of a priced device this worker holds (workers/queue/costs.py): every row says it.
        self.device_share = device_share
        # Each request's latency targets, for its row's slo_met.
        self.targets = targets or LatencyTargets()
        # How the worker runs the model (schemas/rows.model_variant): every cost row says it.
        self.model_variant: str | None = None

    def _usd(self, device_s: float) -> float:
        return device_s * self.price / 3600.0

    def request(self, item: InFlight, out, meter: RequestMeter, now: float) -> tuple[ResultRow, CostRow]:
        """The rows of a request (or of one of its choices) the engine finished (``out``: its final
        ``RequestOutput``)."""
        req = item.request
        output_tokens = len(out.output_token_ids)
        row = ResultRow(
            job_id=req.job_id, id=req.id, tenant=req.tenant, model=self.model, request_type=req.request_type,
            finish_reason=out.finish_reason, error_code=out.error_code, error=out.error,
            prompt_tokens=out.num_prompt_tokens, output_tokens=output_tokens,
            output_token_ids=list(out.output_token_ids), text=out.text, logprobs=out.logprobs,
            enqueued_at=item.enqueued_at, started_at=item.started_at, first_token_at=item.first_token_at,
            finished_at=now, worker=self.worker, attempt=item.attempt, metadata=dict(req.metadata),
            schema_valid=out.schema_valid, index=out.index,
        )
        missed = missed_targets(self.targets.of(req), row)
        if missed is not None:
            row.slo_met = not missed
        cost = CostRow(
            kind="request", job_id=req.job_id, id=req.id, tenant=req.tenant, model=self.model,
            request_type=req.request_type, prompt_tokens=out.num_prompt_tokens,
            cached_prompt_tokens=max(0, out.num_cached_tokens), output_tokens=output_tokens,
            queue_s=max(0.0, (item.started_at or now) - item.enqueued_at), prefill_s=meter.prefill_s,
            decode_s=meter.decode_s, device_s=meter.device_s, recomputed_s=meter.recomputed_s,
            kv_block_s=meter.kv_block_s, cost_usd=self._usd(meter.device_s),
            price_per_device_hour=self.price, worker=self.worker, finished_at=now,
            rejected_tokens=out.num_rejected_tokens, device_share=self.device_share, index=out.index,
            metadata=row.metadata, model_variant=self.model_variant, **tier_columns(out.tier_cached_tokens),
        )
        return row, cost

    def error(self, request_id: str, job_id: str | None, code: str | None, message: str | None, *, attempt: int,
              enqueued_at: float, request: Request | None = None,
              finish_reason: str = "error") -> tuple[ResultRow, CostRow]:
        """The rows of a request that ends without running: invalid, refused, cancelled, lost. One
        row (index 0) whatever its ``n``: no choice of it ran.

        ``request`` gives the labels (tenant, request type, metadata) when the entry decoded."""
        now = self.clock()
        row = error_result_row(
            request_id, job_id, code, message,
            tenant=request.tenant if request else "default", model=self.model,
            request_type=request.request_type if request else "default",
            worker=self.worker, attempt=attempt, enqueued_at=enqueued_at, finished_at=now,
            metadata=dict(request.metadata) if request else {},
        )
        if finish_reason != "error":
            row = msgspec.structs.replace(row, finish_reason=finish_reason)
        cost = CostRow(
            kind="request", job_id=job_id, id=request_id, tenant=row.tenant, model=self.model,
            request_type=row.request_type, prompt_tokens=0, cached_prompt_tokens=0, output_tokens=0,
            queue_s=max(0.0, now - enqueued_at), prefill_s=0.0, decode_s=0.0, device_s=0.0, recomputed_s=0.0,
            kv_block_s=0.0, cost_usd=0.0, price_per_device_hour=self.price, worker=self.worker, finished_at=now,
            device_share=self.device_share, index=0, metadata=row.metadata, model_variant=self.model_variant,
        )
        return row, cost

    def overhead(self, kind: str, seconds: float, now: float) -> CostRow:
        """A ``startup`` or ``idle`` row: the worker's time that no request used."""
        return CostRow(
            kind=kind, job_id=None, id=None, tenant=None, model=self.model, request_type=None, prompt_tokens=0,
            cached_prompt_tokens=0, output_tokens=0, queue_s=0.0, prefill_s=0.0, decode_s=0.0, device_s=seconds,
            recomputed_s=0.0, kv_block_s=0.0, cost_usd=self._usd(seconds), price_per_device_hour=self.price,
            worker=self.worker, finished_at=now, device_share=self.device_share, model_variant=self.model_variant,
        )

    def wasted(self, item: InFlight, meter: RequestMeter) -> CostRow | None:
        """A ``duplicate`` row for device time spent on a request whose row this worker will not
        write; None when it spent none."""
        if meter.device_s <= 0:
            return None
        req = item.request
        return wasted_work_row(
            meter, job_id=req.job_id, request_id=req.id, tenant=req.tenant, model=self.model,
            request_type=req.request_type, prompt_tokens=len(item.prompt_token_ids), worker=self.worker,
            price_per_device_hour=self.price, finished_at=self.clock(), device_share=self.device_share,
            metadata=req.metadata, model_variant=self.model_variant,
        )

    def duplicate_answer(self, entry_id: str, request: Request, message: str) -> ResultRow:
        """A ``duplicate_id`` error row that only answers on a reply stream: the dataset keeps the
        row of the request's first copy."""
        return error_result_row(
            request.id, request.job_id, errors.DUPLICATE_ID, message, tenant=request.tenant, model=self.model,
            request_type=request.request_type, worker=self.worker, attempt=1, enqueued_at=entry_time(entry_id),
            finished_at=self.clock(), metadata=dict(request.metadata),
        )


def finished_fields(item: InFlight, out, row: ResultRow, cost: CostRow, meter: RequestMeter) -> dict:
    """The fields of a finished request's log line (``finished {...}``; one per choice, with ``index``,
    for a request with n > 1 choices)."""
    req = item.request
    now = row.finished_at
    fields = {
        "id": req.id, "job_id": req.job_id, "tenant": req.tenant, "request_type": req.request_type,
        "model": row.model, "worker": row.worker, "attempt": item.attempt,
        "finish_reason": out.finish_reason, "error_code": out.error_code,
        "prompt_tokens": out.num_prompt_tokens, "cached_prompt_tokens": cost.cached_prompt_tokens,
        "output_tokens": row.output_tokens, "preemptions": out.num_preemptions,
        "queue_s": round(cost.queue_s, 6),
        "ttft_s": round(item.first_token_at - item.enqueued_at, 6) if item.first_token_at else None,
        "e2e_s": round(now - item.enqueued_at, 6), "device_s": round(meter.device_s, 6),
        "recomputed_s": round(meter.recomputed_s, 6), "cost_usd": cost.cost_usd,
        "rejected_tokens": cost.rejected_tokens,
    }
    if out.tier_cached_tokens:
        fields["tier_cached_tokens"] = dict(out.tier_cached_tokens)
    if item.num_choices > 1:
        fields["index"] = out.index
    return fields
