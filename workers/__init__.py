"""The inference worker: stream ingest, model families and loading, model runner, result and cost sinks."""

if __name__ == "workers":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
