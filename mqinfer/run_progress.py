"""How ``mqinfer run`` watches its job (``mqinfer/run.py``): the requests done and the tokens
generated so far, counted over every shard in Redis, the progress line on stderr, waiting until every
worker has joined its consumer group, and until every request has a row or every worker is gone.
"""

from __future__ import annotations

import subprocess
import sys
import time

from mqinfer.config import ConfigError
from mqinfer.supervise import Supervisor


def mark_done(client, done_keys: list[str], requests, shards: int, shard_index) -> None:
    """Count the requests finished by earlier runs as done, each in its own shard's set."""
    by_key: dict[str, list[str]] = {}
    for r in requests:
        by_key.setdefault(done_keys[shard_index(r.id, r.job_id, shards)], []).append(r.id)
    for key, ids in by_key.items():
        for i in range(0, len(ids), 10_000):
            client.sadd(key, *ids[i:i + 10_000])


def wait_done(client, done_keys: list[str], total: int, workers: list[subprocess.Popen],
               generated_keys: list[str], job_id: str, stream_keys: list[str], group: str,
               supervisor: Supervisor | None = None) -> int:
    """Until every request has a row (0), or every worker exited (1; 2 when none got as far as
    reading a request: they could not load the model), showing progress: requests done, and the
    tokens the workers generated for the job so far (movement while the first requests still run).
    ``supervisor`` restarts the workers that die holding requests (mqinfer/supervise.py)."""
    progress = Progress(total)
    done = tokens = 0
    while True:
        done = count_done(client, done_keys, done)
        tokens = count_generated(client, generated_keys, job_id, tokens)
        progress.show(done, tokens)
        if supervisor is not None and done < total:
            supervisor.check(done)
        if done >= total:
            progress.show(done, tokens, force=True)
            progress.close()
            return 0
        if not any(w.poll() is None for w in workers):
            codes = ", ".join(str(w.returncode) for w in workers)
            progress.close()
            if done == 0 and not delivered_any(client, stream_keys, group):
                print(f"mqinfer run: error: every worker exited before it was ready (codes {codes}); their "
                      "messages are above", file=sys.stderr)
                return 2
            print(f"mqinfer run: error: every worker exited (codes {codes}) with {total - done} requests "
                  "unfinished; the workers' messages are above. Run the same command again to resume.",
                  file=sys.stderr)
            return 1
        time.sleep(0.1)


class Progress:
    """The progress line on stderr: redrawn every half second on a terminal, a line every 10 s
    otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def line(self, done: int, tokens: int, elapsed: float) -> str:
        pct = 100.0 * done / self.total if self.total else 100.0
        line = f"{done}/{self.total} requests ({pct:5.1f}%), {tokens} tokens generated, elapsed {elapsed:.0f}s"
        if 0 < done < self.total and elapsed > 0:
            line += f", eta {(self.total - done) / (done / elapsed):.0f}s"
        return line

    def show(self, done: int, tokens: int = 0, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.5 if self.tty else 10.0):
            return
        self._last = now
        line = self.line(done, tokens, now - self.start)
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def delivered_any(client, stream_keys: list[str], group: str) -> bool:
    """Whether any worker was ever given an entry of these streams."""
    import redis

    for key in stream_keys:
        try:
            groups = client.xinfo_groups(key)
        except redis.exceptions.RedisError:
            return True  # cannot tell: say what is sure (requests are unfinished)
        if any(g.get("entries-read") or g.get("pending") for g in groups):
            return True
    return False


def wait_for_workers(client, stream_keys: list[str], group: str, workers: list[subprocess.Popen],
                      timeout_s: float = 120.0) -> None:
    """Until every worker joined its consumer group (it does so before it loads the model), one
    exited, or timeout."""
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(w.poll() is None for w in workers):
        joined = 0
        for key in stream_keys:
            try:
                joined += len(client.xinfo_consumers(key, group))
            except redis.exceptions.RedisError:  # no stream or group yet
                pass
        if joined >= len(workers):
            return
        time.sleep(0.1)
    if not any(w.poll() is None for w in workers):
        codes = ", ".join(str(w.returncode) for w in workers)
        raise ConfigError(f"every worker exited before it was ready (codes {codes}); their messages are above")


def count_done(client, done_keys: list[str], previous: int) -> int:
    """Requests with a durable row, over every shard (one key per slot: no multi-key command)."""
    import redis

    from mqinfer.schemas.connection import CLUSTER_TRANSIENT

    pipe = client.pipeline(transaction=False)
    for key in done_keys:
        pipe.scard(key)
    try:
        return sum(pipe.execute())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, *CLUSTER_TRANSIENT):
        return previous  # a node is restarting: count again next time


def count_generated(client, generated_keys: list[str], job_id: str, previous: int) -> int:
    """Output tokens the workers generated for ``job_id``, over every shard (workers add them to
    each shard's hash as they step)."""
    import redis

    from mqinfer.schemas.connection import CLUSTER_TRANSIENT

    pipe = client.pipeline(transaction=False)
    for key in generated_keys:
        pipe.hget(key, job_id)
    try:
        return sum(int(float(v)) for v in pipe.execute() if v is not None)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, *CLUSTER_TRANSIENT):
        return previous  # a node is restarting: count again next time


__all__ = ["Progress", "count_done", "count_generated", "delivered_any", "mark_done", "wait_done", "wait_for_workers"]
