"""The worker loop around the engine, measured on short runs of the real pipeline (`mqinfer plan
--calibrate`'s second part).

The engine's steps alone (calibrate) miss what a `mqinfer worker` does between them. Two
bench runs of a small workload of its own (``PIPELINE_REQUESTS`` requests, one worker with the
planned engine flags) measure it:

1. **Fresh** (the bench's offline mode): the requests wait in the stream while a new worker
   starts; it bills its start-up (its ``startup`` cost row), and its first steps run cold.
2. **Warm** (the bench's online mode, with the worker's step log on: ``MQINFER_LOG_LEVEL=debug``,
   JSON lines): after one warm-up request, the same requests all at once, then at a tenth of what
   the engine alone could serve, so that the worker is often idle when one comes.

From the warm run's step log (each step's start and end, and whether work was left) and its
rows' log lines (written after each flush of result rows):

- ``gap_samples_s``: the time between one step's end and the next one's start while the engine
  had work left and no flush came between (reading the stream, finishing requests, admitting),
  less ``gap_per_finished_s`` for each request the step before it finished and
  ``gap_per_started_s`` for each the step after it started: the two fitted to the gaps (a
  non-negative least-squares fit), so that a loop serving more requests per second than the
  calibration's spends more of its time between steps (measured on the tiny model: 0.66 ms a gap,
  +0.14 ms per request finished, +0.75 ms per request started);
- ``flush_samples_s``: from a step's end to the first row line after it, when rows were flushed
  there (Parquet written, synced and renamed: tens of milliseconds on a shared disk, the largest
  single pause of the loop);
- ``step_noise_by_size``: each logged step's seconds over what the step-cost model gives for its
  shape (the log names its prompt chunks and decode context), in ``NOISE_BINS`` bins of equal
  counts by the modelled seconds. A worker's steps run slower than the same shapes back to back on
  an engine alone, by how much depending on their size (measured on the tiny model, 2 cores, one
  worker at 32 requests/s: 1.05x at the median for steps modelled at 2 ms, 1.14-1.18x from 3.5 to
  10 ms, 1.07x above): between two steps the loop reads the stream, parses, writes and acks, and
  the model's weights no longer sit warm in the caches. Taken when the log holds at least
  ``MIN_STEP_RATIOS`` steps; the simulation then takes a step's factor from its size's bin. A
  step larger than the largest bin's median (``step_noise_top_s``) takes the extra seconds a step
  of that size took, not the same share: the extra is about a fixed time per step, and the
  offline job's large steps ran at the engine-alone speed.
- ``step_noise_series``: the same steps in the order they ran, each as its rank within its bin
  (0 fastest, 1 slowest). A worker's slow steps come in runs (the machine slows down for a while:
  measured at 32 requests/s, the ratio's autocorrelation was 0.61 at a lag of one step and 0.2 at
  fifty), so the simulation walks this series in stretches of ``step_noise_block_steps`` steps
  (slow_period_steps: a few of its correlation times) instead of drawing each step on its own.

Then, simulating the same requests with the same arrival times (several seeds, averaged):
``step_overhead_s`` makes the simulated span of the burst equal the measured one (what the gaps
leave out, such as metering, or a step model off for this process); ``wake_samples_s`` are the
measured queueing delays of the requests that reached an idle worker, less the simulated ones;
``first_step_s`` is how much longer the fresh worker took over the burst than the warm one (0
when that is within FIRST_STEP_NOISE_SHARE of the warm span: noise).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mqinfer.loadgen.plan.model import (
    MAX_SAMPLES, Calibration, StepCostModel, StepShape, WorkerLoop, contention_probes, quantile_samples,
)

# The pipeline runs' own small workload (not the bench's, which check measures against).
PIPELINE_PROMPT_LEN = (16, 160)
PIPELINE_OUTPUT_LEN = (8, 48)
PIPELINE_REQUESTS = 32
PIPELINE_SEED = 1001
# The warm run sends the requests all at once (this rate), then at this share of what the engine
# alone could serve.
PIPELINE_BURST_RATE = 10_000.0
PIPELINE_RATE_SHARE = 0.1
# Simulations of one measured run, with different draws, averaged.
SIM_SEEDS = 5
# Logged steps needed before their spread replaces the engine-alone one, and the bins by size.
MIN_STEP_RATIOS = 50
# Steps that started while k other workers of the machine were in a step, needed before their
# slowdown replaces the engines-alone one for k (pipeline_contention).
MIN_CONTENTION_STEPS = 20
NOISE_BINS = 4
# Gaps next to a finished (or a starting) request needed before the gaps are fitted with a cost
# per request of that kind (gap_costs).
MIN_GAP_REQUESTS = 10
# The simulation walks the series of slow and fast steps in stretches this many correlation times
# long (slow_period_steps), long enough to keep a slow period whole.
SLOW_PERIOD_BLOCKS = 4
# A fresh worker's span over the warm one's within this share of the warm span is noise (two runs of
# a second each on a shared machine), not slow first steps; a GPU's kernel compiles are far above it.
FIRST_STEP_NOISE_SHARE = 0.1
# A worker's row lines start with this (workers/queue/billing.py's finished-request log line).
ROW_LINE = "finished"


def bench_args(*, model: str, workload: str, num_requests: int, seed: int, mode: str, workers: int,
               rates: list[float] | None = None, engine: dict[str, Any] | None = None,
               prompt_len: tuple[int, int] | None = None, output_len: tuple[int, int] | None = None
               ) -> argparse.Namespace:
    """The `mqinfer bench` arguments of one run of ``workers`` worker processes (the bench's defaults
    for everything else; ``engine`` holds worker flags such as num_threads or max_num_seqs)."""
    from mqinfer.loadgen.bench_options import add_bench_arguments

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    argv = ["--model", model, "--workload", workload, "--num-requests", str(num_requests), "--seed", str(seed),
            "--mode", mode, "--workers", str(workers), "--order", "input", "--timeout-s", "900"]
    if prompt_len:
        argv += ["--prompt-len", f"{prompt_len[0]},{prompt_len[1]}"]
    if output_len:
        argv += ["--output-len", f"{output_len[0]},{output_len[1]}"]
    if rates:
        argv += ["--rate", ",".join(f"{r:g}" for r in rates)]
    args = parser.parse_args(argv)
    for name, value in (engine or {}).items():
        setattr(args, name, value)
    return args


def worker_flags(config, calibration: Calibration) -> dict[str, Any]:
    """The bench's worker flags for a worker like the calibrated engine (its KV cache size included)."""
    device = "cuda" if calibration.device.startswith("cuda") else "cpu"
    return {"dtype": config.dtype, "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
            "device": device, "num_threads": calibration.num_threads if device == "cpu" else config.num_threads,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_kv_blocks": calibration.num_kv_blocks, "block_size": config.block_size}


def startup_from_costs(out: Path) -> float | None:
    """The median start-up seconds of the workers that wrote cost rows under ``out`` (their
    ``startup`` rows' device seconds over their device share)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    costs = out / "costs"
    if not costs.exists():
        return None
    table = ds.dataset(costs, format="parquet", partitioning="hive").to_table(filter=pc.field("kind") == "startup")
    if not table.num_rows:
        return None
    shares = (table.column("device_share").to_pylist() if "device_share" in table.schema.names
              else [None] * table.num_rows)
    values = [d / (s or 1.0) for d, s in zip(table.column("device_s").to_pylist(), shares) if d is not None]
    return statistics.median(values) if values else None


# -- the workers' step logs -------------------------------------------------------------------------
@contextmanager
def step_logs() -> Iterator[None]:
    """Workers started inside log every step as a JSON line (their own environment variables)."""
    saved = {k: os.environ.get(k) for k in ("MQINFER_LOG_LEVEL", "MQINFER_LOG_FORMAT")}
    os.environ.update(MQINFER_LOG_LEVEL="debug", MQINFER_LOG_FORMAT="json")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class LoggedStep:
    start: float  # unix seconds
    end: float
    work_left: bool  # requests still running or waiting in the engine after it
    shape: StepShape | None = None  # None in logs that do not name the step's chunks
    finished: int = 0  # requests it finished
    prefills: int = 0  # requests it ran a prompt chunk of


@dataclass
class WorkerTimeline:
    steps: list[LoggedStep]
    row_times: list[float]  # when each row line was logged: just after its flush was durable


def read_timeline(path: Path) -> WorkerTimeline:
    """One worker's steps and row lines from its JSON log (other lines are skipped)."""
    steps, rows = [], []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
            msg = str(record["msg"])
            if msg.startswith("step "):
                step = json.loads(msg[len("step "):])
                end = float(record["ts"])
                steps.append(LoggedStep(end - float(step["step_s"]), end,
                                        bool(step.get("running") or step.get("waiting")), logged_shape(step),
                                        int(step.get("finished", 0)), int(step.get("prefill_requests", 0))))
            elif msg.startswith(ROW_LINE):
                rows.append(float(record["ts"]))
        except (ValueError, KeyError, TypeError):
            continue
    return WorkerTimeline(sorted(steps, key=lambda s: s.start), sorted(rows))


def logged_shape(step: dict[str, Any]) -> StepShape | None:
    """The shape of a logged step: its prompt chunks as logged, one token for each other request,
    and the decode context as logged."""
    chunks, context = step.get("prompt_chunks"), step.get("decode_context")
    if chunks is None or context is None:
        return None
    decode = int(step["requests"]) - len(chunks)
    shape = StepShape.of([(int(n), int(ctx)) for n, ctx in chunks] + [(1, 0)] * decode)
    return dataclasses.replace(shape, decode_context=int(context))


def step_ratios(timeline: WorkerTimeline, since: float, model: StepCostModel) -> list[tuple[float, float, float]]:
    """(start, modelled seconds, logged over modelled seconds) of each logged step from ``since``
    on, in the order they ran."""
    out = []
    for step in timeline.steps:
        if step.start >= since and step.shape is not None:
            modelled = model.step_seconds(step.shape)
            if modelled > 0:
                out.append((step.start, modelled, (step.end - step.start) / modelled))
    return out


def noise_by_size(ratios: list[tuple[float, float, float]], bins: int = NOISE_BINS
                  ) -> tuple[list[float], list[list[float]], float]:
    """(bounds, bins, top): ``ratios`` (step_ratios') split into ``bins`` bins of equal counts by
    modelled seconds, each bin's ratios as quantile samples; the bounds between them (modelled
    seconds); the largest bin's median modelled seconds."""
    ordered = sorted((modelled, ratio) for _, modelled, ratio in ratios)
    cuts = [round(i * len(ordered) / bins) for i in range(bins + 1)]
    groups = [ordered[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    bounds = [group[0][0] for group in groups[1:]]
    top = statistics.median(m for m, _ in groups[-1]) if groups else 0.0
    return bounds, [quantile_samples((r for _, r in group), MAX_SAMPLES // bins) for group in groups], top


def rank_series(ratios: list[tuple[float, float, float]], bounds: list[float],
                by_size: list[list[float]]) -> list[float]:
    """The rank of each of ``ratios`` (step_ratios', in the order the steps ran): where its ratio
    lies among its size bin's samples, 0 the fastest, 1 the slowest (ties count half)."""
    if not by_size:
        return []
    out = []
    for _, modelled, ratio in ratios:
        samples = by_size[bisect.bisect_right(bounds, modelled)]
        below, upto = bisect.bisect_left(samples, ratio), bisect.bisect_right(samples, ratio)
        out.append(round((below + upto) / (2 * len(samples)), 4))
    return out


def slow_period_steps(ranks: list[float]) -> int:
    """How many steps the walk through ``ranks`` (rank_series') stays on one stretch of it:
    SLOW_PERIOD_BLOCKS times the steps' correlation time (the first lag at which the ranks'
    autocorrelation falls below 1/e), at most half the series; 0 when the series is too short to
    say."""
    if len(ranks) < MIN_STEP_RATIOS:
        return 0
    mean = statistics.fmean(ranks)
    centred = [u - mean for u in ranks]
    variance = sum(c * c for c in centred)
    if variance <= 0:
        return 0
    lag = 1
    while lag < len(ranks) // 2:
        if sum(a * b for a, b in zip(centred, centred[lag:])) / variance < math.exp(-1):
            break
        lag += 1
    return min(SLOW_PERIOD_BLOCKS * lag, len(ranks) // 2)


def loop_samples(timeline: WorkerTimeline, since: float) -> tuple[list[float], list[float]]:
    """(gaps, flushes) of one worker from ``since`` on: each gap between a step that left work and
    the next step, when no rows were flushed between; each flush from a step's end to the first row
    line after it (only the first flush after a step: a later one, such as the exit's, follows an
    idle wait)."""
    gaps, flushes, _ = gap_records(timeline, since)
    return gaps, flushes


def gap_records(timeline: WorkerTimeline, since: float) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """loop_samples' gaps and flushes, and for each gap the requests the step before it finished
    and the step after it ran a prompt chunk of."""
    gaps, flushes, counts = [], [], []
    rows = timeline.row_times
    steps = [s for s in timeline.steps if s.start >= since]
    for i, step in enumerate(steps):
        k = bisect.bisect_right(rows, step.end)
        following = steps[i + 1].start if i + 1 < len(steps) else float("inf")
        if k < len(rows) and rows[k] <= following:
            flushes.append(rows[k] - step.end)
        elif step.work_left and i + 1 < len(steps):
            gaps.append(max(0.0, following - step.end))
            counts.append((step.finished, steps[i + 1].prefills))
    return gaps, flushes, counts


def gap_costs(gaps: list[float], counts: list[tuple[int, int]]) -> tuple[list[float], float, float]:
    """(the gaps less their requests' parts, seconds per finished request, seconds per started
    request): a non-negative least-squares fit of each gap as a constant plus a cost for each
    request the step before it finished and each the step after it started. Without enough gaps
    next to requests (MIN_GAP_REQUESTS of each), no cost of that kind: the gaps as they are."""
    from mqinfer.loadgen.plan.model import nnls

    if len(gaps) < 2 * MIN_GAP_REQUESTS:
        return list(gaps), 0.0, 0.0
    columns = [[1.0] * len(gaps)]
    for kind in (0, 1):
        values = [float(c[kind]) for c in counts]
        columns.append(values if sum(1 for v in values if v) >= MIN_GAP_REQUESTS else [0.0] * len(gaps))
    a = np.array(columns, dtype=float).T
    coef = nnls(a, np.array(gaps, dtype=float))
    per_finished, per_started = float(coef[1]), float(coef[2])
    rest = [max(0.0, g - per_finished * f - per_started * p) for g, (f, p) in zip(gaps, counts)]
    return rest, per_finished, per_started


# -- the calibration's pipeline runs ----------------------------------------------------------------
def mean_sim(requests, settings, model, loop: WorkerLoop, seeds: int = SIM_SEEDS, fresh: bool = False):
    """``seeds`` simulations of one worker (seeds 0..seeds-1)."""
    from mqinfer.loadgen.plan.sim import simulate

    return [simulate(requests, 1, settings, model, loop=loop, seed=seed, fresh=fresh) for seed in range(seeds)]


def sim_span(sim) -> float:
    return sim.end_s - min(o.started_s for o in sim.outcomes if o.started_s is not None)


def fit_overhead(burst, measured_span_s: float, settings, calibration: Calibration, loop: WorkerLoop) -> float:
    """The per-step seconds that make the simulated span of ``burst`` the measured one."""
    overhead = 0.0
    floor = -min(loop.gap_samples_s, default=0.0)
    for _ in range(3):  # the steps change a little with the overhead: converge in a few rounds
        sims = mean_sim(burst, settings, calibration.model, dataclasses.replace(loop, step_overhead_s=overhead))
        span = statistics.mean(sim_span(s) for s in sims)
        steps = statistics.mean(s.num_steps for s in sims)
        overhead = max(floor, overhead + (measured_span_s - span) / max(1.0, steps))
    return overhead


def wake_samples(trickle, timings, settings, calibration: Calibration, loop: WorkerLoop) -> list[float]:
    """Measured queueing delays of the requests that reached an idle worker less the simulated ones
    (their mean over the simulations), at least 0."""
    sims = mean_sim(trickle, settings, calibration.model, loop)
    measured = {t.id: t for t in timings}
    out = []
    for k, o in enumerate(sims[0].outcomes):
        if not o.to_idle_worker or o.id not in measured:
            continue
        simulated = statistics.mean(s.outcomes[k].started_s - s.outcomes[k].arrival_s for s in sims)
        m = measured[o.id]
        out.append(max(0.0, (m.started_at - m.enqueued_at) - simulated))
    return sorted(out)


def read_timelines(folder: Path) -> list[WorkerTimeline]:
    """The timelines of every worker that logged under ``folder``."""
    return [read_timeline(path) for path in sorted(folder.rglob("worker-*.log"))]


def machine_speed(timelines: list[WorkerTimeline], since: float, until: float, calibration: Calibration
                  ) -> float | None:
    """How much slower than at calibration the workers' steps ran between ``since`` and ``until``:
    the median over their logged steps of logged seconds over what the calibration expects of a
    worker's step of that shape (the step model times the median of its size bin's spread); None
    without logged steps."""
    loop = calibration.loop
    medians: dict[int, float] = {}  # by the spread's identity: each bin's median taken once
    ratios = []
    for timeline in timelines:
        for start, modelled, ratio in step_ratios(timeline, since, calibration.model):
            if start > until:
                break
            spread = loop.noise_for(modelled)
            if not spread:
                ratios.append(ratio)
                continue
            if id(spread) not in medians:
                medians[id(spread)] = statistics.median(spread)
            ratios.append(ratio / loop.scaled_noise(medians[id(spread)], modelled))
    return statistics.median(ratios) if ratios else None


def logged_samples(folder: Path, since: float, model: StepCostModel
                   ) -> tuple[list[float], list[float], list[tuple[float, float, float]]]:
    """(gaps, flushes, step ratios, each gap's requests) from the step logs of the workers that ran
    in ``folder``, from ``since`` on (gap_records', step_ratios')."""
    gaps, flushes, ratios, counts = [], [], [], []
    for timeline in read_timelines(folder):
        g, f, c = gap_records(timeline, since)
        gaps += g
        flushes += f
        counts += c
        ratios += step_ratios(timeline, since, model)
    return gaps, flushes, ratios, counts


def contention_ratios(timelines: list[WorkerTimeline], since: float, model: StepCostModel, bounds: list[float],
                      by_size: list[list[float]]) -> dict[int, list[float]]:
    """Each logged step of several workers sharing a machine, over a lone worker's step of its size
    (the median of its size bin), grouped by how many of the other workers were in a step when it
    started."""
    busy = [[(s.start, s.end) for s in t.steps if s.start >= since] for t in timelines]
    lone = [statistics.median(samples) for samples in by_size]
    out: dict[int, list[float]] = {}
    for i, timeline in enumerate(timelines):
        for start, modelled, ratio in step_ratios(timeline, since, model):
            others = 0
            for j, steps in enumerate(busy):
                k = bisect.bisect_right(steps, (start, float("inf"))) - 1
                others += j != i and k >= 0 and steps[k][0] <= start < steps[k][1]
            out.setdefault(others, []).append(ratio / lone[bisect.bisect_right(bounds, modelled)])
    return out


def pipeline_contention(config, calibration: Calibration, run: Callable[[int, Path], Any], scratch: Path,
                        bounds: list[float], by_size: list[list[float]],
                        progress: Callable[[str], None]) -> list[float]:
    """How much slower a worker's step runs while k others of its machine are in a step, measured
    with every worker of the machine serving the same burst through the real pipeline (Redis, the
    producer and the result writers share the cores too, which engines alone beside each other do
    not show): for each k seen in at least MIN_CONTENTION_STEPS steps, the median of those steps
    over a lone worker's; for another k, the engines-alone factor (``calibration.contention``). At
    least 1 each. Empty where one worker has the machine."""
    most = contention_probes(config)
    if most < 1 or not by_size:
        return list(calibration.contention)
    progress(f"calibration: {most + 1} warmed-up workers sharing this machine: the same requests at once")
    with step_logs():
        at_once = run(most + 1, scratch / "shared")
    since = min(t.enqueued_at for t in at_once.timings)
    ratios = contention_ratios(read_timelines(scratch / "shared"), since, calibration.model, bounds, by_size)
    probed = list(calibration.contention) or [1.0] * most
    factors = [max(1.0, statistics.median(ratios[k]) if len(ratios.get(k, ())) >= MIN_CONTENTION_STEPS
                   else probed[min(k, len(probed)) - 1]) for k in range(1, most + 1)]
    progress("calibration: in the pipeline, a step beside busy workers takes " + ", ".join(
        f"{f:.2f}x ({k} other{'s' if k > 1 else ''}, {len(ratios.get(k, ()))} steps)"
        for k, f in enumerate(factors, 1)))
    return factors


def warm_loop(gaps: list[float], flushes: list[float], ratios: list[tuple[float, float, float]],
              step_noise: list[float], noise: tuple[list[float], list[list[float]], float], **costs: float
              ) -> WorkerLoop:
    """The worker loop of the warm run's samples: its gaps (their requests' parts taken out) and
    flushes, its steps' spread by size (``noise``: noise_by_size's) walked in the order the steps
    ran where slow steps came in runs, and the per-request gap ``costs``."""
    bounds, by_size, top = noise
    series = rank_series(sorted(ratios), bounds, by_size)
    block = slow_period_steps(series)
    return WorkerLoop(0.0, quantile_samples(gaps), (), quantile_samples(flushes), step_noise,
                      step_noise_bounds_s=bounds, step_noise_by_size=by_size,
                      step_noise_series=series if block else (), step_noise_block_steps=block,
                      step_noise_top_s=top, **costs)


def measure_pipeline(config, calibration: Calibration, *, progress: Callable[[str], None]) -> Calibration:
    """``calibration`` with the worker's start-up and loop (see the module's description) measured
    on short runs of the real pipeline with one worker."""
    from mqinfer.loadgen.bench_engine import run_engine
    from mqinfer.loadgen.bench_model import resolve_model
    from mqinfer.loadgen.bench_online import poisson_arrivals
    from mqinfer.loadgen.plan.sim import SimRequest, WorkerSettings, simulate
    from mqinfer.loadgen.workload import make_workload
    from mqinfer.scheduler.config import SchedulerConfig

    model_arg = str(config.model)
    spec = resolve_model(model_arg)
    settings = WorkerSettings(SchedulerConfig(
        block_size=calibration.block_size, num_kv_blocks=calibration.num_kv_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=calibration.max_model_len))
    reqs = make_workload("uniform", n=PIPELINE_REQUESTS, seed=PIPELINE_SEED, vocab_size=spec.vocab_size,
                         max_model_len=spec.max_model_len, prompt_len=PIPELINE_PROMPT_LEN,
                         output_len=PIPELINE_OUTPUT_LEN, min_token_id=spec.min_token_id)

    def sim_requests(arrivals: list[float]) -> list[SimRequest]:
        return [SimRequest(r["id"], tuple(r["prompt_token_ids"]), int(r["max_tokens"]), arrival_s=float(a))
                for r, a in zip(reqs, arrivals)]

    # The low rate from the engine alone (the loop only lowers the capacity, keeping it low).
    burst = simulate(sim_requests([0.0] * len(reqs)), 1, settings, calibration.model)
    low_rate = float(f"{PIPELINE_RATE_SHARE * len(reqs) / max(1e-9, sim_span(burst)):.3g}")
    common = dict(model=model_arg, workload="uniform", num_requests=len(reqs), seed=PIPELINE_SEED, workers=1,
                  engine=worker_flags(config, calibration), prompt_len=PIPELINE_PROMPT_LEN,
                  output_len=PIPELINE_OUTPUT_LEN)
    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-plan-calibration-"))
    try:
        progress(f"calibration: the real pipeline, one fresh worker: {len(reqs)} requests waiting")
        fresh = run_engine(bench_args(mode="offline", **common), spec, reqs, scratch / "fresh")
        startup = startup_from_costs(scratch / "fresh" / "out")
        progress(f"calibration: one warmed-up worker: the same requests at once, then at {low_rate:g} requests/s")
        with step_logs():
            at_once, trickle = run_engine(bench_args(mode="online", rates=[PIPELINE_BURST_RATE, low_rate], **common),
                                          spec, reqs, scratch / "warm").online
        gaps, flushes, ratios, counts = logged_samples(scratch / "warm", min(t.enqueued_at for t in at_once.timings),
                                                       calibration.model)
        bounds, by_size, top = noise_by_size(ratios) if len(ratios) >= MIN_STEP_RATIOS else ([], [], 0.0)
        contention = pipeline_contention(config, calibration, lambda n, path: run_engine(
            bench_args(mode="online", rates=[PIPELINE_BURST_RATE], **{**common, "workers": n}), spec, reqs,
            path).online[0], scratch, bounds, by_size, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rest, per_finished, per_started = gap_costs(gaps, counts)
    loop = warm_loop(rest, flushes, ratios, calibration.step_noise, (bounds, by_size, top),
                     gap_per_finished_s=per_finished, gap_per_started_s=per_started)
    # The bench gives online point k the arrivals of seed + k.
    overhead = fit_overhead(sim_requests(poisson_arrivals(len(reqs), PIPELINE_BURST_RATE, PIPELINE_SEED)),
                            at_once.summary.span_s, settings, calibration, loop)
    loop = dataclasses.replace(loop, step_overhead_s=overhead)
    wakes = wake_samples(sim_requests(poisson_arrivals(len(reqs), low_rate, PIPELINE_SEED + 1)), trickle.timings,
                         settings, calibration, loop)
    excess = fresh.offline.span_s - at_once.summary.span_s
    first_step = excess if excess > FIRST_STEP_NOISE_SHARE * at_once.summary.span_s else 0.0
    progress(f"calibration: worker start-up {startup if startup is not None else float('nan'):.2f}s; between "
             f"steps {1000 * statistics.median(rest or [0.0]):.2f} ms (median of {len(gaps)}) "
             f"{1000 * overhead:+.2f} ms, +{1000 * per_finished:.2f} ms per request finished and "
             f"+{1000 * per_started:.2f} ms per request started; {len(flushes)} flushes of rows, median "
             f"{1000 * statistics.median(flushes or [0.0]):.1f} ms; a worker's steps "
             f"{'/'.join(f'{statistics.median(b):.2f}' for b in by_size) or '-'}x the engine alone's by size "
             f"({len(ratios)} steps); wake-up on an arrival "
             f"{1000 * statistics.median(wakes or [0.0]):.1f} ms (median of {len(wakes)}); a fresh worker's first "
             f"steps +{1000 * first_step:.0f} ms")
    out = dataclasses.replace(calibration, gap_samples_s=list(loop.gap_samples_s), step_overhead_s=overhead,
                              step_noise_bounds_s=list(bounds), step_noise_by_size=[list(b) for b in by_size],
                              step_noise_series=list(loop.step_noise_series),
                              step_noise_block_steps=loop.step_noise_block_steps,
                              step_noise_top_s=loop.step_noise_top_s, gap_per_finished_s=per_finished,
                              gap_per_started_s=per_started, flush_samples_s=list(loop.flush_samples_s),
                              wake_samples_s=quantile_samples(wakes), first_step_s=first_step, contention=contention)
    if startup is not None:
        out = dataclasses.replace(out, startup_s=startup, startup_source="worker")
    return out
