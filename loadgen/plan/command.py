"""`mqinfer plan`: how many workers a workload needs to meet its target, and what a request costs.

The concurrency cost boundary: a rate of requests (or a bulk job and its deadline) maps to a
number of workers, and the workers' device-hours to a cost per request and per million tokens.
The plan has three parts:

1. **A step-cost model of this machine and model** (``model``): one engine step's seconds
   from its batched tokens, requests and attention pairs, fitted once by ``--calibrate`` on the
   real engine (``calibrate``) and stored under the cache folder for later plans. The same
   calibration measures a worker's start-up time and the worker loop around the engine
   (``pipeline``).
2. **A simulation with the real scheduler and batcher** (``sim``): the requests arrive (a
   seeded Poisson process at ``--rate``, or all at once for a bulk job), N simulated workers read
   them from a simulated stream and run them through ``DynamicBatcher`` and ``Scheduler``, each step
   lasting what the model predicts. Out come each request's TTFT and TPOT, the throughput and the
   workers' busy share.
3. **The search and the bill**: the fewest workers whose simulated p99 TTFT and p99 TPOT meet the
   SLOs at the rate (or whose job, start-up included, ends by the deadline; ``target``); then
   cost = workers x their share of a priced device x the price x time, warm running and start-up
   kept apart, and the KEDA replica bounds that follow.

The requests come from ``workload``; the table, the JSON and the plot from ``report``.

Every request is assumed to generate its full ``max_tokens`` (the simulation has no EOS), which
is exact for ``ignore_eos`` workloads and an upper bound otherwise. The worker loop around the
engine is measured, not modelled part by part: the gaps between steps, the flushes of result rows
(the loop's longest pauses, and most of the TTFT tail), the wake-up on an arrival, the spread of
step times and a fresh worker's slow first steps are drawn from what the calibration's runs of
the real pipeline showed (pipeline). A bulk job's workers are fresh; an online target's are
warm. Workers that share a CPU machine slow each other's steps down by a factor the calibration
measures with engines busy beside it. Not modelled: other processes on the machine. ``python -m mqinfer.loadgen.plan.check`` measures how far the predictions are from the
real pipeline, and whether the worker count it picks for an SLO is the one the pipeline needs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mqinfer.config import ENGINE_OPTIONS, ConfigError
from mqinfer.loadgen.plan.model import (
    Calibration,
    fit_path,
    load_calibration,
    machine_key,
    save_calibration,
)
from mqinfer.loadgen.plan.options import BULK_REQUESTS, ONLINE_REQUESTS
from mqinfer.loadgen.plan.report import calibration_dict, can_plot, ms_text, ms_value, plot_sweep, render
from mqinfer.loadgen.plan.sim import SimRequest, WorkerSettings, simulate
from mqinfer.loadgen.plan.target import (
    MAX_WORKERS,
    Evaluation,
    Target,
    fewest_workers,
    idle_ttft_p99,
    judge,
    summarize,
    summarize_pooled,
)
from mqinfer.loadgen.plan.workload import named_workload, read_workload_file, with_arrivals, with_tenant_slos

log = logging.getLogger("mqinfer.plan")

# KEDA's upper bound is the count for this many times the planned rate (headroom for a burst).
PEAK_FACTOR = 2.0
# A calibration made while the load average was above this share of the CPUs gets a note.
BUSY_LOAD_SHARE = 0.75
# Simulations (different draws of the loop's delays and the steps' slowness) pooled into one
# evaluation of an online target: the p99 of one simulation of a thousand requests moves by about a
# tenth from one draw to the next near saturation, enough to flip a worker count at the SLO. A bulk
# job's finish time moves far less: one simulation.
ONLINE_SEEDS = 3


def seeds_for(target: Target) -> int:
    """Simulations pooled into one evaluation of ``target``."""
    return ONLINE_SEEDS if target.online else 1


# The plan's p99 TTFT is also simulated with every step this much faster and slower: how far a
# machine's own speed moves from one minute to the next (a quiet 2-vCPU VM ran the same offline job
# at 2960-3285 tok/s over nine runs). Near saturation the p99 moves far more than the speed does.
SPEED_DRIFT = 0.05


class NoCalibration(ConfigError):
    """No stored step-cost fit for this model, machine and worker layout."""


# -- the worker the plan is for ------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    device: str  # cpu or cuda
    num_threads: int | None  # model threads per worker (CPU)
    device_share: float  # the share of a priced device each worker bills
    accelerator: str | None = None  # the GPU's name on CUDA


def engine_config(opts: dict[str, Any]):
    """The worker's ``EngineConfig`` from resolved flags, as `mqinfer worker` builds it."""
    from mqinfer.workers.config import EngineConfig

    values = {o.field: opts[o.name] for o in ENGINE_OPTIONS if o.name in opts}
    if "priority_aging_s" in values:
        values["priority_aging_s"] = values["priority_aging_s"] or None
    return EngineConfig(**values)


def worker_layout(opts: dict[str, Any]) -> Layout:
    """Where a planned worker runs and what share of a device it bills. On a CPU a worker has one
    thread unless ``--num-threads`` says otherwise (the layout `--workers auto` starts)."""
    from mqinfer.layout import cuda_available
    from mqinfer.workers.devices import cpu_device_share

    device = str(opts.get("device") or "auto")
    cuda = device.startswith("cuda") or (device == "auto" and cuda_available())
    ranks = worker_ranks(opts)
    accelerator = None
    if cuda:
        import torch

        accelerator = torch.cuda.get_device_name(int(device.partition(":")[2] or 0))
        threads = opts.get("num_threads")
        share = float(ranks)
    else:
        threads = opts.get("num_threads") or 1
        share = cpu_device_share(threads, ranks)
    if opts.get("device_share") is not None:
        share = float(opts["device_share"])
    return Layout("cuda" if cuda else "cpu", threads, share, accelerator)


def worker_ranks(opts: dict[str, Any]) -> int:
    """Processes (and devices on CUDA) of one planned worker: T tensor-parallel x P pipeline ranks."""
    return (opts.get("tensor_parallel_size") or 1) * (opts.get("pipeline_parallel_size") or 1)


def calibration_path(opts: dict[str, Any], layout: Layout) -> Path:
    from mqinfer.workers.devices import usable_cores

    engine_key = "|".join(str(opts.get(k)) for k in ("dtype", "quantization", "kv_cache_dtype",
                                                      "tensor_parallel_size", "pipeline_parallel_size"))
    return fit_path(str(opts.get("model") or "tiny"), engine_key,
                    machine_key(layout.device, layout.num_threads, usable_cores(), layout.accelerator))


def get_calibration(opts: dict[str, Any], layout: Layout, *, calibrate: bool,
                    progress: Callable[[str], None] = log.info) -> tuple[Calibration, Path]:
    """The stored fit for this model and layout, measured first with ``calibrate``; NoCalibration
    when there is none."""
    path = calibration_path(opts, layout)
    if calibrate:
        from mqinfer.loadgen.plan.calibrate import calibrate as run_calibration

        device = str(opts.get("device") or "")
        config = replace(engine_config(opts), device=device if device.startswith("cuda") else layout.device,
                         num_threads=layout.num_threads)
        calibration = run_calibration(config, model_id=str(opts.get("model") or "tiny"), progress=progress)
        save_calibration(calibration, path)
        progress(f"calibration stored in {path}")
        return calibration, path
    calibration = load_calibration(path)
    if calibration is None:
        threads = f"{layout.num_threads} thread(s) per worker" if layout.num_threads else "default threads"
        raise NoCalibration(
            f"no calibration for model {opts.get('model') or 'tiny'} on this machine ({layout.device}, {threads}, "
            f"dtype {opts.get('dtype')}, quantization {opts.get('quantization')}): run the same command with "
            f"--calibrate once (it measures the engine's step times here, about a minute for a small model, "
            f"and keeps them in {path})")
    return calibration, path


def worker_settings(opts: dict[str, Any], calibration: Calibration) -> WorkerSettings:
    """The simulated worker's scheduler limits and batcher thresholds. KV blocks: --num-kv-blocks,
    else as many as the calibrated worker had, or for another --max-num-seqs, the blocks its full
    contexts need when the calibrated cache was sized by that and not by memory."""
    from mqinfer.scheduler.config import SchedulerConfig

    block_size = opts.get("block_size") or calibration.block_size
    max_len = opts.get("max_model_len") or calibration.max_model_len
    max_num_seqs = opts["max_num_seqs"]
    num_blocks = opts.get("num_kv_blocks")
    if num_blocks is None:
        per_seq = -(-calibration.max_model_len // calibration.block_size)
        sized_by_seqs = calibration.num_kv_blocks <= calibration.max_num_seqs * per_seq + 1
        num_blocks = calibration.num_kv_blocks
        if sized_by_seqs and max_num_seqs != calibration.max_num_seqs:
            num_blocks = max(max_num_seqs * -(-max_len // block_size), -(-max_len // block_size) + 1)
    aging = opts.get("priority_aging_s")
    scheduler = SchedulerConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=opts["max_num_batched_tokens"],
        max_num_seqs=max_num_seqs, max_model_len=max_len, enable_prefix_caching=opts.get("prefix_cache", True),
        priority_aging_s=aging or None, tenant_weights=_tenant_weights(opts.get("tenant_weights")),
    )
    return WorkerSettings(scheduler, max_batch=opts["max_batch"], max_wait_ms=opts["max_wait_ms"],
                          flush_rows=opts["flush_rows"], flush_interval_s=opts["flush_interval_s"],
                          workers_per_machine=workers_per_machine(opts, calibration))


def workers_per_machine(opts: dict[str, Any], calibration: Calibration) -> int:
    """How many planned workers share one machine's cores: on a CPU, as many as its usable cores
    hold at the calibrated threads (and ranks) per worker; on a GPU each worker has its own."""
    from mqinfer.workers.devices import usable_cores

    if not calibration.device.startswith("cpu"):
        return 1
    per_worker = (calibration.num_threads or 1) * worker_ranks(opts)
    return max(1, usable_cores() // per_worker)


def _tenant_slos(text: str | None) -> dict[str, tuple[int, int]]:
    from mqinfer.scheduler.slo import parse_tenant_slos

    return parse_tenant_slos(text)


def _tenant_weights(text: str | None) -> dict[str, float]:
    from mqinfer.scheduler.config import parse_tenant_weights

    return parse_tenant_weights(text)


# -- cost ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bill:
    worker_hour_usd: float  # one worker's share of a device-hour
    warm_usd: float  # the workers over the run (online: over the simulated window)
    startup_usd: float  # one start of every worker
    cost_per_request_usd: float
    cost_per_million_tokens_usd: float  # prompt + output tokens, as `mqinfer report costs` counts them
    cost_per_million_output_tokens_usd: float
    startup_share: float  # of warm + start-up

    @property
    def warm_share(self) -> float:
        return 1.0 - self.startup_share


def bill(ev: Evaluation, target: Target, layout: Layout, price: float, startup_s: float) -> Bill:
    """Online: steady running, cost per request = workers x worker-hour / 3600 / rate (start-up apart,
    once per worker start, its share shown against the simulated window). Bulk: the job's run plus
    one start-up of every worker, over its requests."""
    worker_hour = price * layout.device_share
    n = ev.workers
    startup = n * worker_hour * startup_s / 3600.0
    done = max(1, ev.num_requests - ev.num_errors)
    tokens = max(1, ev.prompt_tokens + ev.output_tokens)
    if target.online:
        warm = n * worker_hour * ev.window_s / 3600.0
        per_request = n * worker_hour / 3600.0 / target.rate
        per_token = per_request * done / tokens
        per_output = per_request * done / max(1, ev.output_tokens)
    else:
        warm = n * worker_hour * ev.end_s / 3600.0
        per_request = (warm + startup) / done
        per_token = (warm + startup) / tokens
        per_output = (warm + startup) / max(1, ev.output_tokens)
    total = warm + startup
    return Bill(worker_hour, warm, startup, per_request, per_token * 1e6, per_output * 1e6,
                startup / total if total > 0 else 0.0)


# -- the plan ------------------------------------------------------------------------------------
def _target(opts: dict[str, Any]) -> Target:
    from mqinfer.loadgen.bench_online import wait_budget_s

    rate, deadline = opts.get("rate"), opts.get("deadline_s")
    ttft, tpot = opts.get("slo_ttft_p99_ms"), opts.get("slo_tpot_ms")
    if rate is not None and deadline is not None:
        raise ConfigError("--rate (an online target) and --deadline-s (a bulk job's) exclude each other")
    if rate is None and (ttft is not None or tpot is not None):
        raise ConfigError("--slo-ttft-p99-ms and --slo-tpot-ms need --rate (the arrival rate they hold at)")
    return Target(rate=rate, slo_ttft_p99_s=ttft / 1000.0 if ttft else None,
                  slo_tpot_p99_s=tpot / 1000.0 if tpot else None, deadline_s=deadline,
                  max_wait_s=wait_budget_s(opts["max_wait_ms"])[0])


def _explicit_workers(opts: dict[str, Any], target: Target, layout: Layout) -> int | None:
    """The worker count to evaluate without a search: --workers N, or without a target this
    machine's auto layout; None to search for the fewest."""
    from mqinfer.layout import choose_layout

    if opts["workers"] != "auto":
        return int(opts["workers"])
    if target.has_goal:
        return None
    workers, _, _ = choose_layout({"workers": "auto", "num_threads": layout.num_threads, "device": layout.device,
                                   "shards": 1, "model": opts.get("model") or "tiny",
                                   "tensor_parallel_size": opts.get("tensor_parallel_size"),
                                   "pipeline_parallel_size": opts.get("pipeline_parallel_size")})
    return workers


def make_plan(opts: dict[str, Any], input_path: str | None,
              progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """The plan for resolved flags ``opts`` (see options.PLAN_CMD) as a JSON-ready dict."""
    if input_path and opts.get("workload"):
        raise ConfigError("give INPUT or --workload, not both")
    if opts.get("speculative", "none") != "none":
        raise ConfigError("the plan simulates the engine without speculative decoding; leave out --speculative")
    target = _target(opts)
    layout = worker_layout(opts)
    calibration, path = get_calibration(opts, layout, calibrate=bool(opts.get("calibrate")), progress=progress)
    if not input_path and not opts.get("workload"):
        if opts.get("calibrate"):
            return {"calibrated": str(path), "calibration": calibration_dict(calibration, path)}
        raise ConfigError("give INPUT (a JSONL or Parquet file of requests) or --workload NAME")
    settings = worker_settings(opts, calibration)
    model = str(opts.get("model") or "tiny")
    count = opts.get("num_requests")
    if input_path:
        workload = read_workload_file(input_path, model)
        count = count or (max(len(workload.requests), ONLINE_REQUESTS) if target.online else len(workload.requests))
    else:
        count = count or (ONLINE_REQUESTS if target.online else BULK_REQUESTS)
        workload = named_workload(opts["workload"], count, opts["seed"], model, settings.scheduler.max_model_len)
    requests = with_arrivals(with_tenant_slos(workload.requests, _tenant_slos(opts.get("tenant_slos"))),
                             target.rate, count, opts["seed"])
    target = replace(target, idle_ttft_p99_s=idle_ttft_p99(requests, settings, calibration, target.max_wait_s))

    def pooled(reqs: list[SimRequest], n: int, goal: Target, speed: float = 1.0) -> Evaluation:
        # A bulk job's workers start with the job (their first steps cold); online ones are warm.
        return summarize_pooled([simulate(reqs, n, settings, calibration.model.scaled(speed), loop=calibration.loop,
                                          seed=opts["seed"] + k, fresh=not goal.online)
                                 for k in range(seeds_for(goal))])

    def evaluate(n: int, reqs: list[SimRequest] = requests, goal: Target = target, quiet: bool = False
                 ) -> Evaluation:
        ev = judge(pooled(reqs, n, goal), goal, calibration.startup_s)
        if not quiet:
            progress(f"{n} worker(s): {ev.why}{'' if ev.met else ' - not met'}")
        return ev

    fixed = _explicit_workers(opts, target, layout)
    upper = min(MAX_WORKERS, len(requests))
    if fixed is not None:
        chosen = evaluate(fixed)
        tried = [chosen]
    else:
        chosen, tried = fewest_workers(evaluate, upper=upper)
    band = {"speed_change": SPEED_DRIFT}
    for name, factor in (("faster", 1.0 - SPEED_DRIFT), ("slower", 1.0 + SPEED_DRIFT)):
        band[f"ttft_p99_s_{name}"] = pooled(requests, chosen.workers, target, factor).ttft_p99_s
    costs = bill(chosen, target, layout, opts["price_per_device_hour"], calibration.startup_s)
    keda = _keda(chosen, target, fixed, opts, requests, evaluate, calibration.startup_s, upper)
    notes = list(workload.notes)
    if not chosen.met and fixed is None:
        notes.append(f"the target is out of reach: {chosen.workers} workers came closest, and more do not shorten "
                     f"a request's own steps (an idle worker's p99 TTFT is {ms_text(target.idle_ttft_p99_s)})")
    if chosen.num_errors:
        notes.append(f"{chosen.num_errors} requests refused by the scheduler (prompt longer than the context or "
                     "the KV cache)")
    load, cpus = (calibration.machine.get("load_average") or [0.0])[0], calibration.machine.get("cpus") or 1
    if load > BUSY_LOAD_SHARE * cpus:
        notes.append(f"calibrated while the machine was busy (load average {load:.1f} on {cpus} CPUs): its step "
                     "times include other processes' work; calibrate again on a quiet machine for a quiet one")
    ctx = PlanContext(model, workload.name, target, layout, calibration, path, opts["price_per_device_hour"])
    plan = _plan_dict(ctx, chosen, fixed is None, costs, keda, tried, notes)
    plan["ttft_p99_band"] = band
    # The sweep is for the plot and for the JSON; a table without a plot to draw (no matplotlib)
    # would show none of it, so it is not simulated.
    if opts.get("plot") and (opts["format"] == "json" or can_plot()):
        plan["sweep"] = sweep(evaluate, workload.requests, chosen, target, count, opts["seed"], upper)
    return plan


@dataclass(frozen=True)
class PlanContext:
    """What a plan is for and made from."""

    model: str
    workload: str
    target: Target
    layout: Layout
    calibration: Calibration
    path: Path  # where the calibration is stored
    price_per_device_hour: float


def _plan_dict(ctx: PlanContext, chosen: Evaluation, searched: bool, costs: Bill, keda: dict[str, Any],
               tried: list[Evaluation], notes: list[str]) -> dict[str, Any]:
    """The plan as a JSON-ready dict (ARCHITECTURE.md names its contract keys)."""
    target, layout, calibration = ctx.target, ctx.layout, ctx.calibration
    return {
        "model": ctx.model,
        "workload": ctx.workload,
        "target": {"kind": "online" if target.online else "bulk", "description": target.describe(),
                   "rate": target.rate, "slo_ttft_p99_ms": ms_value(target.slo_ttft_p99_s),
                   "slo_tpot_ms": ms_value(target.slo_tpot_p99_s), "deadline_s": target.deadline_s,
                   "met": chosen.met, "checked": chosen.why},
        "workers": chosen.workers,
        "workers_searched": searched,
        "layout": {"device": layout.device, "num_threads": layout.num_threads, "device_share": layout.device_share,
                   "accelerator": layout.accelerator},
        "num_requests": chosen.num_requests,
        "prompt_tokens": chosen.prompt_tokens,
        "output_tokens": chosen.output_tokens,
        "utilisation": chosen.utilisation,
        "ttft_p50_s": chosen.ttft_p50_s,
        "ttft_p99_s": chosen.ttft_p99_s,
        "tpot_p50_s": chosen.tpot_p50_s,
        "tpot_p99_s": chosen.tpot_p99_s,
        # Over the requests with latency targets alone (null without any).
        "interactive_ttft_p99_s": chosen.interactive_ttft_p99_s,
        "interactive_tpot_p99_s": chosen.interactive_tpot_p99_s,
        "output_tokens_per_s": chosen.output_tokens_per_s,
        "window_s": chosen.window_s,
        "job_s": calibration.startup_s + chosen.end_s if not target.online else None,
        "num_steps": chosen.num_steps,
        "num_preemptions": chosen.num_preemptions,
        "price_per_device_hour": ctx.price_per_device_hour,
        "worker_hour_usd": costs.worker_hour_usd,
        "cost_per_request_usd": costs.cost_per_request_usd,
        "cost_per_million_tokens_usd": costs.cost_per_million_tokens_usd,
        "cost_per_million_output_tokens_usd": costs.cost_per_million_output_tokens_usd,
        "warm_cost_usd": costs.warm_usd,
        "startup_cost_usd": costs.startup_usd,
        "startup_s": calibration.startup_s,
        "startup_share": costs.startup_share,
        "warm_share": costs.warm_share,
        "keda": keda,
        "idle_ttft_p99_s": target.idle_ttft_p99_s,
        "search": [{"workers": e.workers, "met": e.met, "ttft_p99_s": e.ttft_p99_s, "tpot_p99_s": e.tpot_p99_s,
                    "utilisation": e.utilisation, "checked": e.why} for e in tried],
        "calibration": calibration_dict(calibration, ctx.path),
        "notes": notes,
    }


# Requests per second of the sweep behind --plot: these times the planned rate (a bulk job's: the
# requests per second its planned workers finish).
SWEEP_RATE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# Requests simulated for each point of the sweep, at most.
SWEEP_REQUESTS = 500


def sweep(evaluate: Callable[..., Evaluation], base: Sequence[SimRequest], chosen: Evaluation, target: Target,
          count: int, seed: int, upper: int) -> list[dict[str, Any]]:
    """p99 TTFT over a range of rates for the planned worker count and one fewer and one more."""
    reference = target.rate or (chosen.num_requests / chosen.end_s if chosen.end_s > 0 else 1.0)
    counts = sorted({n for n in (chosen.workers - 1, chosen.workers, chosen.workers + 1) if 1 <= n <= upper})
    points = []
    for factor in SWEEP_RATE_FACTORS:
        rate = reference * factor
        reqs = with_arrivals(base, rate, min(count, SWEEP_REQUESTS), seed)
        goal = replace(target, rate=rate, deadline_s=None)
        for n in counts:
            ev = evaluate(n, reqs, goal, quiet=True)
            points.append({"workers": n, "rate": rate, "ttft_p99_s": ev.ttft_p99_s, "tpot_p99_s": ev.tpot_p99_s,
                           "utilisation": ev.utilisation})
    return points


def _keda(chosen: Evaluation, target: Target, fixed: int | None, opts: dict[str, Any], requests: list[SimRequest],
          evaluate: Callable[..., Evaluation], startup_s: float, upper: int) -> dict[str, Any]:
    """minReplicaCount / maxReplicaCount for ops/deploy/keda.yaml. Online: the planned workers stay up
    (a cold start would add the start-up to some requests' TTFT), and the upper bound is the count
    that meets the target at PEAK_FACTOR times the rate. Bulk: from zero to the planned workers."""
    if not target.online:
        return {"min_replicas": 0, "max_replicas": chosen.workers,
                "why": "a bulk job: workers start with the job (start-up counted in the plan) and scale to zero after"}
    if fixed is not None or not chosen.met:
        return {"min_replicas": chosen.workers, "max_replicas": chosen.workers,
                "why": "the given worker count" if fixed is not None else "the target is not met: no headroom known"}
    peak = target.rate * PEAK_FACTOR
    peak_requests = with_arrivals(requests, peak, len(requests), opts["seed"] + 1)
    peak_target = replace(target, rate=peak)
    at_peak, _ = fewest_workers(lambda n: evaluate(n, peak_requests, peak_target), lower=chosen.workers, upper=upper)
    why = (f"min: the planned workers stay warm (a cold start takes {startup_s:.1f} s); max: the workers that meet "
           f"the target at {peak:g} requests/s ({PEAK_FACTOR:g}x the rate)")
    if not at_peak.met:
        why += f", not met even with {at_peak.workers}"
    return {"min_replicas": chosen.workers, "max_replicas": at_peak.workers, "peak_rate": peak, "why": why}


def cmd_plan(args, opts: dict[str, Any]) -> int:
    """`mqinfer plan`: print the plan; exit 1 when its target is not met or calibration failed."""
    try:
        plan = make_plan(opts, getattr(args, "input", None))
    except (RuntimeError, TimeoutError) as exc:  # a calibration run that failed (no server, a worker died)
        print(f"mqinfer plan: error: {exc}", file=sys.stderr)
        return 1
    print(render(plan, opts["format"]))
    if opts.get("plot"):
        note = plot_sweep(plan, opts["plot"])
        print(f"mqinfer plan: {note}" if note else f"mqinfer plan: p99 TTFT against the rate drawn in {opts['plot']}",
              file=sys.stderr)
    return 0 if plan.get("target", {}).get("met", True) else 1
