"""What the producer client's sans-IO core asks its drivers to do: actions, plain data.

A plan of :class:`mqinfer.client_core.ClientCore` yields these one at a time and gets back the
result of each (what redis-py returns for it), or has the error it raised thrown into it. Every
driver performs every action; none of them decides anything about the result.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

@dataclass(frozen=True, slots=True)
class CreateGroup:
    """``XGROUP CREATE stream_key group 0 MKSTREAM``; result ignored (a BUSYGROUP error is fine)."""

    stream_key: str
    group: str


@dataclass(frozen=True, slots=True)
class AddEntries:
    """``XADD stream_key * fields`` for each entry, in one pipeline; result ignored."""

    stream_key: str
    entries: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class RegisterLane:
    """Run ``mqinfer.schemas.lanes.REGISTER_SCRIPT`` with KEYS ``[registry, version_key]`` and ARGV
    ``[lane, now, max_lanes, shared, reserved, WAKE_AFTER_S]``; result: ``[lane used, 1 when a notice
    is due]``."""

    registry: str
    version_key: str
    lane: str
    max_lanes: int
    shared: str
    reserved: int


@dataclass(frozen=True, slots=True)
class ReadBacklog:
    """``XINFO GROUPS stream_key`` and ``XLEN stream_key`` in one pipeline; result: both replies."""

    stream_key: str


@dataclass(frozen=True, slots=True)
class ReadReplies:
    """``XREAD COUNT count [BLOCK block_ms] STREAMS ...cursors``; result: the reply as redis-py
    gives it (None, or a list of (stream, [(id, fields), ...]))."""

    cursors: dict[str, str]
    count: int
    block_ms: int | None


@dataclass(frozen=True, slots=True)
class AddCancel:
    """Run ``CANCEL_SCRIPT`` with KEYS ``[key]`` and ARGV ``[member, ttl_s]``; result ignored."""

    key: str
    member: bytes
    ttl_s: int


@dataclass(frozen=True, slots=True)
class DeleteStream:
    """``DEL key``; result ignored."""

    key: str


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class TakeReadTurn:
    """Wait up to ``timeout_s`` (None: forever) for the read turn; result: True once held, False
    on timeout. Whoever holds it is the only one reading the reply streams."""

    timeout_s: float | None


@dataclass(frozen=True, slots=True)
class EndReadTurn:
    """Hand the read turn back. A driver also hands it back when a plan ends holding it."""


Action = CreateGroup | AddEntries | RegisterLane | ReadBacklog | ReadReplies | AddCancel | DeleteStream | Sleep | \
    TakeReadTurn | EndReadTurn
Plan = Generator[Action, Any, T]
