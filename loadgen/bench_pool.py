"""The `mqinfer worker` processes a benchmark run drives, and what is read back from them.

Owns the workers' command line (``worker_argv``: the bench's engine flags passed through), the
``WorkerPool`` (start, watch, drain and stop the processes, their logs in files), waiting for a
job's requests to be done, reading a job's result rows back (``read_results``), and the
benchmark's progress lines on stderr (``log``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from mqinfer.loadgen.metrics import RequestTiming, timings_from_results
from mqinfer.procs import mqinfer_command
from mqinfer.warm_start import WarmStarter

STREAM = "bench"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def worker_argv(args: argparse.Namespace, model_arg: str, redis_url: str, out: Path) -> list[str]:
    argv = [*mqinfer_command("worker"), "--redis", redis_url, "--out", str(out),
            "--stream", STREAM, "--model", model_arg, "--dtype", args.dtype, "--device", args.device,
            "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
            "--idle-exit-s", str(args.idle_exit_s)]
    if getattr(args, "speculative", "none") != "none":
        argv += ["--speculative", args.speculative]
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "max_batch",
                 "max_wait_ms", "num_threads", "num_speculative_tokens", "speculative_max_batched_tokens",
                 "speculative_policy", "draft_layers", "draft_model", "prefix_cache_scope"):
        value = getattr(args, name, None)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def spread_over_gpus(argv: list[str], index: int) -> None:
    """Worker ``index``'s ``--device`` on a machine with several CUDA devices: ``cuda`` or
    ``auto`` becomes ``cuda:<index mod count>``, one worker per device as `mqinfer run` places
    them (``--workers auto`` starts one per device), rather than every worker on cuda:0."""
    if "--device" not in argv:
        return
    at = argv.index("--device") + 1
    if argv[at] not in ("cuda", "auto"):
        return
    from mqinfer.workers.devices import cuda_device_count

    count = cuda_device_count()
    if count > 1:
        argv[at] = f"cuda:{index % count}"


class WorkerPool:
    """``mqinfer worker`` processes, their logs in files (shown when one fails)."""

    def __init__(self, argv: list[str], count: int, log_dir: Path, out: Path,
                 streams: list[str] | None = None) -> None:
        self.argv = argv
        self.count = count
        # Shard streams: worker i reads streams[i % len(streams)] (None: every worker the argv's).
        self.streams = streams
        self.log_dir = log_dir
        self.out = out  # the workers' --out: each leaves its exit summary there
        # Named consumers, so that this pool's exit summaries are found among earlier pools'.
        self.consumers = [f"bench-{uuid.uuid4().hex[:8]}-{i}" for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        # Workers forked from one process that has imported the engine (mqinfer.warm_start).
        self._starter = WarmStarter()

    def start(self) -> None:
        for i in range(self.count):
            self.start_one(i)

    def start_one(self, i: int) -> None:
        """Start worker ``i`` (consumer ``self.consumers[i]``), its output in ``worker-<i>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("MQINFER_LOG_LEVEL", "info")
        log_file = open(self.log_dir / f"worker-{i}.log", "wb")
        self._logs.append(log_file)
        argv = list(self.argv)
        if self.streams:
            argv[argv.index("--stream") + 1] = self.streams[i % len(self.streams)]
        spread_over_gpus(argv, i)
        self.procs.append(self._starter.popen([*argv, "--consumer", self.consumers[i]], env=env,
                                              stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT))

    def check_alive(self) -> None:
        """Raise with the log's tail when every worker has exited."""
        if self.procs and all(p.poll() is not None for p in self.procs):
            codes = ", ".join(str(p.returncode) for p in self.procs)
            raise RuntimeError(f"every worker exited (codes {codes}) before the run finished; "
                               f"last lines of worker-0.log:\n{self.log_tail(0)}")

    def log_tail(self, index: int, chars: int = 3000) -> str:
        path = self.log_dir / f"worker-{index}.log"
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def busy_summaries(self) -> list[dict[str, Any]]:
        """The exit summaries (busy time by phase, requests finished, uptime) of this pool's stopped
        workers, from ``OUT/.mqinfer/workers/<consumer>.json``."""
        from mqinfer.workers.queue.busy import summary_path

        found = []
        for consumer in self.consumers:
            try:
                found.append(json.loads(summary_path(self.out, consumer).read_text()))
            except (OSError, ValueError):
                continue
        return found

    def stop(self, timeout_s: float = 60.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # drains: flushes rows, acks, exits 0
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._starter.close()
        for log_file in self._logs:
            log_file.close()
        self._logs.clear()


def wait_done(redis_client, job_id: str, expected: int, pool: WorkerPool, timeout_s: float, what: str) -> None:
    from mqinfer.schemas import keys

    done_keys = [keys.job_done_set(s, job_id) for s in (pool.streams or [STREAM])]
    start = time.monotonic()
    last_note = start
    while True:
        done = sum(redis_client.scard(k) for k in done_keys)
        if done >= expected:
            return
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"{what}: {done}/{expected} requests done after {timeout_s:.0f}s (--timeout-s)")
        if now - last_note >= 10:
            last_note = now
            log(f"{what}: {done}/{expected} requests done, {now - start:.0f}s")
        pool.check_alive()
        time.sleep(0.05)


def read_results(out: Path, job_id: str, requests: list[dict[str, Any]]
                 ) -> tuple[list[RequestTiming], dict[str, list[int]]]:
    """Timings (in request order) and generated token ids of a job's rows in ``out/results``."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    results = out / "results"
    if not results.exists():
        raise RuntimeError(f"the workers wrote no results under {results}")
    table = ds.dataset(results, format="parquet", partitioning="hive").to_table(filter=pc.field("job_id") == job_id)
    requested = {r["id"]: int(r["max_tokens"]) for r in requests}
    timings = timings_from_results(table, requested)
    tokens: dict[str, list[int]] = {}
    for rid, reason, ids in zip(table.column("id").to_pylist(), table.column("finish_reason").to_pylist(),
                                table.column("output_token_ids").to_pylist()):
        if reason != "error" and rid not in tokens:
            tokens[rid] = list(ids or [])
    # At-least-once delivery may leave a duplicate row; one per request, the first non-error one.
    best: dict[str, RequestTiming] = {}
    for t in timings:
        if t.id not in best or (t.ok and not best[t.id].ok):
            best[t.id] = t
    missing = set(requested) - set(best)
    if missing:
        raise RuntimeError(f"{len(missing)} requests have no result row (e.g. {sorted(missing)[:3]})")
    outputs = {rid: tokens.get(rid, []) for rid in requested}
    return [best[r["id"]] for r in requests], outputs


def worker_wait_setting(value: float | str | None) -> float | str:
    """The batcher wait a worker uses when started with ``--max-wait-ms value`` (None: the flag
    left out, so the worker's environment or default decides)."""
    if value is not None:
        return value
    from mqinfer.config import WORKER_OPTIONS

    option = next(o for o in WORKER_OPTIONS if o.name == "max_wait_ms")
    if option.env in os.environ:  # the workers inherit the bench's environment
        return option.convert(os.environ[option.env], f"environment {option.env}")
    return option.default
