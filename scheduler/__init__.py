"""Dual-threshold batcher, KV block pool and cache manager, continuous-batching scheduler, request state."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
