"""Dual-threshold batcher, KV block pool and cache manager, continuous-batching scheduler, request state."""

if __name__ == "scheduler":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
