"""The inference worker: stream ingest, model families and loading, model runner, result and cost sinks."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
