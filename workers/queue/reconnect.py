"""Redis coming and going, as a worker lives with it: waiting for the server at start (one-line
errors for what waiting cannot fix), and skipping Redis work with backoff while it is away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from mqinfer.schemas.connection import CLUSTER_TRANSIENT, redact

log = logging.getLogger("mqinfer.worker")

# Redis unreachable (restarting, loading its append-only file, network): retry with backoff.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError,
              *CLUSTER_TRANSIENT)
# Server replies that mean the credentials are wrong or missing: retrying cannot help.
_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "invalid password")
MAX_BACKOFF_S = 5.0


class StartupError(ValueError):
    """The worker cannot start: Redis refuses its credentials or stays unreachable. The message is
    one line naming the server (its password redacted); a ValueError, so that the command line
    prints it as ``mqinfer worker: error: ...`` and exits non-zero, without a traceback."""


def _is_auth_error(exc: Exception) -> bool:
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and any(r in str(exc) for r in _AUTH_REPLIES)


def wait_for_redis(first_call: Callable[[], None], url: str, *, timeout_s: float, what: str) -> None:
    """Call ``first_call`` (it creates ``what``) until the server answers, with backoff;
    StartupError at once when the server refuses our credentials or permissions (waiting cannot
    fix those), or when it stays away ``timeout_s``."""
    url = redact(url)
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            first_call()
            return
        except redis.exceptions.RedisError as exc:
            if _is_auth_error(exc):
                raise StartupError(f"cannot authenticate to {url}: {exc}") from None
            if isinstance(exc, redis.exceptions.NoPermissionError):
                raise StartupError(f"the Redis user of {url} may not create {what}: {exc}") from None
            if not isinstance(exc, REDIS_DOWN):
                raise
            if time.monotonic() > deadline:
                raise StartupError(f"cannot connect to {url} (tried for {timeout_s:g}s): {exc}") from None
            log.warning("waiting for redis at %s (%s)", url, exc)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic()) + 0.01))
            delay = min(delay * 2, MAX_BACKOFF_S)


class Backoff:
    """Runs the loop's Redis phases; while the server is unreachable, skips them and retries with
    backoff. The engine keeps stepping meanwhile, rows keep being written, and acks wait: nothing
    that was read is lost (an entry read but not yet tracked stays pending and is re-claimed)."""

    def __init__(self, *, clock: Callable[[], float], busy: Callable[[], bool],
                 ping: Callable[[], object] | None = None) -> None:
        """``busy``: whether the engine has work (then the loop goes on at once; otherwise it
        pauses a little, not to spin while Redis is away). ``ping``: a round trip to Redis, made
        before the first call after a failure, so that a call that happens not to need Redis
        (nothing to ack, say) is not taken for Redis being back."""
        self.clock = clock
        self.busy = busy
        self.ping = ping
        self.retry_at = 0.0
        self.delay = 0.0

    def __call__(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or None when skipped or when Redis was down."""
        now = self.clock()
        if now < self.retry_at:
            return None
        try:
            if self.delay and self.ping is not None:
                self.ping()
            result = fn(*args, **kwargs)
        except REDIS_DOWN as exc:
            self._failed(now, exc)
            return None
        if self.delay:
            log.info("redis reachable again")
            self.delay = 0.0
        return result

    def _failed(self, now: float, exc: Exception) -> None:
        """Wait twice as long as last time (up to MAX_BACKOFF_S) before the next try; log it."""
        self.delay = min(max(self.delay * 2, 0.1), MAX_BACKOFF_S)
        self.retry_at = now + self.delay
        log.warning("redis unavailable (%s); retrying in %.1fs", exc, self.delay)
        if not self.busy():
            time.sleep(min(self.delay, 0.5))

    def retry_now(self) -> None:
        """Try the next call whatever the backoff (the last tries at stop)."""
        self.retry_at = 0.0
