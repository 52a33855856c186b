"""Prometheus metrics of a worker (prefix ``mqinfer_``), in the style of vLLM's names.

Each worker owns one registry (no module-level mutable state), served on ``--metrics-port``
bound to 127.0.0.1 unless told otherwise, with ``/healthz`` and ``/readyz`` beside ``/metrics``.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "error", "expired", "cancelled")


class WorkerMetrics:
    def __init__(self, model: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_running = Gauge("mqinfer_num_requests_running", "Requests in the engine's running set.", registry=r)
        self.requests_waiting = Gauge(
            "mqinfer_num_requests_waiting", "Requests read from the stream and not yet running.", registry=r
        )
        self.kv_cache_usage = Gauge("mqinfer_kv_cache_usage_ratio", "Share of KV cache blocks in use (0-1).", registry=r)
        self.prompt_tokens = Counter("mqinfer_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("mqinfer_generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("mqinfer_num_preemptions", "Requests preempted by the scheduler.", registry=r)
        finished = Counter(
            "mqinfer_request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        # Labels bound once: the hot path never builds a label set.
        self.finished = {reason: finished.labels(reason) for reason in FINISH_REASONS}
        self.ttft = Histogram(
            "mqinfer_time_to_first_token_seconds", "Time from enqueue to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "mqinfer_e2e_request_latency_seconds", "Time from enqueue to the result row.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "mqinfer_request_queue_time_seconds", "Time from enqueue to admission into the engine.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.dead_letters = Counter("mqinfer_dead_letters", "Entries sent to the dead-letter stream.", registry=r)
        self.redeliveries = Counter(
            "mqinfer_redeliveries", "Entries this worker claimed from another consumer.", registry=r
        )
        self.rows_written = Counter("mqinfer_result_rows_written", "Result rows written durably.", registry=r)
        self.ready = False
        self.healthy = True
        self._server: ThreadingHTTPServer | None = None

    def finish(self, reason: str) -> None:
        counter = self.finished.get(reason)
        if counter is not None:
            counter.inc()

    # -- HTTP --------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics, /healthz and /readyz in a daemon thread; returns the bound port."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok = metrics.healthy
                    body, ctype, code = (b"ok\n" if ok else b"unhealthy\n"), "text/plain", 200 if ok else 503
                elif path == "/readyz":
                    ok = metrics.ready and metrics.healthy
                    body, ctype, code = (b"ready\n" if ok else b"not ready\n"), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep scrapes out of the worker's log
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
