"""`mqinfer run` restarts a worker that dies while it holds requests.

A worker process can die in the middle of a request: a native crash, the kernel's out-of-memory
killer, a signal. The stream keeps what it held pending, and another worker would take it over
once it has been idle ``--claim-idle-ms`` (30 s by default), counting one more delivery. A run
does better: it knows its workers' processes, so when one dies holding entries it

1. makes those entries claimable at once (their idle time set past ``--claim-idle-ms``, their
   delivery count untouched): the next worker to take them over counts the delivery, so a
   request that kills every worker that runs it reaches ``--max-deliveries`` and ends with an
   error row (see workers/queue/last_try.py for how that request is told apart from its neighbours);
2. starts a new worker in its place, so that a run of one worker, or of workers that all died,
   goes on to finish the job.

A worker that exits holding nothing (it could not start, or ``--idle-exit-s``) is not restarted:
the run's other checks report that. Restarts stop when the job makes no progress through
``(--max-deliveries + 1) x workers`` of them in a row, which no single bad request can cause.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from typing import Callable

# Where entries are parked to be claimable at once; the workers' hand-back consumer.
HANDBACK_CONSUMER = "mqinfer-handback"


class Supervisor:
    """Watches ``workers`` (restarted in place: the list is the run's own)."""

    def __init__(self, client, workers: list[subprocess.Popen], start: Callable[[int], subprocess.Popen],
                 stream_keys: Callable[[], list[str]], group: str, *, claim_idle_ms: int,
                 max_deliveries: int, on_start: Callable[[subprocess.Popen], None] = lambda proc: None) -> None:
        self.client = client
        self.workers = workers
        self._start = start
        self._stream_keys = stream_keys
        self.group = group
        self.claim_idle_ms = claim_idle_ms
        self.max_restarts_without_progress = (max_deliveries + 1) * max(1, len(workers))
        self._on_start = on_start
        self._seen: set[int] = set()
        self._last_done = -1
        self._since_progress = 0
        self.restarts = 0

    def check(self, done: int) -> None:
        """Restart the workers that died holding entries since the last call (``done``: requests
        with rows so far)."""
        if done > self._last_done:
            self._last_done = done
            self._since_progress = 0
        for i, proc in enumerate(self.workers):
            if proc.pid in self._seen or proc.poll() is None:
                continue
            self._seen.add(proc.pid)
            if proc.returncode == 0:
                continue
            held = self.release(proc.pid)
            if not held:
                continue
            how = describe_exit(proc.returncode)
            if self._since_progress >= self.max_restarts_without_progress:
                print(f"mqinfer run: worker {i} (pid {proc.pid}) died ({how}) holding {held} requests; not "
                      f"restarted: {self._since_progress} restarts in a row made no progress", file=sys.stderr,
                      flush=True)
                continue
            self._since_progress += 1
            self.restarts += 1
            replacement = self._start(i)
            self.workers[i] = replacement
            self._on_start(replacement)
            print(f"mqinfer run: worker {i} (pid {proc.pid}) died ({how}) holding {held} requests: they count a "
                  f"delivery and go to the other workers; started worker {i} again (pid {replacement.pid})",
                  file=sys.stderr, flush=True)

    def release(self, pid: int) -> int:
        """Make the entries pending under the dead worker ``pid``'s consumer claimable at once, on
        every stream key of the run; how many there were."""
        import redis

        name = re.compile(rf"-{pid}-[0-9a-f]{{4}}$")
        moved = 0
        for key in self._stream_keys():
            try:
                consumers = self.client.xinfo_consumers(key, self.group)
            except redis.exceptions.ResponseError:
                continue  # no such stream or group (a lane nobody used)
            for consumer in consumers:
                consumer_name = _text(consumer["name"])
                if not name.search(consumer_name) or not consumer.get("pending"):
                    continue
                while True:
                    entries = self.client.xpending_range(key, self.group, "-", "+", 1000, consumername=consumer_name)
                    if not entries:
                        break
                    ids = [e["message_id"] for e in entries]
                    self.client.xclaim(key, self.group, HANDBACK_CONSUMER, 0, ids, idle=self.claim_idle_ms + 1,
                                       justid=True)
                    moved += len(ids)
        return moved


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
