"""Who may share cached KV with whom: the prefix cache's scope and a request's cache salt.

A prefix cache answers "was this prompt seen before?" faster, and the cost row's
``cached_prompt_tokens`` says so outright: shared between tenants, it tells one tenant whether
another sent a prompt it guesses. So the cache is partitioned. The partition of a request is

* under scope ``tenant`` (the default): its tenant and its ``cache_salt``;
* under scope ``global``: its ``cache_salt`` alone (no salt: the one partition every request
  without a salt shares, the cache as it was before scopes existed).

Requests share cached blocks only within a partition. The partition's bytes are the root of the
chained block hashes of the device cache (scheduler/kv_cache_manager.py), and so of the keys of
every KV tier below it, and they lead the producer's prefix keys (prefix order, prefix routing),
so that a job's prefix groups never span two partitions. The encoding is length-prefixed, so no
two different (scope, tenant, salt) give the same bytes.
"""

from __future__ import annotations

PREFIX_CACHE_SCOPES = ("tenant", "global")
DEFAULT_PREFIX_CACHE_SCOPE = "tenant"
# A salt is an opaque string the producer chooses (vLLM's ``cache_salt``); this bounds its size
# in every stream entry and hash.
MAX_CACHE_SALT_LENGTH = 256


def check_scope(scope: str) -> str:
    """``scope`` if it names a prefix cache scope, else ValueError naming the choices."""
    if scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got {scope!r}")
    return scope


def _field(tag: bytes, value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return tag + len(data).to_bytes(4, "little") + data


def cache_partition(scope: str, tenant: str, cache_salt: str | None) -> bytes:
    """The bytes naming the request's cache partition (see the module docstring); empty for a
    request without a salt under ``global``."""
    check_scope(scope)
    out = _field(b"T", tenant) if scope == "tenant" else b""
    if cache_salt is not None:
        out += _field(b"S", cache_salt)
    return out


__all__ = ["DEFAULT_PREFIX_CACHE_SCOPE", "MAX_CACHE_SALT_LENGTH", "PREFIX_CACHE_SCOPES", "cache_partition",
           "check_scope"]
