"""Connecting to Redis: URLs (redis://, rediss://, unix://), one server or a Redis Cluster.

Every process that talks to Redis (workers, producers, bulk-job tasks, reports) connects here,
so URLs are checked and passwords redacted the same way everywhere.
"""

from __future__ import annotations

import redis
import redis.cluster

def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` or ``unix://`` URLs (credentials in the URL).

    Gives a clear error for other schemes rather than redis-py's generic one.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"unsupported Redis URL {redact(url)!r}: use redis://[user:password@]host:port/db, "
            "rediss:// for TLS, or unix://[:password@]/path/to/socket"
        )
    kwargs.setdefault("socket_connect_timeout", 10)
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **kwargs)


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``, for logs and messages."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


# What a cluster client raises while a node is down, restarting or the slot map is moving:
# transient, so a worker retries with backoff instead of failing.
CLUSTER_TRANSIENT = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.MasterDownError,
)


def connect_redis(url: str, *, cluster: bool = False, **kwargs) -> redis.Redis | redis.cluster.RedisCluster:
    """A client for one server (``cluster=False``) or a whole cluster reached through a seed node.

    With ``cluster=True``, ``url`` names any one node (``redis://[:password@]host:port``); the
    client learns the slot map from it and follows it as nodes come and go.
    """
    if not cluster:
        return connect(url, **kwargs)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"a cluster seed must be a redis:// or rediss:// URL, got {redact(url)!r}")
    kwargs.setdefault("socket_connect_timeout", 10)
    try:
        return redis.cluster.RedisCluster.from_url(url, **kwargs)
    except redis.exceptions.RedisClusterException as exc:
        raise ValueError(f"cannot use {redact(url)} as a cluster seed: {exc}") from exc


def is_cluster(client) -> bool:
    return isinstance(client, redis.cluster.RedisCluster)
