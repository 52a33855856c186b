"""Dual-threshold batcher, KV block pool and cache manager, continuous-batching scheduler, request state."""
