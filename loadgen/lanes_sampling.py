"""The lanes benchmark's weights scenario, measured (``loadgen/lanes_bench.py``, whose docstring says
what it shows): a thread samples every stream's unread entries while two tenants' requests wait, and
the figures of the window in which both still had entries unread: what each tenant was delivered,
started and generated in it, against its weight.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mqinfer.loadgen.metrics import RequestTiming

# How often the weights scenario's sampler looks at the streams' unread counts.
SAMPLE_S = 0.02
# The weights scenario's two tenants.
ALPHA, BETA = "alpha", "beta"


def unread_counts(redis_client, stream_keys: list[str], group: str) -> dict[str, int]:
    """Entries of each stream not yet delivered to ``group`` (the lag, else length - pending)."""
    pipe = redis_client.pipeline(transaction=False)
    for key in stream_keys:
        pipe.xinfo_groups(key)
        pipe.xlen(key)
    replies = pipe.execute(raise_on_error=False)
    out = {}
    for n, key in enumerate(stream_keys):
        groups, length = replies[2 * n], replies[2 * n + 1]
        for reply in (groups, length):
            if isinstance(reply, Exception):
                raise RuntimeError(f"reading the unread count of {key}: {reply}")
        info = next((g for g in groups if _text(g["name"]) == group), None)
        if info is None:
            out[key] = int(length)
            continue
        lag = info.get("lag")
        out[key] = int(lag) if lag is not None else max(0, int(length) - int(info.get("pending") or 0))
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def delivered_by_tenant(order: dict[str, list[str]], unread: dict[str, int]) -> dict[str, int]:
    """Each tenant's entries delivered, given the tenants of each stream's entries in stream order
    (``order``) and each stream's unread count: a stream delivers its entries in order."""
    counts: dict[str, int] = {}
    for key, tenants in order.items():
        for tenant in tenants:
            counts.setdefault(tenant, 0)
        for tenant in tenants[: max(0, len(tenants) - unread[key])]:
            counts[tenant] += 1
    return counts


class UnreadSampler:
    """Polls the unread counts of the streams holding a run's requests, on a thread of its own,
    until every one is 0 (or ``stop``)."""

    def __init__(self, url: str, order: dict[str, list[str]], group: str, every_s: float = SAMPLE_S) -> None:
        self.url = url
        self.order = order
        self.group = group
        self.every_s = every_s
        # (unix time, entries delivered per tenant, entries unread per tenant)
        self.samples: list[tuple[float, dict[str, int], dict[str, int]]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lanes-unread-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise RuntimeError(f"the unread sampler failed: {self.error}") from self.error

    def _run(self) -> None:
        from mqinfer.schemas.connection import connect

        client = connect(self.url)
        totals: dict[str, int] = {}
        for tenants in self.order.values():
            for tenant in tenants:
                totals[tenant] = totals.get(tenant, 0) + 1
        try:
            while not self._stop.is_set():
                unread = unread_counts(client, list(self.order), self.group)
                now = time.time()
                delivered = delivered_by_tenant(self.order, unread)
                left = {t: totals[t] - delivered[t] for t in totals}
                self.samples.append((now, delivered, left))
                if not any(left.values()):
                    return
                self._stop.wait(self.every_s)
        except BaseException as exc:  # reported by stop()
            self.error = exc
        finally:
            client.close()


def contention_window(samples: list[tuple[float, dict[str, int], dict[str, int]]], tenants: tuple[str, ...]
                      ) -> tuple[float, dict[str, int]] | None:
    """(time, entries delivered per tenant) at the last sample at which every tenant still had
    unread entries; None when no sample had."""
    last = None
    for at, delivered, left in samples:
        if all(left.get(t, 0) > 0 for t in tenants):
            last = (at, dict(delivered))
        elif last is not None:
            break
    return last


def output_tokens_in(timings: list[RequestTiming], start: float, end: float) -> float:
    """Output tokens served in [start, end]: each request's spread evenly over its
    first_token_at..finished_at, counted for the part inside the window."""
    total = 0.0
    for t in timings:
        if not t.ok or t.output_tokens <= 0:
            continue
        first = t.first_token_at if t.first_token_at is not None else t.started_at
        span = t.finished_at - first
        if span <= 0:
            total += t.output_tokens if start <= t.finished_at <= end else 0
            continue
        overlap = min(end, t.finished_at) - max(start, first)
        if overlap > 0:
            total += t.output_tokens * overlap / span
    return total


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def weights_figures(samples, timings: dict[str, list[RequestTiming]], submitted_at: float) -> dict[str, Any]:
    """The weights scenario's figures (see the module docstring); the window's are None when no
    sample saw both tenants with entries unread."""
    window = contention_window(samples, (ALPHA, BETA))
    # While both still had requests unfinished: the engine's side, from the submission to the
    # earlier of the two tenants' last finishes.
    both_end = min(max(r.finished_at for r in timings[t]) for t in (ALPHA, BETA))
    unfinished = {t: output_tokens_in(timings[t], submitted_at, both_end) for t in (ALPHA, BETA)}
    figures: dict[str, Any] = {"samples": len(samples), "window_s": None, "delivered": None, "started": None,
                               "output_tokens": None, "delivered_ratio": None, "started_ratio": None,
                               "output_tokens_ratio": None, "both_unfinished_s": both_end - submitted_at,
                               "both_unfinished_output_tokens": unfinished,
                               "both_unfinished_output_tokens_ratio": ratio_of(unfinished[ALPHA], unfinished[BETA])}
    if window is None:
        return figures
    end, delivered = window
    started = {t: sum(1 for r in timings[t] if r.ok and r.started_at <= end) for t in (ALPHA, BETA)}
    tokens = {t: output_tokens_in(timings[t], submitted_at, end) for t in (ALPHA, BETA)}
    figures.update(window_s=end - submitted_at, delivered={t: delivered[t] for t in (ALPHA, BETA)},
                   started=started, output_tokens=tokens,
                   delivered_ratio=ratio_of(delivered[ALPHA], delivered[BETA]),
                   started_ratio=ratio_of(started[ALPHA], started[BETA]),
                   output_tokens_ratio=ratio_of(tokens[ALPHA], tokens[BETA]))
    return figures


__all__ = ["SAMPLE_S", "UnreadSampler", "contention_window", "delivered_by_tenant", "output_tokens_in", "ratio_of",
           "unread_counts", "weights_figures"]
