"""A request's last tries run alone, so that a request that crashes its worker ends with an error
row and the requests that were merely beside it do not.

Every delivery of a stream entry counts (the server's delivery count): a worker that dies holding
entries leaves them pending, and whoever takes them over (``XAUTOCLAIM``) counts one more delivery.
If one request kills every worker that runs it, its count grows with each death, and so does the
count of every request that happened to be held beside it. So:

- an entry on its last try (delivery ``--max-deliveries``, or any later one, and never the first)
  runs **alone**: the worker starts it only when its engine is empty, starts nothing else until
  it has finished, and marks the entry (``keys.ran_alone``) before it starts;
- an entry delivered more than ``--max-deliveries`` times ends with ``max_deliveries_exceeded``
  if it ran alone before (its worker died while running it and nothing else), or once it reaches
  twice ``--max-deliveries`` (whatever happened); otherwise it was only held beside the request
  that crashed its worker, and gets its own try alone.
"""

from __future__ import annotations

from mqinfer.schemas import keys
from mqinfer.workers.queue.lanes import split, stream_of

# How long the mark of a try alone is kept (an entry's row is written long before).
MARK_TTL_S = 24 * 3600


class LastTries:
    """The rule above for one worker (``stream``: its ``--stream``)."""

    def __init__(self, redis, stream: str, consumer: str, max_deliveries: int) -> None:
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self.max_deliveries = max_deliveries

    def runs_alone(self, attempt: int) -> bool:
        return attempt >= max(2, self.max_deliveries)

    def refusal(self, qid: str, attempt: int) -> str | None:
        """The message of the ``max_deliveries_exceeded`` row of an entry on delivery ``attempt``,
        or None while it may still run."""
        limit = self.max_deliveries
        if attempt <= limit:
            return None
        if attempt > 2 * limit:
            return (f"delivered {attempt} times (--max-deliveries {limit}); its workers died or failed "
                    "each time")
        if self.redis.exists(self._key(qid)):
            return (f"delivered {attempt} times (--max-deliveries {limit}); the worker running it alone "
                    "died: this request crashes the workers that run it")
        return None

    def split(self, items: list, engine_busy: bool, alone: str | None) -> tuple[list, list[str], str | None]:
        """A batch released to the engine, ``items`` as (entry id, in-flight entry), split by the
        rule above: (the items to start now, the entry ids to put back, the entry that runs alone
        after this batch or None). ``alone``: the entry running alone now; ``engine_busy``: the
        engine holds unfinished requests."""
        waits_alone = any(self.runs_alone(item.attempt) for _, item in items)
        start, later = [], []
        for entry_id, item in items:
            if alone is not None:
                later.append(entry_id)  # one runs alone: nothing joins it
            elif self.runs_alone(item.attempt):
                if engine_busy:
                    later.append(entry_id)  # it waits for the engine to empty
                else:
                    start.append((entry_id, item))
                    alone = entry_id
            elif waits_alone:
                later.append(entry_id)  # nothing new starts while a last try waits
            else:
                start.append((entry_id, item))
        return start, later, alone

    def mark(self, qid: str) -> None:
        """Say that ``qid`` starts running alone here (before it starts)."""
        self.redis.set(self._key(qid), self.consumer, ex=MARK_TTL_S)

    def _key(self, qid: str) -> str:
        entry_id, lane = split(qid)
        return keys.ran_alone(stream_of(self.stream, lane), entry_id)
