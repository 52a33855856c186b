"""`mqinfer lanes`: the plain stream and every lane of a stream, with their backlogs.

One row per stream: the lane's name (``plain`` for the plain stream), its entries (unread or
pending), how many no worker has read yet, how many are pending (read, not yet acknowledged),
the age of the oldest unread entry, and how long ago a producer last wrote to the lane (from the
registry; the plain stream has no such record).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis

from mqinfer.schemas import keys
from mqinfer.schemas import lanes as scheme


@dataclass(frozen=True, slots=True)
class LaneStatus:
    lane: str
    key: str
    length: int
    unread: int
    pending: int
    oldest_unread_s: float
    last_used_s: float | None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def lane_statuses(client, stream: str, group: str = keys.GROUP, now: float | None = None) -> list[LaneStatus]:
    """The plain stream first, then the registered lanes by name."""
    now = time.time() if now is None else now
    used = {_text(m): float(s) for m, s in client.zrange(scheme.registry_key(stream), 0, -1, withscores=True)}
    names: list[str | None] = [None] + sorted(n for n in used if scheme.valid_lane(n))
    out = []
    for name in names:
        key = keys.request_stream(scheme.lane_stream(stream, name))
        try:
            length = int(client.xlen(key))
            groups = client.xinfo_groups(key)
        except redis.exceptions.ResponseError:
            groups = []
            length = 0
        info = next((g for g in groups if _text(g.get("name")) == group), None)
        pending = int(info.get("pending") or 0) if info else 0
        lag = info.get("lag") if info else None
        unread = int(lag) if lag is not None else max(0, length - pending)
        oldest = 0.0
        if info and unread:
            last = _text(info.get("last-delivered-id") or "0-0")
            first = client.xrange(key, min="(" + last, max="+", count=1)
            if first:
                oldest = max(0.0, now - int(_text(first[0][0]).split("-", 1)[0]) / 1000.0)
        last_used = round(max(0.0, now - used[name]), 1) if name is not None else None
        out.append(LaneStatus("plain" if name is None else name, key, length, unread, pending, round(oldest, 3),
                              last_used))
    return out


def format_lanes(statuses: list[LaneStatus], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps([asdict(s) for s in statuses], indent=2)
    header = ("lane", "length", "unread", "pending", "oldest_unread_s", "last_used_s_ago")
    rows = [(s.lane, str(s.length), str(s.unread), str(s.pending), f"{s.oldest_unread_s:.1f}",
             "-" if s.last_used_s is None else f"{s.last_used_s:.0f}") for s in statuses]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    total = sum(s.length for s in statuses)
    n = len(statuses) - 1
    lines.append(f"{n} lane{'' if n == 1 else 's'} and the plain stream; {total} entries, "
                 f"{sum(s.unread for s in statuses)} unread, {sum(s.pending for s in statuses)} pending")
    return "\n".join(lines)
