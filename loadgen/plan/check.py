"""How far `mqinfer plan` is from the real pipeline: its predictions and `mqinfer bench`'s measurements
of the same requests, side by side, and whether the worker count it picks for an SLO is the one the
pipeline needs.

    python -m mqinfer.loadgen.plan.check [--model tiny] [--workload standard] [--num-requests 128]
                                         [--online-requests 300] [--workers 1] [--num-threads 1]
                                         [--device cpu|cuda] [--rates auto|R,R,R] [--repeats R] [--calibrate]
                                         [--workers-check] [--check-rate QPS] [--check-slo-ms MS]

**Accuracy.** For one workload it runs, through the real pipeline (an embedded server, ``mqinfer
worker`` processes, the result rows: the bench's offline and online modes), an offline bulk run of
``--num-requests`` and an online run of ``--online-requests`` at three rates, and simulates the same
requests with the same worker count and the same arrival times (those the rows measured: when each
entry entered the stream) with the plan's calibrated step-cost model and worker loop (calibrated
first when this machine has no stored fit, or with ``--calibrate``). A prediction is the mean over
PREDICTION_SEEDS simulations with different draws of the loop's measured delays. It prints, for
each case, the measured and predicted output tokens per second and p99 TTFT and their relative
errors ((predicted - measured) / measured). The rates (``auto``) are 20%, 50% and 80% of the
request rate the offline run measured; ``--repeats R`` runs each rate R times (in turn across the
rates) and compares the p99 TTFT of all a rate's requests together (the simulations' likewise)
and the medians of the other figures. Each online row also shows the 10th-90th percentile of the
simulations' p99s (a p99 of a few hundred requests is itself a noisy figure: the range one run's
p99 falls in four times in five if the model is right) and how many measured runs lay in their own
range, and the p99 predicted with every step 5% faster and 5% slower (`mqinfer plan`'s band) and
whether the measured p99 lies in it. The online runs' workers log their steps, and each run
also says how much slower than at calibration its steps ran (their logged time over what the
calibration expects of a worker's step of that shape, the median) and the p99 predicted with
every step that much slower: what is left between that and the measured p99 is the model's, the
rest is the machine's speed moving since the calibration. In the offline run the requests wait
in the stream while the workers start, so its TTFT is counted from the first request's start on
both sides (start-up is the plan's separate figure), and the simulated workers are fresh (their
first steps cold).

**Worker count** (``--workers-check``). `mqinfer plan --rate R --slo-ttft-p99-ms S` on the online
workload picks N workers; the real pipeline then runs the same requests at R with N-1 and N workers.
The plan is right when N-1 workers miss the SLO and N meet it. Without ``--check-rate`` R is 90% of
what one worker finished per second in the simulated bulk run; without ``--check-slo-ms`` S is the
geometric mean of the plan's p99 TTFT at 1 and 2 workers (so the plan asks for 2, and each side of
the check holds unless the prediction is off by that ratio). With ``--repeats R`` each count runs R
times, the counts in turn, and its p99 is that of all its runs' requests together.

Workers, batcher and engine settings are the defaults of `mqinfer worker` except the worker count
and threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.metrics import RequestTiming, percentile
from mqinfer.loadgen.plan.command import SPEED_DRIFT

AUTO_RATE_SHARES = (0.2, 0.5, 0.8)
# Simulations (different draws of the loop's delays and the steps' slowness) averaged into one
# prediction. A simulated p99 over a few hundred requests spreads by 15-20% (one standard
# deviation) from one seed to the next near saturation, as a measured one does between runs: the
# prediction is their mean, and the 10th-90th percentile of the seeds' p99s is the range one run's
# p99 falls in four times out of five if the model is right. The band at +-SPEED_DRIFT takes fewer.
PREDICTION_SEEDS = 20
BAND_SEEDS = 8
# The worker-count check's default rate: this share of one worker's simulated bulk request rate.
CHECK_RATE_SHARE = 0.9


_POOLED_FIELDS = ("measured_ttfts_s", "predicted_ttfts_s", "band_ttfts_s", "at_speed_ttfts_s")


@dataclass
class CheckRow:
    case: str
    workers: int
    measured_tok_s: float
    predicted_tok_s: float
    measured_ttft_p99_s: float | None
    predicted_ttft_p99_s: float | None
    # With --repeats R: each run's measured p99 TTFT (see rate_row for the row's own figures).
    measured_ttft_p99_runs_s: list[float] | None = None
    # Online: the predicted p99 TTFT with every step SPEED_DRIFT faster and slower (`mqinfer plan`'s
    # band), [faster, slower].
    predicted_ttft_p99_band_s: list[float] | None = None
    # The 10th and 90th percentiles of the simulated runs' p99 TTFTs (see PREDICTION_SEEDS); with
    # --repeats, the medians of each run's, and how many runs' measured p99 lay in their own.
    predicted_ttft_p99_spread_s: list[float] | None = None
    runs_in_spread: int | None = None
    # With --repeats R: the medians of the runs' measured and predicted p99s (the row's own p99s
    # are then those of every run's requests together).
    ttft_p99_medians_s: list[float | None] | None = None
    # Every TTFT behind the row's p99s: each request's, measured, and each simulated request's over
    # all the simulations (not written to JSON).
    measured_ttfts_s: list[float] | None = field(default=None, repr=False)
    predicted_ttfts_s: list[float] | None = field(default=None, repr=False)
    band_ttfts_s: list[list[float]] | None = field(default=None, repr=False)  # [faster, slower]
    # Online: how much slower than at calibration the worker's steps ran during the run (each run's,
    # in order), and the p99 TTFT predicted with every step that much slower (over a rate's runs,
    # that of all their simulated requests together).
    run_speeds: list[float] | None = None
    predicted_ttft_p99_at_speed_s: float | None = None
    at_speed_ttfts_s: list[float] | None = field(default=None, repr=False)

    @property
    def in_band(self) -> bool | None:
        return _within(self.predicted_ttft_p99_band_s, self.measured_ttft_p99_s)

    @property
    def in_spread(self) -> bool | None:
        return _within(self.predicted_ttft_p99_spread_s, self.measured_ttft_p99_s)

    @property
    def tok_s_error(self) -> float | None:
        return _rel(self.predicted_tok_s, self.measured_tok_s)

    @property
    def ttft_error(self) -> float | None:
        return _rel(self.predicted_ttft_p99_s, self.measured_ttft_p99_s)

    def to_dict(self) -> dict[str, Any]:
        figures = {k: v for k, v in asdict(self).items() if k not in _POOLED_FIELDS}
        return {**figures, "tok_s_error": self.tok_s_error, "ttft_p99_error": self.ttft_error,
                "measured_in_band": self.in_band, "measured_in_spread": self.in_spread}


def _within(bounds: list[float] | None, measured: float | None) -> bool | None:
    """Whether ``measured`` lies in [low, high] (None when either is missing)."""
    if not bounds or measured is None:
        return None
    return bounds[0] <= measured <= bounds[1]


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def _ttft_p99(values: list[float]) -> float | None:
    values = sorted(values)
    return percentile(values, 99) if values else None


def measured_ttfts(timings: list[RequestTiming], from_first_start: bool) -> list[float]:
    ok = [t for t in timings if t.ok and t.first_token_at is not None]
    if not ok:
        return []
    if from_first_start:
        origin = min(t.started_at for t in ok)
        return [t.first_token_at - max(t.enqueued_at, origin) for t in ok]
    return [t.ttft for t in ok]


def measured_ttft_p99(timings: list[RequestTiming], from_first_start: bool) -> float | None:
    return _ttft_p99(measured_ttfts(timings, from_first_start))


def measured_arrivals(requests: list[dict[str, Any]], timings: list[RequestTiming]) -> list[float]:
    """When each request entered the stream, in seconds from the first (in ``requests``' order)."""
    by_id = {t.id: t.enqueued_at for t in timings}
    first = min(by_id.values())
    return [by_id[r["id"]] - first for r in requests]


@dataclass
class Prediction:
    """The plan's simulations of one run: output tokens per second and p99 TTFT (means over the
    simulations), each simulation's p99 TTFT (sorted), and every simulated request's TTFT."""

    tok_s: float
    ttft_p99_s: float | None
    p99s: list[float]
    ttfts: list[float]


def predicted(requests: list[dict[str, Any]], arrivals: list[float], workers: int, settings, calibration, *,
              from_first_start: bool, fresh: bool = False, speed: float = 1.0,
              seeds: int = PREDICTION_SEEDS) -> Prediction:
    """The plan's ``seeds`` simulations of ``requests`` arriving at ``arrivals``; ``speed``: every
    step that many times as long."""
    from mqinfer.loadgen.plan.command import summarize
    from mqinfer.loadgen.plan.sim import SimRequest, simulate

    sim_requests = [SimRequest(r["id"], tuple(r["prompt_token_ids"]), int(r["max_tokens"]), arrival_s=float(a))
                    for r, a in zip(requests, arrivals)]
    tok_s, p99s, pooled = [], [], []
    for seed in range(seeds):
        sim = simulate(sim_requests, workers, settings, calibration.model.scaled(speed), loop=calibration.loop,
                       seed=seed, fresh=fresh)
        tok_s.append(summarize(sim).output_tokens_per_s)
        done = [o for o in sim.outcomes if o.error is None and o.first_token_s is not None]
        origin = min((o.started_s for o in done if o.started_s is not None), default=0.0)
        ttfts = [o.first_token_s - (max(o.arrival_s, origin) if from_first_start else o.arrival_s) for o in done]
        if ttfts:
            p99s.append(_ttft_p99(ttfts))
        pooled += ttfts
    p99s.sort()
    return Prediction(statistics.mean(tok_s), statistics.mean(p99s) if p99s else None, p99s, pooled)


def spread_of(p99s: list[float]) -> list[float] | None:
    """The 10th and 90th percentiles of simulated runs' p99s (sorted)."""
    return [percentile(p99s, 10), percentile(p99s, 90)] if len(p99s) >= 2 else None


def format_table(rows: list[CheckRow]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    def bounds(pair: list[float] | None, inside: str) -> str:
        return "-" if not pair else f"{ms(pair[0])}-{ms(pair[1])} {inside}"

    def band(r: CheckRow) -> str:
        return bounds(r.predicted_ttft_p99_band_s, "in" if r.in_band else "out")

    def spread(r: CheckRow) -> str:
        inside = (f"{r.runs_in_spread}/{len(r.measured_ttft_p99_runs_s or ())} in" if r.runs_in_spread is not None
                  else "in" if r.in_spread else "out")
        return bounds(r.predicted_ttft_p99_spread_s, inside)

    head = (f"{'case':<26} {'workers':>7} {'tok/s meas':>11} {'tok/s pred':>11} {'error':>8} "
            f"{'p99 TTFT ms meas':>17} {'pred':>8} {'error':>8}  {'pred runs p10-p90':<20} "
            f"{f'pred at +-{100 * SPEED_DRIFT:g}% speed':<20}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:<26} {r.workers:>7} {r.measured_tok_s:>11.1f} {r.predicted_tok_s:>11.1f} "
                     f"{pct(r.tok_s_error):>8} {ms(r.measured_ttft_p99_s):>17} {ms(r.predicted_ttft_p99_s):>8} "
                     f"{pct(r.ttft_error):>8}  {spread(r):<20} {band(r):<20}")
    spread = [r for r in rows if r.measured_ttft_p99_runs_s]
    if spread:
        pooled = any(r.ttft_p99_medians_s for r in spread)

        def runs_text(r: CheckRow) -> str:
            text = f"{r.case.split(',')[0]}: {', '.join(ms(v) for v in r.measured_ttft_p99_runs_s)}"
            if r.ttft_p99_medians_s:
                measured, predicted = r.ttft_p99_medians_s
                text += f" (median {ms(measured)}, predicted {ms(predicted)})"
            return text

        lines.append(("(over a rate's runs: the p99 TTFT of all their requests together, medians of the rest; "
                      if pooled else "(medians over the runs; ")
                     + "each run's measured p99 TTFT, ms: " + "; ".join(runs_text(r) for r in spread) + ")")
    timed = [r for r in rows if r.run_speeds]
    if timed:
        lines.append("the worker's steps over the calibration's, in each run; the p99 TTFT predicted with every step "
                     "that much slower: " + "; ".join(
                         f"{r.case.split(',')[0]}: {', '.join(f'{v:.3f}' for v in r.run_speeds)}x, "
                         f"{ms(r.predicted_ttft_p99_at_speed_s)} ms "
                         f"({pct(_rel(r.predicted_ttft_p99_at_speed_s, r.measured_ttft_p99_s))})" for r in timed))
    return "\n".join(lines)


@dataclass
class Setup:
    """What both checks share: the plan's flags, the calibration and the workers' settings."""

    opts: dict[str, Any]
    calibration: Any
    path: Path
    settings: Any
    spec: Any
    flags: dict[str, Any]  # the bench's worker flags


def setup(ns: argparse.Namespace) -> Setup:
    from mqinfer.loadgen.bench_model import resolve_model
    from mqinfer.loadgen.plan.command import calibration_path, engine_config, get_calibration, worker_layout, worker_settings
    from mqinfer.loadgen.plan.model import load_calibration
    from mqinfer.loadgen.plan.options import PLAN_CMD
    from mqinfer.loadgen.plan.pipeline import worker_flags

    opts = {o.name: o.default for o in PLAN_CMD}
    opts.update(model=ns.model, num_threads=ns.num_threads if ns.device == "cpu" else None, device=ns.device,
                workers=ns.workers)
    layout = worker_layout(opts)
    stored = load_calibration(calibration_path(opts, layout))
    calibration, path = get_calibration(opts, layout, calibrate=ns.calibrate or stored is None, progress=log)
    flags = {**worker_flags(engine_config(opts), calibration), "num_kv_blocks": None}
    return Setup(opts, calibration, path, worker_settings(opts, calibration), resolve_model(ns.model), flags)


def _workload(ns: argparse.Namespace, s: Setup, n: int) -> list[dict[str, Any]]:
    from mqinfer.loadgen.workload import make_workload

    return make_workload(ns.workload, n=n, seed=ns.seed, vocab_size=s.spec.vocab_size,
                         max_model_len=s.spec.max_model_len, min_token_id=s.spec.min_token_id)


def accuracy(ns: argparse.Namespace, s: Setup, scratch: Path) -> list[CheckRow]:
    """The offline run and the online runs at three rates, measured and predicted."""
    from mqinfer.loadgen.bench_engine import run_engine
    from mqinfer.loadgen.bench_online import request_rate, unshared_prompts
    from mqinfer.loadgen.plan.pipeline import bench_args, machine_speed, read_timelines, step_logs

    common = dict(model=ns.model, workload=ns.workload, seed=ns.seed, workers=ns.workers, engine=s.flags)
    requests = _workload(ns, s, ns.num_requests)
    offline = run_engine(bench_args(mode="offline", num_requests=len(requests), **common), s.spec, requests,
                         scratch / "offline")
    bulk = predicted(requests, [0.0] * len(requests), ns.workers, s.settings, s.calibration, from_first_start=True,
                     fresh=True)
    rows = [CheckRow("offline bulk", ns.workers, offline.offline.throughput, bulk.tok_s,
                     measured_ttft_p99(offline.timings, from_first_start=True), bulk.ttft_p99_s)]
    log(format_table(rows))
    if ns.rates == "auto":
        rates = [float(f"{request_rate(offline.offline) * share:.3g}") for share in AUTO_RATE_SHARES]
    else:
        rates = ns.rates
    requests = _workload(ns, s, ns.online_requests)
    # Repeats go round the rates (r1 r2 r3 r1 r2 r3 ...), so that the machine's drift meets every rate.
    with step_logs():
        online = run_engine(bench_args(mode="online", rates=rates * ns.repeats, num_requests=len(requests),
                                       **common), s.spec, requests, scratch / "online")
    timelines = read_timelines(scratch / "online")
    runs: dict[float, list[CheckRow]] = {}
    for k, point in enumerate(online.online):
        # The bench salts each point's prompts (no prefix shared between points): the same here.
        salted = unshared_prompts(requests, k, s.spec.vocab_size, s.spec.min_token_id)
        arrivals = measured_arrivals(salted, point.timings)
        sim = predicted(salted, arrivals, ns.workers, s.settings, s.calibration, from_first_start=False)
        band = [predicted(salted, arrivals, ns.workers, s.settings, s.calibration, from_first_start=False,
                          speed=1.0 + sign * SPEED_DRIFT, seeds=BAND_SEEDS) for sign in (-1, 1)]
        band_p99s = [b.ttft_p99_s for b in band]
        measured = measured_ttfts(point.timings, from_first_start=False)
        row = CheckRow(f"online {point.rate:g} req/s", ns.workers, point.summary.throughput, sim.tok_s,
                       _ttft_p99(measured), sim.ttft_p99_s,
                       predicted_ttft_p99_band_s=None if None in band_p99s else band_p99s,
                       predicted_ttft_p99_spread_s=spread_of(sim.p99s), measured_ttfts_s=measured,
                       predicted_ttfts_s=sim.ttfts, band_ttfts_s=[b.ttfts for b in band])
        speed = machine_speed(timelines, min(t.enqueued_at for t in point.timings),
                              max(t.finished_at for t in point.timings), s.calibration)
        if speed is not None:
            at_speed = predicted(salted, arrivals, ns.workers, s.settings, s.calibration, from_first_start=False,
                                 speed=speed, seeds=BAND_SEEDS)
            row.run_speeds, row.predicted_ttft_p99_at_speed_s = [speed], at_speed.ttft_p99_s
            row.at_speed_ttfts_s = at_speed.ttfts
        runs.setdefault(point.rate, []).append(row)
    return rows + [rate_row(group) for group in runs.values()]


def rate_row(runs: list[CheckRow]) -> CheckRow:
    """One rate's row over its repeated runs: the p99 TTFT of every run's requests together,
    measured and simulated (where the runs carry them; else the medians of the runs' p99s), the
    medians of the other figures, and each run's measured p99 (alone when there was one run).

    A p99 of 300 requests rests on its three slowest: one run's moves by a fifth between runs near
    saturation, so the runs' requests are pooled before the percentile is taken, on both sides."""
    if len(runs) == 1:
        return runs[0]

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    first = runs[0]
    measured = [r.measured_ttft_p99_s for r in runs]

    def medians(pairs: list[list[float] | None]) -> list[float] | None:
        present = [p for p in pairs if p]
        return [median([p[0] for p in present]), median([p[1] for p in present])] if present else None

    def pooled(per_run: list[list[float] | None], otherwise: Any) -> Any:
        """The p99 of every run's values together, or ``otherwise`` where a run has none."""
        return _ttft_p99([t for values in per_run for t in values]) if all(per_run) else otherwise

    medians_s = [median(measured), median([r.predicted_ttft_p99_s for r in runs])]
    measured_p99 = pooled([r.measured_ttfts_s for r in runs], medians_s[0])
    predicted_p99 = pooled([r.predicted_ttfts_s for r in runs], medians_s[1])
    band = medians([r.predicted_ttft_p99_band_s for r in runs])
    if all(r.band_ttfts_s for r in runs):
        band = [pooled([r.band_ttfts_s[k] for r in runs], None) for k in (0, 1)]
    if not all(r.measured_ttfts_s and r.predicted_ttfts_s for r in runs):
        medians_s = None  # the row's own p99s are the medians already
    speeds = [v for r in runs for v in (r.run_speeds or ())]
    at_speed = pooled([r.at_speed_ttfts_s for r in runs], median([r.predicted_ttft_p99_at_speed_s for r in runs]))
    return CheckRow(f"{first.case}, {len(runs)} runs", first.workers, median([r.measured_tok_s for r in runs]),
                    median([r.predicted_tok_s for r in runs]), measured_p99, predicted_p99,
                    measured_ttft_p99_runs_s=[m for m in measured if m is not None],
                    predicted_ttft_p99_band_s=band,
                    predicted_ttft_p99_spread_s=medians([r.predicted_ttft_p99_spread_s for r in runs]),
                    runs_in_spread=sum(1 for r in runs if r.in_spread), ttft_p99_medians_s=medians_s,
                    run_speeds=speeds or None, predicted_ttft_p99_at_speed_s=at_speed)


def workers_check(ns: argparse.Namespace, s: Setup, scratch: Path) -> dict[str, Any]:
    """`mqinfer plan`'s worker count for an SLO, and the real pipeline at one fewer and at that count."""
    from mqinfer.loadgen.bench_engine import run_engine
    from mqinfer.loadgen.plan.command import make_plan, summarize
    from mqinfer.loadgen.plan.pipeline import bench_args
    from mqinfer.loadgen.plan.sim import SimRequest, simulate

    requests = _workload(ns, s, ns.online_requests)
    rate = ns.check_rate
    if rate is None:
        bulk = summarize(simulate([SimRequest(r["id"], tuple(r["prompt_token_ids"]), int(r["max_tokens"]))
                                   for r in requests], 1, s.settings, s.calibration.model, loop=s.calibration.loop,
                                  fresh=False))
        rate = float(f"{CHECK_RATE_SHARE * bulk.num_requests / bulk.end_s:.3g}")
    opts = {**s.opts, "workload": ns.workload, "num_requests": len(requests), "seed": ns.seed, "rate": rate,
            "workers": "auto", "calibrate": False}
    slo_ms = ns.check_slo_ms
    if slo_ms is None:
        at = {n: make_plan({**opts, "workers": n}, None, progress=lambda _: None)["ttft_p99_s"] for n in (1, 2)}
        slo_ms = float(f"{1000 * math.sqrt(at[1] * at[2]):.3g}")
    plan = make_plan({**opts, "slo_ttft_p99_ms": slo_ms}, None, progress=lambda _: None)
    needed = plan["workers"]
    predicted_p99 = {e["workers"]: e["ttft_p99_s"] for e in plan["search"]}
    counts = [n for n in (needed - 1, needed) if n >= 1]
    # Each count runs --repeats times, the counts in turn (so that the machine's drift meets both),
    # fresh workers each time; a count's p99 is that of all its runs' requests together, as in the
    # accuracy rows (one run's p99 rests on its three slowest requests).
    ttfts: dict[int, list[float]] = {n: [] for n in counts}
    run_p99s: dict[int, list[float]] = {n: [] for n in counts}
    for attempt in range(ns.repeats):
        for n in counts:
            run = run_engine(bench_args(mode="online", rates=[rate], num_requests=len(requests), model=ns.model,
                                        workload=ns.workload, seed=ns.seed, workers=n, engine=s.flags),
                             s.spec, requests, scratch / f"check-{n}-{attempt}")
            values = measured_ttfts(run.online[0].timings, from_first_start=False)
            ttfts[n] += values
            run_p99s[n].append(_ttft_p99(values))
            log(f"workers check: {n} worker(s) at {rate:g} req/s, run {attempt + 1} of {ns.repeats}: "
                f"p99 TTFT {1000 * run_p99s[n][-1]:.1f} ms (SLO {slo_ms:g} ms)")
    measured = {n: _ttft_p99(values) for n, values in ttfts.items()}
    fewer_misses = needed - 1 not in measured or measured[needed - 1] > slo_ms / 1000
    agrees = plan["target"]["met"] and fewer_misses and measured[needed] <= slo_ms / 1000
    return {"rate": rate, "slo_ttft_p99_ms": slo_ms, "workers_planned": needed,
            "predicted_ttft_p99_s": {str(n): predicted_p99.get(n) for n in measured},
            "measured_ttft_p99_s": {str(n): v for n, v in measured.items()},
            "measured_ttft_p99_runs_s": {str(n): v for n, v in run_p99s.items()}, "agrees": agrees}


def format_workers_check(c: dict[str, Any]) -> str:
    n = c["workers_planned"]
    parts = [f"workers check at {c['rate']:g} req/s, SLO p99 TTFT <= {c['slo_ttft_p99_ms']:g} ms: the plan asks "
             f"for {n} worker(s)"]
    for k, value in c["measured_ttft_p99_s"].items():
        pred = c["predicted_ttft_p99_s"].get(k)
        runs = c.get("measured_ttft_p99_runs_s", {}).get(k, [])
        each = f" (each run's: {', '.join(f'{1000 * v:.1f}' for v in runs)})" if len(runs) > 1 else ""
        parts.append(f"  {k} worker(s): measured p99 {1000 * value:.1f} ms{each} "
                     f"({'meets' if value <= c['slo_ttft_p99_ms'] / 1000 else 'misses'}), predicted "
                     + ("-" if pred is None else f"{1000 * pred:.1f} ms"))
    wanted = f"{n - 1} worker(s) missing the SLO and {n} meeting it" if n > 1 else f"{n} worker(s) meeting the SLO"
    parts.append(f"  the real pipeline {'agrees' if c['agrees'] else 'DISAGREES'} (the plan means {wanted})")
    return "\n".join(parts)


class LoadSampler:
    """The machine's 1-minute load average every few seconds while the check runs (the cores may be
    shared: a busy machine's figures say more about the machine than about the plan)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="load-sampler", daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        return {"min": min(self.samples), "mean": statistics.mean(self.samples), "max": max(self.samples)}


def run_check(ns: argparse.Namespace) -> dict[str, Any]:
    s = setup(ns)
    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-plan-check-"))
    started = time.time()
    try:
        with LoadSampler() as load:
            rows = accuracy(ns, s, scratch) if not ns.skip_accuracy else []
            check = workers_check(ns, s, scratch) if ns.workers_check else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    c, loop = s.calibration.model, s.calibration.loop
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python -m mqinfer.loadgen.plan.check " + " ".join(sys.argv[1:]),
        "model": ns.model, "workload": ns.workload, "num_requests": ns.num_requests,
        "online_requests": ns.online_requests, "workers": ns.workers, "num_threads": s.opts["num_threads"],
        "device": ns.device, "load_average": load.summary(),
        "calibration": {"path": str(s.path), "measured_at": s.calibration.measured_at,
                        "step_s_fixed": c.step_s_fixed, "token_s": c.token_s, "seq_s": c.seq_s, "pair_s": c.pair_s,
                        "decode_ctx_s": c.decode_ctx_s, "mean_gap_s": loop.mean_gap_s,
                        "step_overhead_s": loop.step_overhead_s, "mean_wake_s": loop.mean_wake_s,
                        "flushes_s": list(loop.flush_samples_s), "first_step_s": loop.first_step_s,
                        "startup_s": s.calibration.startup_s, "calibration_s": s.calibration.calibration_s},
        "wall_s": time.time() - started,
        "rows": [r.to_dict() for r in rows],
        "table": format_table(rows) if rows else "",
        "workers_check": check,
    }


def _rates(text: str) -> list[float] | str:
    if text.strip().lower() == "auto":
        return "auto"
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected auto or comma-separated rates > 0, got {text!r}")
    return values


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.plan.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="Model (default: tiny).")
    parser.add_argument("--workload", default="standard", help="A bench workload (default: standard).")
    parser.add_argument("--num-requests", type=int, default=128, help="Requests of the offline run (default: 128).")
    parser.add_argument("--online-requests", type=int, default=300,
                        help="Requests of each online run and of the workers check (default: 300: the p99 rests "
                             "on its three slowest).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="Worker processes (default: 1).")
    parser.add_argument("--num-threads", type=int, default=1, help="Threads per CPU worker (default: 1).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="Where the workers run (default: cpu).")
    parser.add_argument("--rates", type=_rates, default="auto",
                        help="Online rates, requests per second, or auto: 20%%, 50%% and 80%% of the offline "
                             "run's request rate (default: auto).")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="Online runs per rate, and per worker count in the workers check (default: 1). "
                             "Near saturation a p99 over a few hundred requests swings from run to run with the "
                             "machine's speed; with R > 1 the runs are taken in turn across the rates (and the "
                             "counts), a row's p99 TTFT is that of all its runs' requests together, and each "
                             "run's p99 is printed.")
    parser.add_argument("--calibrate", action="store_true", help="Calibrate again even when a fit is stored.")
    parser.add_argument("--workers-check", action="store_true",
                        help="Also check the plan's worker count for an SLO against the real pipeline at N-1 and N.")
    parser.add_argument("--skip-accuracy", action="store_true", help="Only the workers check.")
    parser.add_argument("--check-rate", type=_positive, default=None, metavar="QPS",
                        help="The workers check's rate (default: 90%% of one worker's simulated bulk rate).")
    parser.add_argument("--check-slo-ms", type=_positive, default=None, metavar="MS",
                        help="The workers check's p99 TTFT SLO (default: the geometric mean of the plan's p99 at 1 "
                             "and 2 workers).")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write the figures as JSON.")
    ns = parser.parse_args(argv)
    if ns.skip_accuracy and not ns.workers_check:
        parser.error("--skip-accuracy leaves nothing to do without --workers-check")
    if ns.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {ns.repeats}")
    import logging

    logging.basicConfig(level=logging.WARNING)
    result = run_check(ns)
    if result["table"]:
        print(result["table"])
    if result["workers_check"]:
        print(format_workers_check(result["workers_check"]))
    load = result["load_average"]
    print(f"load average (1 min) during the check: {load['min']:.2f} to {load['max']:.2f}, mean {load['mean']:.2f} "
          f"({os.cpu_count()} CPUs)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0 if not result["workers_check"] or result["workers_check"]["agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
