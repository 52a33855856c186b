"""`mqinfer bench`: our whole pipeline under a synthetic workload, beside Hugging Face baselines.

Owns the benchmark command: it builds (or reuses) the checkpoint and the seeded workload,
measures the machine's matrix rate and the workload's compute ceiling, runs the workload
through the real pipeline (an embedded server, ``Producer``, ``mqinfer worker`` processes, the
results Parquet) and, with ``--compare hf``, through transformers on the same checkpoint and
requests, then prints throughput, latency percentiles and the ratios between systems.

- offline: every request is submitted before the workers start; throughput counts the tokens
  the requests asked for over first started -> last finished, read back from the result rows.
- online: workers start first (and are warmed with one request); requests then arrive as a
  Poisson process at ``--rate`` per second (several comma-separated rates make a sweep), and
  TTFT / TPOT / e2e are measured from each entry's enqueue time. ``--rate half`` first runs the
  offline mode on the same requests (its own workers, so that no prefix cache carries over) and
  then offers half its measured request throughput. Every online point is checked against issue
  4's goal, p99 TTFT <= max wait + 3 engine steps (``TtftBudget``): the max wait is the workers'
  ``--max-wait-ms`` (for ``auto``, the adaptive batcher's upper bound), and an engine step is the
  point's own TPOT p50, the time one decode step takes for a running request, measured under that
  load (it includes the prefill chunks batched into the same steps). ``--compare-wait 10,auto``
  runs the online rates once per wait setting, each with fresh workers, for issue 8's comparison.

``add_bench_arguments(parser)`` and ``run_bench(args) -> int`` are for the ``mqinfer`` CLI;
``python -m mqinfer.loadgen.bench`` runs the same thing. Progress goes to stderr, the report
to stdout, all figures to ``--json FILE``, charts to ``--plot DIR`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mqinfer.loadgen.metrics import (
    Percentiles,
    RequestTiming,
    RunSummary,
    TtftBudget,
    summarize,
    timings_from_results,
    token_agreement,
    ttft_budget,
)
from mqinfer.loadgen.bench_options import AUTO, HALF, add_bench_arguments
from mqinfer.procs import mqinfer_command
from mqinfer.loadgen.workload import MIN_TOKEN_ID, make_workload, workload_stats

STREAM = "bench"
BENCH_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
BUDGET_STEPS = 3  # issue 4: p99 TTFT <= max wait + 3 engine steps


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ model
@dataclass
class ModelSpec:
    arg: str  # what the workers get as --model
    folder: Path | None  # a checkpoint folder transformers can load (None until needed for tiny)
    config: dict[str, Any]  # its config.json
    vocab_size: int  # token ids for prompts are drawn below this
    max_model_len: int


def resolve_model(model: str | None) -> ModelSpec:
    from mqinfer.loadgen.checkpoint import make_standard_checkpoint, read_config, standard_checkpoint_dir

    if model is None:
        folder = standard_checkpoint_dir()
        _log(f"standard checkpoint: {folder}")
        make_standard_checkpoint(folder)
        model = str(folder)
    if model == "tiny":
        from mqinfer.workers.loader import TINY_BOS, TINY_HF_CONFIG

        # Byte ids only: the ids from TINY_BOS up are special tokens.
        return ModelSpec("tiny", None, dict(TINY_HF_CONFIG), int(TINY_BOS),
                         int(TINY_HF_CONFIG["max_position_embeddings"]))
    folder = Path(model).resolve()
    config = read_config(folder)
    return ModelSpec(str(folder), folder, config, int(config["vocab_size"]),
                     int(config.get("max_position_embeddings") or 2048))


def hf_folder(spec: ModelSpec, scratch: Path) -> Path:
    if spec.folder is not None:
        return spec.folder
    from mqinfer.workers.loader import save_tiny_checkpoint

    spec.folder = save_tiny_checkpoint(scratch / "tiny-checkpoint")
    return spec.folder


# ---------------------------------------------------------------------------------- workers
def worker_argv(args: argparse.Namespace, model_arg: str, redis_url: str, out: Path) -> list[str]:
    argv = [*mqinfer_command("worker"), "--redis", redis_url, "--out", str(out),
            "--stream", STREAM, "--model", model_arg, "--dtype", args.dtype, "--device", args.device,
            "--idle-exit-s", str(args.idle_exit_s)]
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size", "max_batch",
                 "max_wait_ms", "num_threads"):
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


BUSY_MARKER = "busy time "


def overhead_share(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Issue 4's overhead: the share of the workers' busy time outside the model's forward pass,
    with the time by phase (engine phases plus ``other``: ingest, batcher, sinks, acks, replies)."""
    busy = sum(float(s.get("busy_s") or 0.0) for s in summaries)
    if busy <= 0:
        return None
    phases: dict[str, float] = {}
    for s in summaries:
        for name, value in (s.get("phases_s") or {}).items():
            phases[name] = phases.get(name, 0.0) + float(value)
        phases["other"] = phases.get("other", 0.0) + float(s.get("other_s") or 0.0)
    forward = phases.get("forward", 0.0)
    return {"workers": len(summaries), "busy_s": busy, "phases_s": phases,
            "outside_forward_share": 1.0 - forward / busy}


class WorkerPool:
    """``mqinfer worker`` processes, their logs in files (shown when one fails)."""

    def __init__(self, argv: list[str], count: int, log_dir: Path) -> None:
        self.argv = argv
        self.count = count
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("MQINFER_LOG_LEVEL", "info")  # info: the busy-time line a worker logs at exit
        for i in range(self.count):
            log = open(self.log_dir / f"worker-{i}.log", "wb")
            self._logs.append(log)
            self.procs.append(subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT))

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
        """The busy-time summary each stopped worker logged (``worker ... stopped; busy time {...}``)."""
        found = []
        for i in range(self.count):
            try:
                text = (self.log_dir / f"worker-{i}.log").read_text(errors="replace")
            except OSError:
                continue
            for line in reversed(text.splitlines()):
                marker = line.find(BUSY_MARKER)
                if marker >= 0:
                    try:
                        found.append(json.loads(line[marker + len(BUSY_MARKER):]))
                    except ValueError:
                        pass
                    break
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
        for log in self._logs:
            log.close()
        self._logs.clear()


def _wait_done(redis_client, job_id: str, expected: int, pool: WorkerPool, timeout_s: float, what: str) -> None:
    from mqinfer.schemas import keys

    done_key = keys.job_done_set(STREAM, job_id)
    start = time.monotonic()
    last_note = start
    while True:
        done = redis_client.scard(done_key)
        if done >= expected:
            return
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"{what}: {done}/{expected} requests done after {timeout_s:.0f}s (--timeout-s)")
        if now - last_note >= 10:
            last_note = now
            _log(f"{what}: {done}/{expected} requests done, {now - start:.0f}s")
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


@dataclass
class OnlinePoint:
    rate: float  # offered load, requests per second
    summary: RunSummary
    submit_lag_p99_s: float  # how late the submitter was against the Poisson schedule
    timings: list[RequestTiming] = field(repr=False, default_factory=list)
    max_wait_ms: float | str | None = None  # the workers' batcher wait (ms or "auto"); None: unknown
    budget: TtftBudget | None = None  # issue 4's goal; None without a TTFT or a step to measure it by


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


def wait_budget_s(setting: float | str) -> tuple[float, str]:
    """The wait counted in the TTFT budget (seconds) and how it was chosen. For ``auto`` that is
    the upper bound the adaptive batcher may choose: the worker builds its ``AdaptiveWait`` with
    the default bounds."""
    if setting == AUTO:
        from mqinfer.scheduler.batcher import AdaptiveWait

        bound = AdaptiveWait().max_wait_s
        return bound, f"{bound * 1000:g} [auto: the adaptive batcher's upper bound]"
    return float(setting) / 1000.0, f"{float(setting):g}"


def point_budget(summary: RunSummary, setting: float | str) -> TtftBudget | None:
    """Issue 4's goal for one online point: its p99 TTFT against the max wait plus three engine
    steps, a step being the point's TPOT p50 (one decode step of a running request, measured under
    the same load). None when no request produced a first token or a second one."""
    if summary.ttft is None or summary.tpot is None:
        return None
    return ttft_budget(summary.ttft.p99, wait_budget_s(setting)[0], summary.tpot.p50, BUDGET_STEPS)


def request_rate(summary: RunSummary) -> float:
    """A run's request throughput: requests finished without error / span (0 when none)."""
    done = summary.num_requests - summary.num_errors
    return done / summary.span_s if done > 0 and summary.span_s > 0 else 0.0


def half_rate(offline: RunSummary) -> float:
    """Half an offline run's request throughput, to 3 significant digits."""
    rate = request_rate(offline)
    if rate <= 0:
        raise RuntimeError("--rate half: the offline run measured no throughput to take half of")
    return float(f"{rate / 2:.3g}")


def unshared_prompts(requests: list[dict[str, Any]], salt: int, vocab_size: int) -> list[dict[str, Any]]:
    """The requests with each prompt's first token id shifted by ``salt`` within the prompt ids.

    Prefix-cache block hashes are chained from the first block, so the points of a sweep on the
    same workers, each with its own salt, share no cached prompt blocks (without this, every point
    after the first found about 95% of its prompt tokens cached, and its TTFT was flattered),
    while the requests of one point still share what they shared before (a shared prefix).
    Salt 0 returns the requests unchanged.
    """
    span = vocab_size - MIN_TOKEN_ID
    if salt % span == 0:
        return requests
    out = []
    for r in requests:
        ids = list(r["prompt_token_ids"])
        ids[0] = MIN_TOKEN_ID + (ids[0] - MIN_TOKEN_ID + salt) % span
        out.append({**r, "prompt_token_ids": ids})
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives, at ``rate`` per second."""
    import numpy as np

    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


def _submit_on_schedule(producer, requests: list[dict[str, Any]], arrivals: list[float], job_id: str,
                        lags: list[float], errors: list[BaseException]) -> None:
    try:
        t0 = time.monotonic()
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            producer.submit(req, job_id=job_id)
            lags.append(max(0.0, time.monotonic() - (t0 + at)))
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


@dataclass
class EngineRun:
    offline: RunSummary | None
    online: list[OnlinePoint]
    timings: list[RequestTiming]  # offline only
    outputs: dict[str, list[int]]  # offline only
    half_rate: float | None = None  # the rate `--rate half` stood for
    overhead: dict[str, Any] | None = None  # offline only: see overhead_share


def _with_wait(args: argparse.Namespace, max_wait_ms: float | str | None) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "max_wait_ms": max_wait_ms})


def _run_offline(args: argparse.Namespace, requests: list[dict[str, Any]], producer, pool: WorkerPool, out: Path,
                 job_id: str) -> tuple[list[RequestTiming], dict[str, list[int]]]:
    """Every request submitted, then the workers started; stopped when all are done (their busy
    time summaries are then in ``pool.busy_summaries()``)."""
    try:
        producer.submit_many(requests, job_id=job_id)
        _log(f"mqinfer offline: {len(requests)} requests submitted; starting {args.workers} worker(s)")
        pool.start()
        _wait_done(producer.redis, job_id, len(requests), pool, args.timeout_s, "mqinfer offline")
    finally:
        pool.stop()
    return read_results(out, job_id, requests)


def _run_online(args: argparse.Namespace, spec: ModelSpec, requests: list[dict[str, Any]], url: str, producer,
                pool: WorkerPool, out: Path, tag: str, rates: list[float], setting: float | str) -> list[OnlinePoint]:
    """Warm the workers with one request, then one Poisson run per rate (prompts salted per rate:
    ``unshared_prompts``); the workers are stopped at the end."""
    from mqinfer.client import Producer

    try:
        pool.start()
        # Reversed, so that it shares no cached prefix blocks with the measured requests.
        warm = {"id": "warmup", "prompt_token_ids": requests[0]["prompt_token_ids"][::-1], "max_tokens": 8,
                "ignore_eos": True, "temperature": 0.0}
        warm_job = f"bench-warmup-{tag}"
        producer.submit(warm, job_id=warm_job)
        _log(f"mqinfer online: starting {args.workers} worker(s) (max wait {wait_label(setting)}), "
             "waiting for a warm-up request")
        _wait_done(producer.redis, warm_job, 1, pool, args.timeout_s, "warm-up")
        points = []
        for k, rate in enumerate(rates):
            job_id = f"bench-{tag}-r{k}"
            arrivals = poisson_arrivals(len(requests), rate, args.seed + k)
            lags: list[float] = []
            errors: list[BaseException] = []
            submitter = Producer(url, stream=STREAM)
            thread = threading.Thread(target=_submit_on_schedule, name="bench-submitter",
                                      args=(submitter, unshared_prompts(requests, k, spec.vocab_size), arrivals,
                                            job_id, lags, errors), daemon=True)
            _log(f"mqinfer online: {len(requests)} requests at {rate:g} req/s (about {arrivals[-1]:.0f}s of arrivals)")
            thread.start()
            try:
                _wait_done(producer.redis, job_id, len(requests), pool, args.timeout_s, f"online {rate:g} req/s")
            finally:
                thread.join(timeout=5)
                submitter.redis.close()
            if errors:
                raise RuntimeError(f"submitting at {rate:g} req/s failed: {errors[0]}")
            # Rows are durable before their id joins the done set, so they can be read while workers run.
            timings, _ = read_results(out, job_id, requests)
            lag = sorted(lags)
            summary = summarize(timings)
            points.append(OnlinePoint(rate, summary, lag[int(0.99 * (len(lag) - 1))] if lag else 0.0, timings,
                                      setting, point_budget(summary, setting)))
        return points
    finally:
        pool.stop()


def run_engine(args: argparse.Namespace, spec: ModelSpec, requests: list[dict[str, Any]], scratch: Path
               ) -> EngineRun:
    """One offline run, or the online sweep (after an offline run for `--rate half`; once per
    `--compare-wait` setting), through the real pipeline."""
    from mqinfer.client import Producer
    from mqinfer.server import EmbeddedServer

    out = Path(args.out).resolve() if args.out else scratch / "out"
    out.mkdir(parents=True, exist_ok=True)
    server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
    producer = Producer(server.url, stream=STREAM)
    tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    waits = args.compare_wait or [args.max_wait_ms]

    def pool(wait: float | str | None, log_dir: Path) -> WorkerPool:
        return WorkerPool(worker_argv(_with_wait(args, wait), spec.arg, server.url, out), args.workers, log_dir)

    try:
        if args.mode == "offline":
            workers = pool(waits[0], out / "logs")
            timings, outputs = _run_offline(args, requests, producer, workers, out, f"bench-{tag}")
            return EngineRun(summarize(timings), [], timings, outputs,
                             overhead=overhead_share(workers.busy_summaries()))
        offline, timings, outputs, half = None, [], {}, None
        if HALF in args.rate:
            # Its own workers, stopped before the online runs: they start with an empty prefix cache.
            timings, outputs = _run_offline(args, requests, producer, pool(waits[0], out / "logs" / "offline"), out,
                                            f"bench-{tag}")
            offline = summarize(timings)
            half = half_rate(offline)
            _log(f"--rate half: offline {offline.num_requests - offline.num_errors} requests over "
                 f"{offline.span_s:.2f}s = {request_rate(offline):.3g} req/s; online at {half:g} req/s")
        rates = [half if r == HALF else r for r in args.rate]
        points: list[OnlinePoint] = []
        for w, wait in enumerate(waits):
            setting = worker_wait_setting(wait)
            log_dir = out / "logs" if len(waits) == 1 else out / "logs" / f"wait-{setting}"
            points += _run_online(args, spec, requests, server.url, producer, pool(wait, log_dir), out, f"{tag}-w{w}",
                                  rates, setting)
        return EngineRun(offline, points, timings, outputs, half)
    finally:
        producer.redis.close()
        server.stop()


# ---------------------------------------------------------------------------------- reports
def _fmt_pct(p: Percentiles | None, scale: float = 1.0, digits: int = 3) -> str:
    if p is None:
        return "-"
    return "/".join(f"{v * scale:.{digits}g}" for v in (p.p50, p.p90, p.p99))


def format_table(rows: list[tuple[str, RunSummary]]) -> str:
    w = max([22] + [len(name) for name, _ in rows])
    head = (f"{'system':<{w}} {'tok/s':>9} {'span s':>8} {'reqs':>5} {'err':>4}  "
            f"{'TTFT s p50/p90/p99':<22} {'TPOT ms p50/p90/p99':<22} {'e2e s p50/p90/p99':<22}")
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(f"{name:<{w}} {s.throughput:>9.1f} {s.span_s:>8.2f} {s.num_requests:>5d} {s.num_errors:>4d}  "
                     f"{_fmt_pct(s.ttft):<22} {_fmt_pct(s.tpot, 1000.0):<22} {_fmt_pct(s.e2e):<22}")
    return "\n".join(lines)


def wait_label(setting: float | str | None) -> str:
    if setting is None:
        return "?"
    return AUTO if setting == AUTO else f"{float(setting):g} ms"


def point_name(point: OnlinePoint, with_wait: bool) -> str:
    name = f"mqinfer @{point.rate:g} req/s"
    return f"{name} wait {wait_label(point.max_wait_ms)}" if with_wait else name


def budget_line(point: OnlinePoint) -> str:
    """'p99 TTFT X ms vs budget Y ms (max_wait W + 3 x step S): met|not met', in milliseconds."""
    b = point.budget
    if b is None:
        return "no p99 TTFT or engine step measured (no request with two or more tokens)"
    wait_text = wait_budget_s(point.max_wait_ms)[1] if point.max_wait_ms is not None else f"{b.max_wait_s * 1000:g}"
    return (f"p99 TTFT {b.ttft_p99_s * 1000:.1f} ms vs budget {b.budget_s * 1000:.1f} ms (max_wait {wait_text} + "
            f"{b.steps} x step {b.step_s * 1000:.1f}, step = TPOT p50): {'met' if b.met else 'not met'}")


def format_wait_table(points: list[OnlinePoint]) -> str:
    """One row per offered rate and wait setting, rates ascending."""
    head = (f"{'req/s':>7} {'wait':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tok/s':>9} "
            f"{'budget ms':>10} {'goal':>8}")
    lines = [head, "-" * len(head)]
    for p in sorted(points, key=lambda q: q.rate):  # stable: settings keep their order within a rate
        ttft = p.summary.ttft
        p50, p99 = (f"{ttft.p50 * 1000:.1f}", f"{ttft.p99 * 1000:.1f}") if ttft else ("-", "-")
        budget = f"{p.budget.budget_s * 1000:.1f}" if p.budget else "-"
        goal = ("met" if p.budget.met else "not met") if p.budget else "-"
        lines.append(f"{p.rate:>7g} {wait_label(p.max_wait_ms):>8} {p50:>12} {p99:>12} {p.summary.throughput:>9.1f} "
                     f"{budget:>10} {goal:>8}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def _check_plotting(plot_dir: str | None) -> str | None:
    if plot_dir is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or run without --plot)")
    return None


def _save(fig, path: Path) -> Path:
    """Lay out, write and close one chart."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(plot_dir: Path, systems: list[tuple[str, float]], online: list[OnlinePoint]) -> list[Path]:
    """throughput.png (one bar per system) and, for online sweeps, latency.png (against offered load)
    or, when the points ran with several batcher waits, ttft-by-wait.png (p99 TTFT and throughput
    against offered load, one line per wait)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if systems:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [n for n, _ in systems]
        values = [v for _, v in systems]
        bars = ax.bar(names, values, color=["tab:blue" if n.startswith("mqinfer") else "tab:gray" for n in names])
        ax.bar_label(bars, fmt="%.0f")
        ax.margins(y=0.12)  # room for the labels above the tallest bar
        ax.set_ylabel("requested output tokens / s")
        ax.set_title("Throughput by system")
        ax.tick_params(axis="x", labelrotation=20)
        written.append(_save(fig, plot_dir / "throughput.png"))
    by_wait: dict[str, list[OnlinePoint]] = {}
    for p in online:
        by_wait.setdefault(wait_label(p.max_wait_ms), []).append(p)
    if len(by_wait) > 1:
        fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
        for label, points in by_wait.items():
            points = sorted(points, key=lambda q: q.rate)
            rates = [p.rate for p in points]
            ax_ttft.plot(rates, [p.summary.ttft.p99 * 1000 if p.summary.ttft else float("nan") for p in points],
                         marker="o", label=f"wait {label}")
            ax_tput.plot(rates, [p.summary.throughput for p in points], marker="o", label=f"wait {label}")
        for ax, title in ((ax_ttft, "p99 time to first token (ms)"), (ax_tput, "requested output tokens / s")):
            ax.set_xlabel("offered load (requests / s)")
            ax.set_title(title)
            ax.legend()
        written.append(_save(fig, plot_dir / "ttft-by-wait.png"))
    elif online:
        online = sorted(online, key=lambda q: q.rate)
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        rates = [p.rate for p in online]
        for ax, metric, title, scale in ((axes[0], "ttft", "time to first token (s)", 1.0),
                                         (axes[1], "tpot", "time per output token (ms)", 1000.0),
                                         (axes[2], "e2e", "end-to-end latency (s)", 1.0)):
            for q in ("p50", "p90", "p99"):
                ys = [getattr(getattr(p.summary, metric), q) * scale if getattr(p.summary, metric) else float("nan")
                      for p in online]
                ax.plot(rates, ys, marker="o", label=q)
            ax.set_xlabel("offered load (requests / s)")
            ax.set_title(title)
            ax.legend()
        written.append(_save(fig, plot_dir / "latency.png"))
    return written


def _budget_dict(point: OnlinePoint) -> dict[str, Any] | None:
    if point.budget is None:
        return None
    wait_source = wait_budget_s(point.max_wait_ms)[1] if point.max_wait_ms is not None else None
    return {**asdict(point.budget), "max_wait_source": wait_source, "step_source": "tpot_p50"}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog in ("bench.py", "__main__.py"):
        prog = "python -m mqinfer.loadgen.bench"  # what `python -m` leaves in argv[0] is a path
    return " ".join([prog, *sys.argv[1:]])


def _save_json(path: str | None, report: dict[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, target)  # a reader never sees half a file


def machine_info() -> dict[str, Any]:
    """What the figures depend on: processor, cores, matrix extensions, and other load right now."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu" not in info:
            info["cpu"] = value.strip()
        elif key.strip() == "flags" and "flags" not in info:
            flags = value.split()
            info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    return info


def _validate(args: argparse.Namespace) -> str | None:
    if args.mode == "online" and not args.rate:
        return "--mode online needs --rate R (requests per second; several comma-separated for a sweep)"
    if args.mode == "offline" and args.rate:
        return "--rate applies to --mode online only"
    if args.compare_wait and args.mode != "online":
        return "--compare-wait applies to --mode online only"
    if args.compare_wait and args.max_wait_ms is not None:
        return "--compare-wait sets each run's wait; leave out --max-wait-ms"
    if args.skip_engine and not args.compare:
        return "--skip-engine leaves nothing to run without --compare hf"
    if args.workload == "standard" and (args.prompt_len or args.output_len):
        return "the standard workload has fixed lengths; use --workload uniform with --prompt-len/--output-len"
    if args.workload == "shared-prefix" and args.prompt_len:
        return "--prompt-len does not apply to shared-prefix (a fixed prefix plus a random suffix)"
    if args.timeout_s <= 0:
        return "--timeout-s must be > 0"
    if args.idle_exit_s <= 0:
        return "--idle-exit-s must be > 0"
    return _check_plotting(args.plot)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark that ``args`` (from ``add_bench_arguments``) describes; 0 on success."""
    problem = _validate(args)
    if problem:
        print(f"mqinfer bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("mqinfer bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"mqinfer bench: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from mqinfer.loadgen.matrix_rate import compute_ceiling, measure_matmul_rate, workload_flops

    started = time.time()
    spec = resolve_model(args.model)
    requests = make_workload(args.workload, n=args.num_requests, seed=args.seed, vocab_size=spec.vocab_size,
                             max_model_len=spec.max_model_len, prompt_len=args.prompt_len,
                             output_len=args.output_len)
    stats = workload_stats(requests)
    _log(f"workload {args.workload}: {stats.num_requests} requests, {stats.prompt_tokens} prompt tokens, "
         f"{stats.output_tokens} output tokens asked for; model {spec.arg}")
    device = args.device if args.device != "auto" else ("cuda" if _cuda_available() else "cpu")
    mm_dtype = args.dtype if args.dtype != "auto" else str(spec.config.get("torch_dtype") or "float32")
    _log(f"measuring the {mm_dtype} matrix rate on {device}")
    rate_before = measure_matmul_rate(args.matrix_size, dtype=mm_dtype, device=device)
    flops = workload_flops(spec.config, requests)

    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-bench-"))
    report: dict[str, Any] = {
        "date": time.strftime(BENCH_DATE_FORMAT),
        "command": _command_line(),
        "machine": machine_info(),
        "workload": {"name": args.workload, "seed": args.seed, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, **asdict(stats)},
        "model": {"arg": spec.arg, "config": spec.config},
        "mode": args.mode,
        "workers": args.workers,
        "engine_flags": {k: getattr(args, k) for k in ("dtype", "device", "max_num_seqs", "max_num_batched_tokens",
                                                       "num_kv_blocks", "block_size", "max_batch", "max_wait_ms",
                                                       "num_threads")},
        "matrix_rate_before": asdict(rate_before),
        "flops": {**asdict(flops), "total": flops.total, "params_convention": flops.params_convention},
        "systems": {},
    }
    table_rows: list[tuple[str, RunSummary]] = []
    online: list[OnlinePoint] = []
    ours: RunSummary | None = None
    our_outputs: dict[str, list[int]] = {}

    def done(name: str, summary: RunSummary, entry: dict[str, Any]) -> None:
        # Each system's figures are logged and saved as soon as it finishes, so that a long run
        # cut short still leaves what it measured.
        table_rows.append((name, summary))
        report["systems"][name] = entry
        _log(f"{name}: {summary.throughput:.1f} tok/s over {summary.span_s:.1f}s, {summary.num_errors} errors")
        _save_json(args.json, report)

    try:
        if not args.skip_engine:
            run = run_engine(args, spec, requests, scratch)
            ours, online, our_outputs = run.offline, run.online, run.outputs
            if run.overhead is not None:
                report["overhead"] = run.overhead
            if run.half_rate is not None:
                report["rate_half"] = {"offline_req_s": request_rate(run.offline), "rate": run.half_rate}
            if args.compare_wait:
                report["compare_wait"] = args.compare_wait
            if online:
                report["online"] = [{"rate": p.rate, "max_wait_ms": p.max_wait_ms, "summary": p.summary.to_dict(),
                                     "budget": _budget_dict(p), "submit_lag_p99_s": p.submit_lag_p99_s,
                                     "requests": [asdict(t) for t in p.timings]} for p in online]
            if ours is not None:
                done("mqinfer offline", ours, {"summary": ours.to_dict(), "requests": [asdict(t) for t in run.timings]})
            for p in online:
                done(point_name(p, bool(args.compare_wait)), p.summary,
                     {"summary": p.summary.to_dict(), "budget": _budget_dict(p)})
        static_best = continuous = None
        if args.compare == "hf":
            from mqinfer.loadgen import hf_baseline

            folder = hf_folder(spec, scratch)
            _log(f"transformers: loading {folder} in {args.dtype} on {device}")
            model = hf_baseline.load_hf_model(folder, dtype=mm_dtype, device=device)
            hf_baseline.warm_up(model, requests)
            for batch_size in args.hf_batch_sizes:
                r = hf_baseline.run_static(model, requests, batch_size, progress=_log)
                if static_best is None or r.throughput > static_best.throughput:
                    static_best = r
                    report["hf_static_best"] = r.label
                done(r.label, r.summary, r.to_dict())
            _log("transformers continuous batching")
            try:
                continuous = hf_baseline.run_continuous(model, requests, max_batch_tokens=args.hf_max_batch_tokens,
                                                        progress=_log, timeout_s=args.timeout_s)
                done(continuous.label, continuous.summary, continuous.to_dict())
            except (RuntimeError, TimeoutError, ValueError) as exc:
                report["systems"]["hf-continuous"] = {"error": str(exc)}
                _log(f"transformers continuous batching failed: {exc}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    # Measured again at the end and the faster one kept: another process busy on a shared
    # machine during one measurement would otherwise lower the ceiling and flatter every share.
    _log(f"measuring the {mm_dtype} matrix rate again")
    rate_after = measure_matmul_rate(args.matrix_size, dtype=mm_dtype, device=device)
    rate = max(rate_before, rate_after, key=lambda r: r.flops_per_s)
    ceiling = compute_ceiling(flops, rate.flops_per_s)
    report["matrix_rate_after"] = asdict(rate_after)
    report["matrix_rate"] = asdict(rate)
    report["compute_ceiling_tok_s"] = ceiling

    # ---- report
    print(f"mqinfer bench: workload {args.workload} ({stats.num_requests} requests, {stats.prompt_tokens} prompt "
          f"tokens, {stats.output_tokens} output tokens asked for, seed {args.seed}), model {spec.arg}, "
          f"dtype {args.dtype}, mode {args.mode}")
    machine = report["machine"]
    print(f"machine: {machine.get('cpu', '?')}, {machine['cpus']} cpus, "
          f"{' '.join(f for f in machine.get('flags', []) if f.startswith(('amx', 'avx512_bf16'))) or 'no bf16 units'}"
          f"; load average at start {machine['load_average'][0]:.2f}")
    print(format_table(table_rows))
    if "overhead" in report:
        o = report["overhead"]
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in o["phases_s"].items())
        print(f"overhead: {o['outside_forward_share']:.1%} of the workers' busy time ({o['busy_s']:.2f}s) is outside "
              f"the forward pass ({parts})")
    if "rate_half" in report:
        half = report["rate_half"]
        print(f"--rate half: offline throughput {half['offline_req_s']:.3g} req/s, so online at {half['rate']:g} req/s")
    for p in online:
        print(f"{point_name(p, bool(args.compare_wait))}: {budget_line(p)}")
    if args.compare_wait:
        print(format_wait_table(online))
    ratios: dict[str, float] = {}
    if ours is not None and static_best is not None:
        ratios["vs_hf_static_best"] = ours.throughput / static_best.throughput if static_best.throughput else 0.0
        print(f"mqinfer / transformers static batching (best: {static_best.label}): "
              f"{_ratio(ours.throughput, static_best.throughput)}")
    if ours is not None and continuous is not None:
        ratios["vs_hf_continuous"] = ours.throughput / continuous.throughput if continuous.throughput else 0.0
        print(f"mqinfer / transformers continuous batching: {_ratio(ours.throughput, continuous.throughput)}")
    report["ratios"] = ratios
    if our_outputs and static_best is not None:
        agreement = token_agreement(our_outputs, static_best.outputs)
        if agreement is not None:
            report["agreement_vs_hf_static"] = asdict(agreement)
            print(f"greedy agreement with {static_best.label} over {agreement.compared} requests: first token "
                  f"{agreement.first_token:.0%}, identical output {agreement.identical:.0%}, common prefix "
                  f"{agreement.common_prefix:.0%} on average (bf16 near-ties make later tokens differ)")
    print(f"{mm_dtype} matrix rate: {rate.flops_per_s / 1e12:.3f} TFLOP/s ({rate.size}^3 matmul on {rate.device}, "
          f"{rate.threads} threads, best of 5 before and 5 after the runs: {rate_before.flops_per_s / 1e12:.3f} "
          f"and {rate_after.flops_per_s / 1e12:.3f}); workload: {flops.total / 1e12:.3f} TFLOP of matmuls "
          f"({flops.params_convention / 1e12:.3f} counting the embedding table as 2 x params does); "
          f"compute ceiling {ceiling:.0f} tok/s")
    shares = {}
    for name, s in table_rows:
        if s.throughput > 0 and (name == "mqinfer offline" or name.startswith("hf-")):
            shares[name] = s.throughput / ceiling
    if shares:
        print("share of the ceiling: " + ", ".join(f"{n} {v:.1%}" for n, v in shares.items()))
    report["ceiling_share"] = shares
    report["wall_s"] = time.time() - started
    report["load_average_at_end"] = os.getloadavg()

    if args.json:
        _save_json(args.json, report)
        _log(f"figures written to {args.json}")
    if args.plot:
        systems = [(n, s.throughput) for n, s in table_rows if not n.startswith("mqinfer @")]
        for path in write_plots(Path(args.plot), systems, online):
            _log(f"chart written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mqinfer bench",
        description="Benchmark the whole mqinfer pipeline on a synthetic workload, optionally beside "
                    "transformers (--compare hf).")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
