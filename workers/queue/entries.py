"""Stream entries as a worker holds them: :class:`InFlight` (an entry owned from decode to ack)
and what an entry id says (when the server added it, and the ids' order)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas.request import Request


@dataclass(slots=True)
class InFlight:
    """A stream entry this worker owns, from decode to ack."""

    entry_id: str
    request: Request
    attempt: int
    enqueued_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    # A request with n > 1 choices: the choices that finished, waiting for the rest (their rows are
    # written together), by index: (the choice's final engine output, its RequestMeter).
    choices: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return self.sampling.n if self.sampling is not None else 1


def entry_time(entry_id: str) -> float:
    """Unix seconds at which the server added the entry (its id's millisecond part; a lane's
    qualified id ``<id>@<lane>`` works too)."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


def entry_order(entry_id: str) -> tuple[int, int]:
    """A sort key that orders entry ids as the stream does (``10-0`` after ``9-5``)."""
    ms, _, seq = entry_id.partition("@")[0].partition("-")
    return int(ms), int(seq or 0)


def text(value) -> str:
    """A Redis reply (bytes or str) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
