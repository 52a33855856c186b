"""KV-cache memory report: KV waste by block size, and concurrent sequences in a
fixed KV budget against contiguous allocators.

Owns the command::

    python -m mqinfer.loadgen.memory [--kv-budget 16384] [--block-sizes 8,16,32] [--json FILE]
        [--kv-cache-dtypes auto,int8 [--model M]]

**Paged (measured).** The real ``Scheduler`` with its real ``KVCacheManager`` and ``BlockPool``
runs the workload (all requests queued at once, in workload order) in a KV cache of
``--kv-budget`` token slots (``budget // block_size`` blocks). No model runs: after each
``schedule()`` this module plays the model's part and hands ``update_from_output()`` one sampled
token per request that needs one. That changes nothing the allocator sees: the workload's
requests use ``ignore_eos``, so each one's length is fixed by ``max_tokens``, and allocation
depends only on token counts (and, with ``--prefix-caching``, on prompt tokens, which are real).
``--engine`` cross-checks this by running the real ``LLMEngine`` (``--model tiny`` or a
checkpoint) on the same requests and comparing every step's figures.

**One step's figures** are read right after ``schedule()``, that is, the cache as the step's
forward pass finds and fills it: every running request is in ``SchedulerOutput.scheduled``;
*allocated slots* = distinct blocks those requests hold x block size (checked against the
pool's own count of used blocks); *tokens held* = for each request, its computed tokens plus
the ones scheduled this step (their KV is written by this step's forward pass). A block shared
through the prefix cache counts once. **KV waste** of a step = 1 - held / allocated.

**Saturation.** A step is *saturated* when, after ``schedule()``, requests are waiting, fewer
than ``max_num_seqs`` run, and the step's token budget is not used up. The scheduler's admission
loop stops for exactly three reasons (no budget left, ``max_num_seqs`` reached, no room in the
KV cache), so this rule picks the steps where a waiting request was refused for lack of KV
blocks (a preempted request counts as waiting). Averages and maxima are over saturated steps;
waste is the mean of the per-step ratios.

**Unavoidable waste** of a step = the slots that the last partial block of each running
sequence leaves empty, over the least slots that hold the step's tokens in blocks of that size
(tokens held + those empty slots; without sharing, sum(ceil(tokens / block_size) x block_size)):
the least any allocator with that block size could waste.
The *estimate* column is the usual rule of thumb, (block_size - 1) / 2 empty slots per sequence.

**Contiguous (simulated).** The same requests, in the same order, against an allocator that
gives each request one contiguous region of the same budget when it is admitted and takes it
back when the request finishes: (a) ``max_model_len`` slots per request (what static batching
with a preallocated cache reserves), (b) exactly ``prompt + max_tokens`` slots. Admission is
first come, first served, head of line (a request that does not fit stops admission, like the
paged scheduler), capped at ``max_num_seqs``. Placement is *first fit* in a linear address
space, so freed regions can leave holes too small for the next request (external
fragmentation); (b) is also reported under the *sum* rule (admit while the sum of reservations
is <= the budget, as if regions could be moved for free), an upper bound for any contiguous
allocator. A request holds its region for one step per output token (its prompt in the first),
the way the paged run advances; no token budget limits the contiguous runs, which only favours
them. Their saturated steps are those where the head of the queue did not fit.

Prefix caching is off unless ``--prefix-caching`` is given (then the shared-prefix workload is the
interesting one: ``--workload shared-prefix``).

**KV cache dtypes** (``--kv-cache-dtypes auto,int8``): the same memory, stored as each
``--kv-cache-dtype`` stores it. The memory is what ``--kv-budget`` slots take as ``auto`` for
``--model`` (its layers, KV heads, head size and dtype on this machine); each dtype gets as many
blocks of the first block size as fit in it at that dtype's real bytes per block (8-bit values
plus their bfloat16 scales), and the paged run (and the engine with ``--engine``, which then
runs with that KV cache dtype) reports concurrent sequences at saturation. Allocation depends
only on token counts, so the dtype changes the figures only through the number of blocks.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mqinfer.loadgen.checkpoint import STANDARD_CONFIG
from mqinfer.loadgen.memory_samples import StepRecorder, StepSample
from mqinfer.loadgen.memory_report import GOAL_CONCURRENCY_RATIO, kv_bytes_per_token, format_markdown
from mqinfer.loadgen.bench_options import WORKLOADS, positive_int_list
from mqinfer.loadgen.workload import MIN_TOKEN_ID, make_workload, workload_stats
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler

DEFAULT_KV_BUDGET = 16384
DEFAULT_BLOCK_SIZES = (8, 16, 32)
# The engine's own step limits: the allocators are compared under the limits a worker runs with.
DEFAULT_MAX_NUM_SEQS = SchedulerConfig().max_num_seqs
DEFAULT_MAX_NUM_BATCHED_TOKENS = SchedulerConfig().max_num_batched_tokens
FITS = ("first-fit", "sum")


# -- the paged run ----------------------------------------------------------------------------
@dataclass
class PagedRun:
    block_size: int
    num_kv_blocks: int
    samples: list[StepSample]
    num_preemptions: int
    num_recomputed_tokens: int


def _scheduler_config(block_size: int, kv_budget: int, max_model_len: int, max_num_seqs: int,
                      max_num_batched_tokens: int, prefix_caching: bool) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=block_size, num_kv_blocks=kv_budget // block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
    )


def run_paged(requests: Sequence[dict[str, Any]], block_size: int, kv_budget: int, *, max_model_len: int,
              max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
              max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
              prefix_caching: bool = False, seed: int = 0, vocab_size: int = 32000) -> PagedRun:
    """The real scheduler over ``requests`` with sampled tokens fed in place of a model."""
    config = _scheduler_config(block_size, kv_budget, max_model_len, max_num_seqs, max_num_batched_tokens,
                               prefix_caching)
    scheduler = Scheduler(config, clock=lambda: 0.0)
    recorder = StepRecorder(scheduler)
    engine_requests = []
    for r in requests:
        request = EngineRequest(
            request_id=r["id"], prompt_token_ids=list(r["prompt_token_ids"]),
            sampling=SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True),
            max_model_len=max_model_len,
        )
        scheduler.add_request(request)
        engine_requests.append(request)
    rng = random.Random(seed)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for request in out.finished:
            raise RuntimeError(f"request {request.request_id} ended inside schedule(): "
                               f"{request.status.name} {request.error or ''}".strip())
        if not out.scheduled:
            raise RuntimeError("the scheduler scheduled nothing while requests remain: the KV budget is too small")
        tokens = [rng.randrange(MIN_TOKEN_ID, vocab_size) if sr.needs_sample else None for sr in out.scheduled]
        scheduler.update_from_output(out, tokens)
    for request in engine_requests:
        if request.num_output_tokens != request.sampling.max_tokens:
            raise RuntimeError(f"request {request.request_id} generated {request.num_output_tokens} tokens, "
                               f"not its max_tokens {request.sampling.max_tokens}")
    return PagedRun(block_size, config.num_kv_blocks, recorder.samples, scheduler.num_preemptions_total,
                    sum(r.num_recompute_tokens for r in engine_requests))


def run_engine_paged(requests: Sequence[dict[str, Any]], block_size: int, kv_budget: int, *, model: str,
                     max_model_len: int, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                     max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                     prefix_caching: bool = False, num_threads: int | None = None,
                     kv_cache_dtype: str = "auto") -> PagedRun:
    """The same figures from the real engine (model forward passes, real sampling) on ``requests``."""
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=model, device="cpu", block_size=block_size, num_kv_blocks=kv_budget // block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching, num_threads=num_threads, kv_cache_dtype=kv_cache_dtype,
    ))
    scheduler = engine.scheduler
    recorder = StepRecorder(scheduler)
    generated: dict[str, int] = {}
    for r in requests:
        sampling = SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True)
        # Arrival 0 for all, as in the simulated run: the scheduling order is the workload order.
        engine.add_request(r["id"], list(r["prompt_token_ids"]), sampling, arrival_time=0.0)
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                generated[o.request_id] = len(o.output_token_ids)
    for r in requests:
        if generated.get(r["id"]) != int(r["max_tokens"]):
            raise RuntimeError(f"the engine generated {generated.get(r['id'])} tokens for {r['id']}, "
                               f"not its max_tokens {r['max_tokens']}")
    return PagedRun(block_size, engine.scheduler_config.num_kv_blocks, recorder.samples,
                    scheduler.num_preemptions_total, 0)


# -- the contiguous allocators ----------------------------------------------------------------
@dataclass
class ContiguousRun:
    name: str
    fit: str
    samples: list[StepSample]
    # Set when a single reservation is larger than the whole budget: nothing can ever run.
    never_fits: bool = False


def simulate_contiguous(requests: Sequence[dict[str, Any]], kv_budget: int, reservation: Callable[[int, int], int],
                        *, fit: str = "first-fit", max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                        name: str = "") -> ContiguousRun:
    """FIFO admission of one contiguous region per request (``reservation(prompt, max_tokens)`` slots).

    Every step each admitted request computes one more token (its whole prompt and the first
    output in its first step) and holds its region until its last output token. ``min_slots``
    of a sample is the reserved total (there are no blocks).
    """
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
    shapes = [(len(r["prompt_token_ids"]), int(r["max_tokens"])) for r in requests]
    sizes = [reservation(p, o) for p, o in shapes]
    for (p, o), size in zip(shapes, sizes):
        if size < p + o - 1:
            raise ValueError(f"a reservation of {size} slots cannot hold a request of {p} + {o} tokens")
    if max(sizes) > kv_budget:
        return ContiguousRun(name, fit, [], never_fits=True)
    # Placed regions as (start, end, request index), sorted by start for first fit.
    regions: list[tuple[int, int, int]] = []
    active: dict[int, int] = {}  # index -> output tokens produced so far
    reserved = 0
    head = 0
    samples: list[StepSample] = []
    while head < len(requests) or active:
        blocked = False
        while head < len(requests) and len(active) < max_num_seqs:
            size = sizes[head]
            if fit == "sum":
                if reserved + size > kv_budget:
                    blocked = True
                    break
                start = 0  # no addresses under the sum rule
            else:
                start = _first_fit(regions, size, kv_budget)
                if start is None:
                    blocked = True
                    break
            bisect.insort(regions, (start, start + size, head))
            active[head] = 0
            reserved += size
            head += 1
        held = 0
        for i, done in active.items():
            held += shapes[i][0] + done  # prompt + outputs before this step's: this step's KV
        samples.append(StepSample(reserved, held, reserved, len(active), blocked, held))
        finished = []
        for i in active:
            active[i] += 1
            if active[i] == shapes[i][1]:
                finished.append(i)
        for i in finished:
            del active[i]
            reserved -= sizes[i]
        if finished:
            gone = set(finished)
            regions = [reg for reg in regions if reg[2] not in gone]
    return ContiguousRun(name, fit, samples)


def _first_fit(regions: list[tuple[int, int, int]], size: int, capacity: int) -> int | None:
    """Lowest start of a free range of ``size`` slots among sorted ``regions``, or None."""
    pos = 0
    for start, end, _ in regions:
        if start - pos >= size:
            return pos
        pos = end
    return pos if capacity - pos >= size else None


# -- summaries --------------------------------------------------------------------------------
def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_samples(samples: Sequence[StepSample], kv_budget: int, block_size: int | None) -> dict[str, Any]:
    sat = [s for s in samples if s.saturated]
    out: dict[str, Any] = {
        "steps": len(samples),
        "saturated_steps": len(sat),
        "kv_waste": _mean([s.waste for s in sat]),
        "kv_waste_max": max((s.waste for s in sat), default=None),
        "kv_usage": _mean([s.allocated_slots / kv_budget for s in sat]),
        "concurrent_mean": _mean([s.num_running for s in sat]),
        "concurrent_max": max((s.num_running for s in sat), default=None),
        "concurrent_max_all_steps": max((s.num_running for s in samples), default=0),
    }
    if block_size is not None:
        out["unavoidable_waste"] = _mean([s.unavoidable_waste for s in sat])
        # Rule of thumb: (bs - 1) / 2 empty slots per sequence, against what the sequences hold.
        half = (block_size - 1) / 2
        out["estimate_waste"] = _mean([s.num_running * half / (s.held_tokens + s.num_running * half)
                                       for s in sat if s.num_running])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def memory_report(requests: Sequence[dict[str, Any]], *, kv_budget: int = DEFAULT_KV_BUDGET,
                  block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES, max_model_len: int,
                  max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                  max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, prefix_caching: bool = False,
                  seed: int = 0, vocab_size: int = 32000, engine_model: str | None = None,
                  num_threads: int | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every figure of the report, as plain data (what ``--json`` writes)."""
    for r in requests:
        need = len(r["prompt_token_ids"]) + int(r["max_tokens"])
        if need > max_model_len:
            raise ValueError(f"request {r['id']} needs {need} tokens, more than max_model_len {max_model_len}")
    say = progress or (lambda _m: None)
    contiguous: dict[str, dict[str, Any]] = {}
    plans = (
        ("max_len", "first-fit", lambda p, o: max_model_len),
        ("exact", "first-fit", lambda p, o: p + o),
        ("exact_sum", "sum", lambda p, o: p + o),
    )
    for name, fit, reserve in plans:
        t = time.perf_counter()
        run = simulate_contiguous(requests, kv_budget, reserve, fit=fit, max_num_seqs=max_num_seqs, name=name)
        summary = summarize_samples(run.samples, kv_budget, None)
        summary.update(fit=fit, never_fits=run.never_fits,
                       reserves="max_model_len" if name == "max_len" else "prompt + max_tokens")
        contiguous[name] = summary
        say(f"contiguous {name} ({fit}): {summary['steps']} steps in {time.perf_counter() - t:.2f}s")

    paged = []
    for bs in block_sizes:
        t = time.perf_counter()
        run = run_paged(requests, bs, kv_budget, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching, seed=seed,
                        vocab_size=vocab_size)
        summary = {"block_size": bs, "num_kv_blocks": run.num_kv_blocks, "kv_slots": run.num_kv_blocks * bs,
                   **summarize_samples(run.samples, run.num_kv_blocks * bs, bs),
                   "preemptions": run.num_preemptions, "recomputed_tokens": run.num_recomputed_tokens}
        mean = summary["concurrent_mean"]
        summary["ratio_vs_max_len"] = _ratio(mean, contiguous["max_len"]["concurrent_mean"])
        summary["ratio_vs_exact"] = _ratio(mean, contiguous["exact"]["concurrent_mean"])
        summary["ratio_vs_exact_sum"] = _ratio(mean, contiguous["exact_sum"]["concurrent_mean"])
        waste, floor = summary["kv_waste"], summary["unavoidable_waste"]
        summary["goal_waste_met"] = None if waste is None else waste <= floor + 1e-9
        ratio = summary["ratio_vs_max_len"]
        summary["goal_concurrency_met"] = None if ratio is None else ratio >= GOAL_CONCURRENCY_RATIO
        say(f"paged block size {bs}: {summary['steps']} steps in {time.perf_counter() - t:.2f}s")
        if engine_model is not None:
            t = time.perf_counter()
            eng = run_engine_paged(requests, bs, kv_budget, model=engine_model, max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   prefix_caching=prefix_caching, num_threads=num_threads)
            esum = summarize_samples(eng.samples, eng.num_kv_blocks * bs, bs)
            summary["engine"] = {
                "model": engine_model, "steps": esum["steps"], "saturated_steps": esum["saturated_steps"],
                "kv_waste": esum["kv_waste"], "concurrent_mean": esum["concurrent_mean"],
                "preemptions": eng.num_preemptions,
                "identical_to_simulation": eng.samples == run.samples,
            }
            say(f"engine block size {bs}: {esum['steps']} steps in {time.perf_counter() - t:.1f}s, "
                f"identical to the simulation: {eng.samples == run.samples}")
        paged.append(summary)

    stats = workload_stats(requests)
    return {
        "workload": {"num_requests": stats.num_requests, "prompt_tokens": stats.prompt_tokens,
                     "output_tokens": stats.output_tokens, "max_prompt_len": stats.max_prompt_len,
                     "max_output_len": stats.max_output_len},
        "kv_budget_tokens": kv_budget,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "prefix_caching": prefix_caching,
        "saturation_rule": "after schedule(): requests waiting, running < max_num_seqs, and the step's token "
                           "budget not used up (admission stopped for lack of KV blocks); contiguous: the head "
                           "of the queue did not fit",
        "paged": paged,
        "contiguous": contiguous,
    }


def model_kv_bytes_per_token(model: str, kv_cache_dtypes: Sequence[str]) -> dict[str, int]:
    """Bytes of one token's KV (all layers, scales included) for each KV cache dtype, for
    ``model`` loaded as the engine loads it on this machine's CPU."""
    from mqinfer.workers.engine.loader import load_model

    _, info = load_model(model, "cpu")
    return {d: info.kv_bytes_per_token_as(d) for d in kv_cache_dtypes}


def kv_dtype_report(requests: Sequence[dict[str, Any]], *, kv_cache_dtypes: Sequence[str],
                    bytes_per_token: dict[str, int], kv_budget: int, block_size: int, max_model_len: int,
                    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, prefix_caching: bool = False,
                    seed: int = 0, vocab_size: int = 32000, engine_model: str | None = None,
                    num_threads: int | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The same KV memory (``kv_budget`` slots at the first dtype's bytes per token) in each
    KV cache dtype: blocks, and concurrent sequences at saturation from the paged run."""
    say = progress or (lambda _m: None)
    memory = kv_budget * bytes_per_token[kv_cache_dtypes[0]]
    rows = []
    for dtype in kv_cache_dtypes:
        block_bytes = bytes_per_token[dtype] * block_size
        blocks = memory // block_bytes
        t = time.perf_counter()
        run = run_paged(requests, block_size, blocks * block_size, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        prefix_caching=prefix_caching, seed=seed, vocab_size=vocab_size)
        summary = summarize_samples(run.samples, blocks * block_size, block_size)
        row = {"kv_cache_dtype": dtype, "bytes_per_block": block_bytes, "num_kv_blocks": blocks,
               "steps": summary["steps"], "saturated_steps": summary["saturated_steps"],
               "concurrent_mean": summary["concurrent_mean"], "concurrent_max": summary["concurrent_max"],
               "concurrent_max_all_steps": summary["concurrent_max_all_steps"],
               "preemptions": run.num_preemptions}
        say(f"kv cache dtype {dtype}: {blocks} blocks, {summary['steps']} steps in {time.perf_counter() - t:.2f}s")
        if engine_model is not None:
            t = time.perf_counter()
            eng = run_engine_paged(requests, block_size, blocks * block_size, model=engine_model,
                                   max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching,
                                   num_threads=num_threads, kv_cache_dtype=dtype)
            row["engine_identical_to_simulation"] = eng.samples == run.samples
            say(f"engine, kv cache dtype {dtype}: {len(eng.samples)} steps in {time.perf_counter() - t:.1f}s, "
                f"identical to the simulation: {eng.samples == run.samples}")
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["blocks_ratio"] = _ratio(row["num_kv_blocks"], base["num_kv_blocks"])
        row["concurrency_ratio"] = _ratio(row["concurrent_mean"], base["concurrent_mean"])
    return {"memory_bytes": memory, "block_size": block_size, "rows": rows,
            "basis": f"{kv_budget} token slots as {kv_cache_dtypes[0]}"}


# -- output -----------------------------------------------------------------------------------
@dataclass
class _Setup:
    """What ``main`` settles on from the arguments before measuring anything."""
    requests: list[dict[str, Any]]
    max_model_len: int
    vocab_size: int
    engine_model: str | None  # the model --engine runs; None without --engine
    kv_model: str | None  # whose KV bytes per token --kv-cache-dtypes compares


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    max_model_len = _checked_max_model_len(parser, args)
    setup = _prepare(args, max_model_len)
    try:
        report = _measure(args, setup)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report["workload"].update(name=args.workload, seed=args.seed)
    given = sys.argv[1:] if argv is None else argv
    report["command"] = " ".join(["python -m mqinfer.loadgen.memory", *given])
    report["date_utc"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    kv_bytes = kv_bytes_per_token(STANDARD_CONFIG)
    report["kv_bytes_per_token_standard_checkpoint"] = kv_bytes
    print(format_markdown(report, kv_bytes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mqinfer.loadgen.memory",
        description="KV-cache memory report: KV waste at saturation for several block sizes, and concurrent "
                    "sequences in a fixed KV budget for the paged scheduler against contiguous allocators that "
                    "reserve max_model_len or exactly prompt + max_tokens per request. Drives the real "
                    "scheduler and KV cache manager with sampled tokens (no model needed: ignore_eos fixes "
                    "every length); --engine cross-checks with the real engine.",
        epilog="Prints markdown tables on stdout, progress on stderr; --json writes every figure.",
    )
    parser.add_argument("--kv-budget", type=int, default=DEFAULT_KV_BUDGET,
                        help=f"KV cache size in token slots, the same for every allocator (default: "
                             f"{DEFAULT_KV_BUDGET}; the standard workload needs about 55,000 to hold every request "
                             "at once). Paged runs get budget // block size blocks.")
    parser.add_argument("--block-sizes", type=positive_int_list, default=list(DEFAULT_BLOCK_SIZES),
                        help="Comma-separated block sizes (default: 8,16,32).")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="What the max-length contiguous allocator reserves per request (default: the standard "
                             f"checkpoint's max_position_embeddings, {STANDARD_CONFIG['max_position_embeddings']}).")
    parser.add_argument("--workload", choices=WORKLOADS, default="standard", help="Workload (default: standard).")
    parser.add_argument("--num-requests", type=int, default=256, help="Requests (default: 256).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default: 0).")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help=f"Running sequences at most, for every allocator (default: {DEFAULT_MAX_NUM_SEQS}, so "
                             "that the KV budget is the limit).")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="The paged scheduler's token budget per step "
                             f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}).")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="Turn the prefix cache on (shared blocks count once); try --workload shared-prefix.")
    parser.add_argument("--engine", action="store_true",
                        help="Also run the real LLMEngine per block size and check that every step's figures "
                             "match the simulation (slow with the standard checkpoint).")
    parser.add_argument("--model", default="tiny",
                        help="Model for --engine: tiny (default) or a checkpoint folder; 'standard' builds or reuses "
                             "the standard checkpoint.")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads for --engine.")
    parser.add_argument("--kv-cache-dtypes", type=_kv_cache_dtypes, default=None, metavar="D[,D...]",
                        help="Also compare KV cache dtypes (auto, int8, fp8; e.g. auto,int8) in the same memory: "
                             "what --kv-budget slots take as the first one for --model, at the first block size. "
                             "Reports blocks and concurrent sequences at saturation for each.")
    parser.add_argument("--json", metavar="FILE", default=None, help="Write every figure to FILE as JSON.")
    return parser


def _checked_max_model_len(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The contiguous allocator's reservation per request, once the arguments are checked (a
    parser error exits)."""
    max_model_len = args.max_model_len or int(STANDARD_CONFIG["max_position_embeddings"])
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if max_model_len < 2:
        parser.error("--max-model-len must be at least 2")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < args.max_num_seqs:
        parser.error("--max-num-seqs must be >= 1 and --max-num-batched-tokens >= --max-num-seqs")
    if args.kv_budget < max(args.block_sizes):
        parser.error(f"--kv-budget must hold at least one block of the largest block size ({max(args.block_sizes)})")
    return max_model_len


def _model_path(model: str) -> str:
    """``--model`` as a path or a name the loader takes: 'standard' builds or reuses the standard checkpoint."""
    if model == "standard":
        from mqinfer.loadgen.checkpoint import make_standard_checkpoint

        return str(make_standard_checkpoint())
    return model


def _prepare(args: argparse.Namespace, max_model_len: int) -> _Setup:
    """The models to run and the workload, its token ids drawn from the engine model's vocabulary."""
    vocab_size = int(STANDARD_CONFIG["vocab_size"])
    engine_model = None
    if args.engine:
        engine_model = _model_path(args.model)
        if engine_model == "tiny":
            from mqinfer.workers.engine.loader import TINY_BOS

            vocab_size = TINY_BOS  # the tiny model's byte ids, below its special tokens
        else:
            from mqinfer.loadgen.checkpoint import read_config

            vocab_size = int(read_config(engine_model)["vocab_size"])
    # Lengths are drawn before tokens, so the vocabulary changes token ids but never lengths.
    requests = make_workload(args.workload, n=args.num_requests, seed=args.seed, vocab_size=vocab_size)
    kv_model = engine_model
    if args.kv_cache_dtypes and kv_model is None:
        kv_model = _model_path(args.model)
    return _Setup(requests, max_model_len, vocab_size, engine_model, kv_model)


def _progress(message: str) -> None:
    print(f"[memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _measure(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    """The memory report for the block sizes and, with ``--kv-cache-dtypes``, the dtypes' comparison."""
    report = memory_report(
        setup.requests, kv_budget=args.kv_budget, block_sizes=args.block_sizes, max_model_len=setup.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.prefix_caching, seed=args.seed, vocab_size=setup.vocab_size,
        engine_model=setup.engine_model, num_threads=args.num_threads, progress=_progress,
    )
    if args.kv_cache_dtypes:
        report["kv_cache_dtypes"] = kv_dtype_report(
            setup.requests, kv_cache_dtypes=args.kv_cache_dtypes,
            bytes_per_token=model_kv_bytes_per_token(setup.kv_model, args.kv_cache_dtypes),
            kv_budget=args.kv_budget, block_size=args.block_sizes[0], max_model_len=setup.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            prefix_caching=args.prefix_caching, seed=args.seed, vocab_size=setup.vocab_size,
            engine_model=setup.engine_model, num_threads=args.num_threads, progress=_progress,
        )
        report["kv_cache_dtypes"]["model"] = setup.kv_model
    return report


def _kv_cache_dtypes(text: str) -> list[str]:
    from mqinfer.workers.config import KV_CACHE_DTYPES

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in KV_CACHE_DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected KV cache dtypes among {', '.join(KV_CACHE_DTYPES)}, got {text!r}")
    return names


if __name__ == "__main__":
    sys.exit(main())
