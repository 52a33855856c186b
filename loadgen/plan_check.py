"""How far `mqinfer plan` is from the real pipeline: its predictions and `mqinfer bench`'s measurements
of the same requests, side by side.

    python -m mqinfer.loadgen.plan_check [--model tiny] [--workload standard] [--num-requests 64]
                                         [--workers 1] [--num-threads 1] [--device cpu|cuda]
                                         [--rates auto|R,R,R] [--calibrate]

For one workload it runs, through the real pipeline (an embedded server, ``mqinfer worker``
processes, the result rows: the bench's offline and online modes), an offline bulk run and an
online run at three rates, and simulates the same requests with the same arrival times and the same
worker count with the plan's step-cost model (calibrated first when this machine has no stored fit,
or with ``--calibrate``). It prints, for each case, the measured and predicted output tokens per
second and p99 TTFT and their relative errors ((predicted - measured) / measured).

The rates (``auto``) are 20%, 50% and 80% of the request rate the offline run measured. In the
offline run the requests wait in the stream while the workers start, so its TTFT is counted from the
first request's start on both sides (start-up is the plan's separate figure). Workers, batcher and
engine settings are the defaults of `mqinfer worker` except the worker count and threads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_pool import log
from mqinfer.loadgen.metrics import RequestTiming, percentile

AUTO_RATE_SHARES = (0.2, 0.5, 0.8)


@dataclass
class CheckRow:
    case: str
    workers: int
    measured_tok_s: float
    predicted_tok_s: float
    measured_ttft_p99_s: float | None
    predicted_ttft_p99_s: float | None

    @property
    def tok_s_error(self) -> float | None:
        return _rel(self.predicted_tok_s, self.measured_tok_s)

    @property
    def ttft_error(self) -> float | None:
        return _rel(self.predicted_ttft_p99_s, self.measured_ttft_p99_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s_error": self.tok_s_error, "ttft_p99_error": self.ttft_error}


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def _ttft_p99(values: list[float]) -> float | None:
    values = sorted(values)
    return percentile(values, 99) if values else None


def measured_ttft_p99(timings: list[RequestTiming], from_first_start: bool) -> float | None:
    ok = [t for t in timings if t.ok and t.first_token_at is not None]
    if not ok:
        return None
    if from_first_start:
        origin = min(t.started_at for t in ok)
        return _ttft_p99([t.first_token_at - max(t.enqueued_at, origin) for t in ok])
    return _ttft_p99([t.ttft for t in ok])


def predicted(requests: list[dict[str, Any]], rate: float | None, seed: int, workers: int, settings, calibration,
              from_first_start: bool) -> tuple[float, float | None]:
    """(output tokens per second, p99 TTFT) of the plan's simulation of ``requests``."""
    from mqinfer.loadgen.plan import summarize
    from mqinfer.loadgen.plan_sim import SimRequest, simulate
    from mqinfer.loadgen.bench_online import poisson_arrivals

    arrivals = poisson_arrivals(len(requests), rate, seed) if rate else [0.0] * len(requests)
    sim_requests = [SimRequest(r["id"], tuple(r["prompt_token_ids"]), int(r["max_tokens"]), arrival_s=float(a))
                    for r, a in zip(requests, arrivals)]
    sim = simulate(sim_requests, workers, settings, calibration.model, loop_overhead_s=calibration.step_overhead_s,
                   wake_s=calibration.wake)
    ev = summarize(sim)
    if from_first_start:
        origin = min(o.started_s for o in sim.outcomes if o.started_s is not None)
        return ev.output_tokens_per_s, _ttft_p99([o.first_token_s - max(o.arrival_s, origin) for o in sim.outcomes
                                                  if o.first_token_s is not None])
    return ev.output_tokens_per_s, ev.ttft_p99_s


def format_table(rows: list[CheckRow]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    head = (f"{'case':<20} {'workers':>7} {'tok/s meas':>11} {'tok/s pred':>11} {'error':>8} "
            f"{'p99 TTFT ms meas':>17} {'pred':>8} {'error':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.case:<20} {r.workers:>7} {r.measured_tok_s:>11.1f} {r.predicted_tok_s:>11.1f} "
                     f"{pct(r.tok_s_error):>8} {ms(r.measured_ttft_p99_s):>17} {ms(r.predicted_ttft_p99_s):>8} "
                     f"{pct(r.ttft_error):>8}")
    return "\n".join(lines)


def run_check(ns: argparse.Namespace) -> dict[str, Any]:
    from mqinfer.loadgen.bench import run_engine
    from mqinfer.loadgen.bench_model import resolve_model
    from mqinfer.loadgen.bench_online import request_rate
    from mqinfer.loadgen.plan import engine_config, get_calibration, worker_layout, worker_settings
    from mqinfer.loadgen.plan import calibration_path
    from mqinfer.loadgen.plan_calibrate import bench_args, worker_flags
    from mqinfer.loadgen.plan_model import load_calibration
    from mqinfer.loadgen.plan_options import PLAN_CMD
    from mqinfer.loadgen.workload import make_workload

    opts = {o.name: o.default for o in PLAN_CMD}
    opts.update(model=ns.model, num_threads=ns.num_threads if ns.device == "cpu" else None, device=ns.device,
                workers=ns.workers)
    layout = worker_layout(opts)
    stored = load_calibration(calibration_path(opts, layout))
    calibration, path = get_calibration(opts, layout, calibrate=ns.calibrate or stored is None, progress=log)
    settings = worker_settings(opts, calibration)
    spec = resolve_model(ns.model)
    requests = make_workload(ns.workload, n=ns.num_requests, seed=ns.seed, vocab_size=spec.vocab_size,
                             max_model_len=spec.max_model_len, min_token_id=spec.min_token_id)
    flags = {**worker_flags(engine_config(opts), calibration), "num_kv_blocks": None}
    common = dict(model=ns.model, workload=ns.workload, num_requests=ns.num_requests, seed=ns.seed,
                  workers=ns.workers, engine=flags)
    rows: list[CheckRow] = []
    scratch = Path(tempfile.mkdtemp(prefix="mqinfer-plan-check-"))
    started = time.time()
    try:
        offline = run_engine(bench_args(mode="offline", **common), spec, requests, scratch / "offline")
        tok_s, ttft = predicted(requests, None, ns.seed, ns.workers, settings, calibration, from_first_start=True)
        rows.append(CheckRow("offline bulk", ns.workers, offline.offline.throughput, tok_s,
                             measured_ttft_p99(offline.timings, from_first_start=True), ttft))
        log(format_table(rows))
        if ns.rates == "auto":
            base = request_rate(offline.offline)
            rates = [float(f"{base * share:.3g}") for share in AUTO_RATE_SHARES]
        else:
            rates = ns.rates
        online = run_engine(bench_args(mode="online", rates=rates, **common), spec, requests, scratch / "online")
        for k, point in enumerate(online.online):
            tok_s, ttft = predicted(requests, point.rate, ns.seed + k, ns.workers, settings, calibration,
                                    from_first_start=False)
            rows.append(CheckRow(f"online {point.rate:g} req/s", ns.workers, point.summary.throughput, tok_s,
                                 measured_ttft_p99(point.timings, from_first_start=False), ttft))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    c = calibration.model
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python -m mqinfer.loadgen.plan_check " + " ".join(sys.argv[1:]),
        "model": ns.model, "workload": ns.workload, "num_requests": ns.num_requests, "workers": ns.workers,
        "num_threads": opts["num_threads"], "device": ns.device,
        "calibration": {"path": str(path), "measured_at": calibration.measured_at, "step_s_fixed": c.step_s_fixed,
                        "token_s": c.token_s, "seq_s": c.seq_s, "pair_s": c.pair_s, "decode_ctx_s": c.decode_ctx_s,
                        "step_overhead_s": calibration.step_overhead_s, "wake_s": calibration.wake_s,
                        "startup_s": calibration.startup_s},
        "wall_s": time.time() - started,
        "rows": [r.to_dict() for r in rows],
        "table": format_table(rows),
    }


def _rates(text: str) -> list[float] | str:
    if text.strip().lower() == "auto":
        return "auto"
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected auto or comma-separated rates > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.plan_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="Model (default: tiny).")
    parser.add_argument("--workload", default="standard", help="A bench workload (default: standard).")
    parser.add_argument("--num-requests", type=int, default=64, help="Requests per run (default: 64).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="Worker processes (default: 1).")
    parser.add_argument("--num-threads", type=int, default=1, help="Threads per CPU worker (default: 1).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="Where the workers run (default: cpu).")
    parser.add_argument("--rates", type=_rates, default="auto",
                        help="Online rates, requests per second, or auto: 20%%, 50%% and 80%% of the offline "
                             "run's request rate (default: auto).")
    parser.add_argument("--calibrate", action="store_true", help="Calibrate again even when a fit is stored.")
    parser.add_argument("--json", default=None, metavar="FILE", help="Write the figures as JSON.")
    ns = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    result = run_check(ns)
    print(result["table"])
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
