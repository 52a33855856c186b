"""The inference worker: stream ingest, model families and loading, model runner, result and cost sinks."""
