"""Latency targets on the worker's side: which targets a request has, and whether its row met them.

A request's targets are its own ``slo_ttft_ms`` and ``slo_tpot_ms`` when it sets either, else its
tenant's ``--tenant-slos`` default, else none (a bulk request). The engine schedules with them
(scheduler/slo.py); the result row says in ``slo_met`` whether every target the request had was
met, measured as its producer sees it:

* time to first token: ``first_token_at - enqueued_at`` (the entry's time in the stream included);
* time per output token: ``(finished_at - first_token_at) / (output_tokens - 1)``, the mean gap
  between its tokens (met by a request with one token or none after the first).

``slo_met`` is null for a request without targets, and for a row of a request that never ran (an
error row: nothing was served to measure).
"""

from __future__ import annotations

from collections.abc import Mapping

from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import ResultRow

Targets = tuple[int | None, int | None]
NO_TARGETS: Targets = (None, None)


class LatencyTargets:
    """The targets of each request, from its fields or its tenant's default."""

    def __init__(self, tenant_slos: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.tenant_slos = dict(tenant_slos or {})

    def of(self, request: Request) -> Targets:
        """(TTFT ms, TPOT ms) of ``request``; (None, None) for a bulk request."""
        if request.slo_ttft_ms is not None or request.slo_tpot_ms is not None:
            return request.slo_ttft_ms, request.slo_tpot_ms
        return self.tenant_slos.get(request.tenant, NO_TARGETS)


def missed_targets(targets: Targets, row: ResultRow) -> tuple[str, ...] | None:
    """The kinds of target (``ttft``, ``tpot``) that ``row`` missed; None when it has no targets or
    never ran (module docstring)."""
    ttft_ms, tpot_ms = targets
    if (ttft_ms is None and tpot_ms is None) or (row.finish_reason == "error" and row.started_at is None):
        return None
    missed = []
    first = row.first_token_at
    if ttft_ms is not None and (first is None or row.enqueued_at is None
                                or first - row.enqueued_at > ttft_ms / 1000.0):
        missed.append("ttft")
    if tpot_ms is not None and first is not None and row.output_tokens > 1:
        if (row.finished_at - first) / (row.output_tokens - 1) > tpot_ms / 1000.0:
            missed.append("tpot")
    return tuple(missed)
