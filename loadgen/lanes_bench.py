"""What lanes are for, measured through the real pipeline: a tenant's backlog does not block
another tenant's requests, lanes are read by weight, and they cost no throughput.

Runs an embedded server and ``mqinfer worker`` processes (``bench_pool``), the producer and the
workers both under one ``--lanes`` mode per variant (``--lanes-compare``, default
``tenant,none``). Every variant run gets fresh workers and its own stream (so no lane registry,
consumer or cached prefix carries over), is warmed with one request first, and ``--rounds R``
repeats each scenario R times, alternating which variant goes first; the table shows the median
over the rounds, the JSON every round. Three scenarios (``--scenario``):

1. **backlog**: the bulk tenant submits ``--bulk-requests`` requests at once, then the
   interactive tenant ``--interactive-requests`` at once. Reported: when the interactive
   tenant's last request finished (seconds from its submission); how many bulk requests had
   finished by then (and their share of all bulk requests); the interactive tenant's queueing
   delay (``started_at - enqueued_at`` of its result rows) at p50 / p99. The same interactive
   requests (prompts salted: nothing cached) run alone first on the same workers; the goal is a
   p99 queueing delay with the backlog at most 2x the one alone.
2. **weights**: tenants alpha and beta, both backlogged with ``--weights-requests`` requests each
   of identical shapes (alpha's i-th and beta's i-th have the same lengths), submitted interleaved
   in one go, workers started with ``--tenant-weights`` (default ``alpha=2,beta=1``). A sampler
   polls the group's unread count (``XINFO GROUPS`` lag, else ``XLEN - pending``) of every stream
   holding the requests every ``SAMPLE_S`` (``lanes_sampling``); a stream delivers its entries in order, so the
   entries delivered so far are each stream's first ``submitted - unread``, and whose they are is
   known from the submission order. The window runs from the end of the submission to the last
   sample at which both tenants still had unread entries. Reported for it, alpha over beta: the
   entries delivered to the workers (the queue's share), the requests started (``started_at`` in
   the window) and the output tokens served (each request's output tokens spread evenly over its
   ``first_token_at .. finished_at``, the part inside the window), against the weights' ratio;
   and the output tokens again over the longer window until one tenant's last request finished
   (the engine's side). Under ``--lanes none`` both tenants share one stream and the queue
   serves them in arrival order (interleaved: 1:1); only the engine's fair share can weigh them.
3. **throughput**: the standard workload (``--throughput-requests``, prompts 16..256, outputs
   16..128, as ``mqinfer bench``) submitted at once, twice per variant: every request of tenant
   ``default`` (the plain stream, under any mode) and every request of tenant ``solo`` (under
   ``--lanes tenant`` one lane beside the plain stream, so the worker reads the lanes' path).
   Output tokens per second as ``mqinfer bench`` counts them (tokens asked for, from the first
   request started to the last finished); each variant's ratio to the baseline (``none`` when
   compared, else the last variant) per round, and their median.

Lanes act at the queue only: a worker reads as much as its engine can start (``--max-num-seqs``,
256 by default) plus a short waiting queue, and only what is beyond that waits in the streams.
So a backlog smaller than the workers' capacity leaves the lanes little to do; a smaller
``--max-num-seqs`` (or more requests) shows the queue's part.

``python -m mqinfer.loadgen.lanes_bench --help``. Progress goes to stderr, the table to stdout,
every figure to ``--json FILE``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mqinfer.loadgen.bench_model import ModelSpec, resolve_model
from mqinfer.loadgen.bench_online import unshared_prompts
from mqinfer.loadgen.bench_options import (
    add_worker_engine_options, parse_length_range, parse_worker_count, positive_int, run_scenario,
)
from mqinfer.loadgen.bench_pool import WorkerPool, log, read_results, wait_done, worker_argv
from mqinfer.loadgen.lanes_sampling import (  # noqa: F401  (the figures' helpers, tested through this module)
    ALPHA, BETA, SAMPLE_S, UnreadSampler, contention_window, delivered_by_tenant, output_tokens_in, ratio_of,
    unread_counts, weights_figures,
)
from mqinfer.loadgen.metrics import RequestTiming, summarize
from mqinfer.loadgen.tenants_bench import tenant_weights, queue_delays
from mqinfer.loadgen.workload import fit_to_context, standard_workload, uniform_workload
from mqinfer.scheduler.config import format_tenant_weights
from mqinfer.schemas import lanes as lane_scheme

SCENARIOS = ("backlog", "weights", "throughput")
BULK, INTERACTIVE = "bulk", "interactive"
DEFAULT, SOLO = lane_scheme.DEFAULT_TENANT, "solo"
# The backlog goal: the interactive tenant's p99 queueing delay at most this times its p99 alone.
BACKLOG_GOAL = 2.0


def _scenarios(text: str) -> list[str]:
    if text == "all":
        return list(SCENARIOS)
    values = []
    for item in (v.strip() for v in text.split(",")):
        if item not in SCENARIOS:
            raise argparse.ArgumentTypeError(f"unknown scenario {item!r}: choose from {', '.join(SCENARIOS)} or all")
        if item not in values:
            values.append(item)
    return values


def _lane_modes(text: str) -> list[str]:
    """``--lanes-compare``: lane modes separated by ``/`` or, where unambiguous, commas
    (``tenant,none``; ``tenant,job`` is the one mode, so write ``tenant,job/none`` beside it)."""
    if "/" in text:
        items = text.split("/")
    else:
        try:
            items = [lane_scheme.parse_lanes(text)]  # one mode, tenant,job included
        except ValueError:
            items = text.split(",")
    modes: list[str] = []
    for item in items:
        try:
            mode = lane_scheme.parse_lanes(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if mode not in modes:
            modes.append(mode)
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.lanes_bench",
        description="Lanes through the real pipeline: an interactive tenant behind another's backlog, 2:1 weights "
                    "at the queue, and throughput, each under --lanes tenant and --lanes none.")
    g = p.add_argument_group("what to run")
    g.add_argument("--scenario", type=_scenarios, default=list(SCENARIOS), metavar="NAME[,NAME]|all",
                   help="backlog, weights, throughput, or all (default: all).")
    g.add_argument("--lanes-compare", type=_lane_modes, default=["tenant", "none"], metavar="MODES",
                   help="The --lanes modes to run, producer and workers alike, e.g. tenant,none or "
                        "tenant/tenant,job/none (default: tenant,none).")
    g.add_argument("--rounds", type=positive_int, default=2, metavar="R",
                   help="Run each scenario R times, alternating which mode goes first; the table shows the median "
                        "(default: 2).")

    g = p.add_argument_group("workload")
    g.add_argument("--model", default="tiny", metavar="M",
                   help="`tiny`, a checkpoint folder, or a .gguf file (default: tiny).")
    g.add_argument("--bulk-requests", type=positive_int, default=300, metavar="N",
                   help="backlog: the bulk tenant's requests, submitted at once (default: 300).")
    g.add_argument("--interactive-requests", type=positive_int, default=15, metavar="N",
                   help="backlog: the interactive tenant's requests, submitted at once after the bulk ones "
                        "(default: 15).")
    g.add_argument("--weights-requests", type=positive_int, default=200, metavar="N",
                   help="weights: requests of each of the two tenants (default: 200).")
    g.add_argument("--tenant-weights", type=tenant_weights, default={ALPHA: 2.0, BETA: 1.0}, metavar="alpha=W,beta=W",
                   help="weights: the workers' --tenant-weights (default: alpha=2,beta=1).")
    g.add_argument("--throughput-requests", type=positive_int, default=256, metavar="N",
                   help="throughput: requests of the standard workload per run (default: 256).")
    g.add_argument("--prompt-len", type=parse_length_range, default=(16, 256), metavar="LO,HI",
                   help="backlog and weights: prompt lengths, uniform (default: 16,256, as the standard workload).")
    g.add_argument("--output-len", type=parse_length_range, default=(16, 128), metavar="LO,HI",
                   help="backlog and weights: output lengths, uniform (default: 16,128, as the standard workload).")
    g.add_argument("--seed", type=int, default=0, help="Workload seed (default: 0).")

    g = p.add_argument_group("run")
    g.add_argument("--workers", type=parse_worker_count, default=1, metavar="N|auto", help="Worker processes (default: 1).")
    g.add_argument("--out", default=None, metavar="DIR", help="Keep the workers' output here (default: a temp dir).")
    g.add_argument("--timeout-s", type=float, default=1800.0, metavar="S",
                   help="Give up on a run after this long (default: 1800).")
    g.add_argument("--idle-exit-s", type=float, default=600.0, metavar="S",
                   help="Workers exit after this long with nothing to do (default: 600).")
    g.add_argument("--json", default=None, metavar="FILE", help="Write every figure as JSON.")

    add_worker_engine_options(p)
    return p


# -- one variant: a pool of workers and a producer under one lane mode ------------------------------
class Variant:
    """Fresh workers and a producer on a stream of their own, both under lane mode ``mode``."""

    def __init__(self, ctx: "Context", mode: str, label: str, weights: dict[str, float] | None = None) -> None:
        self.ctx = ctx
        self.mode = mode
        self.stream = f"lanes-{label}-{uuid.uuid4().hex[:6]}"
        self.weights = weights
        self.pool: WorkerPool | None = None
        self.producer = None

    def start(self) -> None:
        from mqinfer.client import Producer

        args, ctx = self.ctx.args, self.ctx
        argv = worker_argv(args, ctx.spec.arg, ctx.url, ctx.out) + ["--lanes", self.mode]
        if self.weights:
            argv += ["--tenant-weights", format_tenant_weights(self.weights)]
        self.pool = WorkerPool(argv, args.workers, ctx.out / "logs" / self.stream, ctx.out, streams=[self.stream])
        self.producer = Producer(ctx.url, stream=self.stream, lanes=self.mode)
        self.pool.start()
        job = f"warmup-{self.stream}"
        # Its own prompt (reversed) and the default tenant: no lane, nothing it caches is reused.
        warm = {"id": "warmup", "prompt_token_ids": ctx.warm_prompt, "max_tokens": 4, "ignore_eos": True,
                "temperature": 0.0}
        self.producer.submit(warm, job_id=job)
        self.wait(job, 1, "warm-up")

    def wait(self, job_id: str, n: int, what: str) -> None:
        wait_done(self.producer.redis, job_id, n, self.pool, self.ctx.args.timeout_s, f"{self.mode}: {what}")

    def results(self, job_id: str, requests: list[dict[str, Any]]) -> list[RequestTiming]:
        return read_results(self.ctx.out, job_id, requests)[0]

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()
        if self.producer is not None:
            self.producer.redis.close()


class Context:
    """What every variant run shares: the arguments, the model, the server, the output folder."""

    def __init__(self, args: argparse.Namespace, spec: ModelSpec, url: str, out: Path) -> None:
        self.args = args
        self.spec = spec
        self.url = url
        self.out = out
        self.warm_prompt = list(range(spec.min_token_id, min(spec.vocab_size, spec.min_token_id + 16)))[::-1]

    @contextmanager
    def variant(self, mode: str, label: str, weights: dict[str, float] | None = None) -> Iterator[Variant]:
        v = Variant(self, mode, label, weights)
        try:
            log(f"{label} (--lanes {mode}): starting {self.args.workers} worker(s)")
            v.start()
            yield v
        finally:
            v.stop()

    def requests(self, tenant: str, n: int, seed: int, id_prefix: str | None = None) -> list[dict[str, Any]]:
        spec, args = self.spec, self.args
        reqs = uniform_workload(n, prompt_len=args.prompt_len, output_len=args.output_len,
                                vocab_size=spec.vocab_size, seed=seed, id_prefix=id_prefix or tenant,
                                min_token_id=spec.min_token_id)
        return [{**fit_to_context(r, spec.max_model_len), "tenant": tenant} for r in reqs]

    def salted(self, requests: list[dict[str, Any]], salt: int) -> list[dict[str, Any]]:
        return unshared_prompts(requests, salt, self.spec.vocab_size, self.spec.min_token_id)


def mode_order(modes: list[str], round_index: int) -> list[str]:
    """The modes in the order round ``round_index`` (0-based) runs them: as given, then reversed, ..."""
    return list(modes) if round_index % 2 == 0 else list(reversed(modes))


# -- 1. backlog ----------------------------------------------------------------------------------
def last_finished_s(timings: list[RequestTiming], since: float) -> float:
    return max(t.finished_at for t in timings) - since


def backlog_figures(bulk: list[RequestTiming], interactive: list[RequestTiming], interactive_submitted: float,
                    alone: list[RequestTiming], alone_submitted: float) -> dict[str, Any]:
    """The backlog scenario's figures from the rows of one run (see the module docstring)."""
    done_at = max(t.finished_at for t in interactive)
    bulk_done = sum(1 for t in bulk if t.finished_at <= done_at)
    with_backlog, by_itself = queue_delays(interactive), queue_delays(alone)
    p99_alone = by_itself["p99"] if by_itself else None
    p99_backlog = with_backlog["p99"] if with_backlog else None
    ratio = p99_backlog / p99_alone if p99_alone and p99_backlog is not None else None
    return {
        "interactive_last_finished_s": done_at - interactive_submitted,
        "bulk_finished_by_then": bulk_done,
        "bulk_finished_share": bulk_done / len(bulk),
        "interactive_queue_delay_s": with_backlog,
        "alone_last_finished_s": last_finished_s(alone, alone_submitted),
        "alone_queue_delay_s": by_itself,
        "p99_vs_alone": ratio,
        "goal_met": None if ratio is None else ratio <= BACKLOG_GOAL,
    }


def run_backlog(ctx: Context, mode: str, round_index: int) -> dict[str, Any]:
    args = ctx.args
    bulk = ctx.requests(BULK, args.bulk_requests, args.seed)
    interactive = ctx.requests(INTERACTIVE, args.interactive_requests, args.seed + 1)
    alone_reqs = ctx.salted(interactive, 1)
    tag = uuid.uuid4().hex[:6]
    jobs = {"alone": f"alone-{tag}", BULK: f"bulk-{tag}", INTERACTIVE: f"interactive-{tag}"}
    with ctx.variant(mode, "backlog") as v:
        log(f"backlog (--lanes {mode}): {len(alone_reqs)} interactive requests alone")
        alone_at = time.time()
        v.producer.submit_many(alone_reqs, job_id=jobs["alone"])
        v.wait(jobs["alone"], len(alone_reqs), "alone")
        log(f"backlog (--lanes {mode}): {len(bulk)} bulk requests, then {len(interactive)} interactive")
        bulk_at = time.time()
        v.producer.submit_many(bulk, job_id=jobs[BULK])
        interactive_at = time.time()
        v.producer.submit_many(interactive, job_id=jobs[INTERACTIVE])
        v.wait(jobs[INTERACTIVE], len(interactive), "interactive behind the backlog")
        v.wait(jobs[BULK], len(bulk), "bulk")
        alone = v.results(jobs["alone"], alone_reqs)
        got_bulk = v.results(jobs[BULK], bulk)
        got_interactive = v.results(jobs[INTERACTIVE], interactive)
    figures = backlog_figures(got_bulk, got_interactive, interactive_at, alone, alone_at)
    figures["bulk_last_finished_s"] = last_finished_s(got_bulk, bulk_at)
    return {"round": round_index + 1, "lanes": mode, **figures}


# -- 2. weights ----------------------------------------------------------------------------------
def run_weights(ctx: Context, mode: str, round_index: int) -> dict[str, Any]:
    from mqinfer.schemas import keys

    args = ctx.args
    n = args.weights_requests
    alpha = ctx.requests(ALPHA, n, args.seed + 2)
    # Identical shapes, different prompts: beta's i-th request is alpha's with its prompt salted.
    beta = [{**r, "id": f"{BETA}-{i:06d}", "tenant": BETA} for i, r in enumerate(ctx.salted(alpha, 1))]
    interleaved = [r for pair in zip(alpha, beta) for r in pair]
    job = f"weights-{uuid.uuid4().hex[:6]}"
    weights = {ALPHA: args.tenant_weights.get(ALPHA, 1.0), BETA: args.tenant_weights.get(BETA, 1.0)}
    with ctx.variant(mode, "weights", {**args.tenant_weights, **weights}) as v:
        order: dict[str, list[str]] = {}
        for r in interleaved:
            lane = lane_scheme.lane_name(mode, r["tenant"], job)
            key = keys.request_stream(lane_scheme.lane_stream(v.stream, lane))
            order.setdefault(key, []).append(r["tenant"])
        log(f"weights (--lanes {mode}): {n} requests each of {ALPHA} and {BETA}, weights "
            f"{format_tenant_weights(weights)}")
        sampler = UnreadSampler(ctx.url, order, keys.GROUP)
        v.producer.submit_many(interleaved, job_id=job)
        submitted_at = time.time()
        sampler.start()
        try:
            v.wait(job, len(interleaved), "both tenants")
        finally:
            sampler.stop()
        got = v.results(job, interleaved)
    timings = {ALPHA: got[0::2], BETA: got[1::2]}
    return {"round": round_index + 1, "lanes": mode, **weights_figures(sampler.samples, timings, submitted_at)}


# -- 3. throughput -------------------------------------------------------------------------------
def run_throughput(ctx: Context, mode: str, round_index: int) -> dict[str, Any]:
    args, spec = ctx.args, ctx.spec
    base = [fit_to_context(r, spec.max_model_len)
            for r in standard_workload(spec.vocab_size, args.throughput_requests, args.seed + 3, spec.min_token_id)]
    runs: dict[str, Any] = {}
    with ctx.variant(mode, "throughput") as v:
        tenants = [DEFAULT, SOLO] if round_index % 2 == 0 else [SOLO, DEFAULT]
        for salt, tenant in enumerate(tenants, start=1):
            reqs = [{**r, "tenant": tenant} for r in ctx.salted(base, salt)]
            job = f"throughput-{tenant}-{uuid.uuid4().hex[:6]}"
            log(f"throughput (--lanes {mode}): {len(reqs)} standard requests of tenant {tenant}")
            v.producer.submit_many(reqs, job_id=job)
            v.wait(job, len(reqs), f"tenant {tenant}")
            summary = summarize(v.results(job, reqs))
            runs[tenant] = {"output_tokens_per_s": summary.throughput, "span_s": summary.span_s,
                            "errors": summary.num_errors}
    return {"round": round_index + 1, "lanes": mode, "tenants": runs}


# -- the whole bench -----------------------------------------------------------------------------
RUNNERS = {"backlog": run_backlog, "weights": run_weights, "throughput": run_throughput}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _dig(run: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if run is None:
            return None
        run = run.get(key)
    return run


# The figures the table shows, as paths into one run's dict, medians over the rounds.
SUMMARY_FIELDS = {
    "backlog": [("interactive_last_finished_s",), ("bulk_finished_by_then",), ("bulk_finished_share",),
                ("interactive_queue_delay_s", "p50"), ("interactive_queue_delay_s", "p99"),
                ("alone_last_finished_s",), ("alone_queue_delay_s", "p50"), ("alone_queue_delay_s", "p99"),
                ("p99_vs_alone",), ("bulk_last_finished_s",)],
    "weights": [("window_s",), ("delivered_ratio",), ("started_ratio",), ("output_tokens_ratio",),
                ("both_unfinished_s",), ("both_unfinished_output_tokens_ratio",)],
    "throughput": [("tenants", DEFAULT, "output_tokens_per_s"), ("tenants", SOLO, "output_tokens_per_s")],
}


def summarize_runs(scenario: str, runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode, the median over rounds of each figure the table shows (keys joined by '.')."""
    return {mode: {".".join(path): _median([_dig(r, path) for r in runs if r["lanes"] == mode])
                   for path in SUMMARY_FIELDS[scenario]} for mode in modes}


def baseline_mode(modes: list[str]) -> str:
    return "none" if "none" in modes else modes[-1]


def throughput_ratios(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Per mode and tenant: its output tokens/s over the baseline mode's, each round's and their median."""
    base = baseline_mode(modes)
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["lanes"]] = r["tenants"]
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        out[mode] = {}
        for tenant in (DEFAULT, SOLO):
            rounds = [ratio_of(_dig(tenants.get(mode), (tenant, "output_tokens_per_s")),
                             _dig(tenants.get(base), (tenant, "output_tokens_per_s")))
                      for _, tenants in sorted(by_round.items())]
            out[mode][tenant] = {"rounds": rounds, "median": _median(rounds)}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mqinfer.layout import choose_layout
    from mqinfer.server import EmbeddedServer

    spec = resolve_model(args.model)
    workers, threads, why = choose_layout({"workers": args.workers, "num_threads": args.num_threads,
                                           "device": args.device, "shards": 1, "model": spec.arg})
    if args.workers == "auto":
        log(f"--workers auto: {workers} worker(s) x {threads or 'default'} thread(s) ({why})")
    args.workers, args.num_threads = workers, threads
    modes = args.lanes_compare
    result: dict[str, Any] = {
        "model": spec.arg, "workers": workers, "rounds": args.rounds, "lanes_compare": modes,
        "baseline": baseline_mode(modes), "seed": args.seed, "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len), "scenarios": list(args.scenario),
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mqinfer-lanes-") as tmp:
        scratch = Path(tmp)
        out = Path(args.out).resolve() if args.out else scratch / "out"
        out.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(scratch / "redis", unix_socket=True, appendonly=False).start()
        try:
            ctx = Context(args, spec, server.url, out)
            for scenario in args.scenario:
                runs = []
                for k in range(args.rounds):
                    for mode in mode_order(modes, k):
                        log(f"{scenario}: round {k + 1}/{args.rounds}, --lanes {mode}")
                        runs.append(RUNNERS[scenario](ctx, mode, k))
                entry: dict[str, Any] = {"runs": runs, "median": summarize_runs(scenario, runs, modes)}
                if scenario == "backlog":
                    entry.update(bulk_requests=args.bulk_requests, interactive_requests=args.interactive_requests,
                                 goal=f"interactive p99 queueing delay <= {BACKLOG_GOAL:g}x alone")
                elif scenario == "weights":
                    w = {ALPHA: args.tenant_weights.get(ALPHA, 1.0), BETA: args.tenant_weights.get(BETA, 1.0)}
                    entry.update(requests_per_tenant=args.weights_requests, tenant_weights=format_tenant_weights(w),
                                 target_ratio=w[ALPHA] / w[BETA])
                else:
                    entry.update(requests=args.throughput_requests, ratio=throughput_ratios(runs, modes))
                result[scenario] = entry
        finally:
            server.stop()
    result["elapsed_s"] = time.monotonic() - t_start
    return result


def format_report(result: dict[str, Any]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    modes = result["lanes_compare"]
    lines = [f"model {result['model']}, {result['workers']} worker(s), --lanes {' vs '.join(modes)}, "
             f"median of {result['rounds']} round(s) (alternating which mode goes first)"]
    if "backlog" in result:
        b = result["backlog"]
        lines += ["", f"backlog: {b['bulk_requests']} bulk requests at once, then {b['interactive_requests']} "
                      f"interactive; goal: {b['goal']}",
                  f"{'lanes':<12}{'last int. s':>12}{'bulk done':>11}{'share':>8}{'q p50 ms':>10}{'q p99 ms':>10}"
                  f"{'alone p50':>11}{'alone p99':>11}{'p99/alone':>11}{'alone last s':>14}"]
        for mode in modes:
            m = b["median"][mode]
            lines.append(f"{mode:<12}{num(m['interactive_last_finished_s'], '.2f'):>12}"
                         f"{num(m['bulk_finished_by_then'], '.0f'):>11}{num(m['bulk_finished_share'], '.0%'):>8}"
                         f"{ms(m['interactive_queue_delay_s.p50']):>10}{ms(m['interactive_queue_delay_s.p99']):>10}"
                         f"{ms(m['alone_queue_delay_s.p50']):>11}{ms(m['alone_queue_delay_s.p99']):>11}"
                         f"{num(m['p99_vs_alone'], '.1f'):>11}{num(m['alone_last_finished_s'], '.2f'):>14}")
        lines.append("  (last int. s: the interactive tenant's last request finished, seconds after its submission; "
                     "bulk done: bulk requests finished by then; q: queueing delay, started_at - enqueued_at)")
    if "weights" in result:
        w = result["weights"]
        lines += ["", f"weights: {w['requests_per_tenant']} requests each, {w['tenant_weights']} (target "
                      f"{w['target_ratio']:g}), alpha/beta while both had entries unread",
                  f"{'lanes':<12}{'window s':>10}{'delivered':>11}{'started':>10}{'out tokens':>12}"
                  f"{'both unfinished s':>19}{'out tokens':>12}"]
        for mode in modes:
            m = w["median"][mode]
            lines.append(f"{mode:<12}{num(m['window_s'], '.2f'):>10}{num(m['delivered_ratio'], '.2f'):>11}"
                         f"{num(m['started_ratio'], '.2f'):>10}{num(m['output_tokens_ratio'], '.2f'):>12}"
                         f"{num(m['both_unfinished_s'], '.2f'):>19}"
                         f"{num(m['both_unfinished_output_tokens_ratio'], '.2f'):>12}")
        lines.append("  (window: from the submission until one tenant had no entry left unread; delivered: entries "
                     "read from the queue by the workers; started: requests with started_at in the window; out "
                     "tokens: output tokens generated in the window; both unfinished: the same from the submission "
                     "until one tenant's last request finished)")
    if "throughput" in result:
        t = result["throughput"]
        base = result["baseline"]
        lines += ["", f"throughput: the standard workload, {t['requests']} requests at once, output tokens/s "
                      f"(ratio: over --lanes {base}, median of the rounds' ratios)",
                  f"{'lanes':<12}{'default tok/s':>15}{'ratio':>8}{'solo tok/s':>12}{'ratio':>8}"]
        for mode in modes:
            m, r = t["median"][mode], t["ratio"][mode]
            lines.append(f"{mode:<12}{num(m['tenants.default.output_tokens_per_s'], '.0f'):>15}"
                         f"{num(r[DEFAULT]['median'], '.3f'):>8}{num(m['tenants.solo.output_tokens_per_s'], '.0f'):>12}"
                         f"{num(r[SOLO]['median'], '.3f'):>8}")
        lines.append("  (default: every request of the default tenant, the plain stream; solo: of one other tenant, "
                     "its own lane under --lanes tenant)")
    lines.append(f"\n{result['elapsed_s']:.0f} s in all")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(build_parser(), run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())
