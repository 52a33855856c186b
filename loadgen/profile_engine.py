"""Where the engine's time goes: ``LLMEngine`` driven directly (no Redis, no sinks) on the standard
workload, beside transformers' static batching on the same requests in the same run.

Owns the engine profiling command::

    python -m mqinfer.loadgen.profile_engine [--num-requests 64] [--hf-batch-size 64] [--torch-profile]

It builds (or reuses) the standard checkpoint, takes a seeded subset of the standard workload,
warms both systems up, then times the engine (generated tokens per second over the whole run,
the number of steps, and the mean step time split into schedule / prepare inputs / forward /
sample / postprocess, from the engine's own ``phase_seconds``) and transformers' static
batching (``loadgen.hf_baseline.run_static``), and prints the ratio between them. The machine
may be shared and its load noisy: the ratio from one run means more than either figure alone,
and ``--repeat`` alternates the two systems several times. ``--torch-profile`` adds a
torch.profiler table of the top operators of a few engine steps.

Throughput counts the tokens the requests asked for (all of them, ``ignore_eos``) over the time
from the first step to the last, the same rule as ``mqinfer bench``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


@dataclass
class EngineFigures:
    tokens: int
    wall_s: float
    cpu_s: float  # CPU seconds of this process (all threads) over the run
    steps: int
    phase_seconds: dict[str, float]
    outputs: dict[str, list[int]]

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def _log(message: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_engine(model: str, args: argparse.Namespace):
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    config = EngineConfig(
        model=model, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.num_threads,
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        enable_prefix_caching=False, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )
    return LLMEngine(config)


def run_engine(engine, requests: list[dict[str, Any]], profiler=None) -> EngineFigures:
    """All requests added at once, then steps until none is left; returns the figures."""
    from mqinfer.scheduler.request import SamplingParams

    before = dict(engine.phase_seconds)
    steps_before = engine.num_steps
    outputs: dict[str, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for r in requests:
        sampling = SamplingParams(max_tokens=int(r["max_tokens"]), temperature=float(r["temperature"]),
                                  ignore_eos=bool(r["ignore_eos"]))
        engine.add_request(r["id"], r["prompt_token_ids"], sampling)
    while engine.has_unfinished():
        result = engine.step()
        for o in result.outputs:
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
        if profiler is not None:
            profiler.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    phases = {k: engine.phase_seconds[k] - before[k] for k in PHASES}
    tokens = sum(int(r["max_tokens"]) for r in requests)
    got = sum(len(v) for v in outputs.values())
    if got != tokens or len(outputs) != len(requests):
        raise RuntimeError(f"the engine generated {got} tokens for {len(outputs)} requests; "
                           f"expected {tokens} for {len(requests)}")
    return EngineFigures(tokens, wall, cpu, engine.num_steps - steps_before, phases, outputs)


def format_phases(fig: EngineFigures) -> str:
    busy = sum(fig.phase_seconds.values())
    steps = max(1, fig.steps)
    parts = [f"{k} {fig.phase_seconds[k] / steps * 1e3:.2f} ms ({fig.phase_seconds[k] / busy:.0%})"
             for k in PHASES] if busy > 0 else []
    outside = 1 - fig.phase_seconds["forward"] / busy if busy > 0 else 0.0
    return (f"{fig.steps} steps, mean step {busy / steps * 1e3:.2f} ms: " + ", ".join(parts)
            + f"; outside the forward pass: {outside:.1%}")


def _agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> str:
    from mqinfer.loadgen.metrics import token_agreement

    agreement = token_agreement(a, b)
    if agreement is None:
        return "no common requests"
    return str(agreement)


def prefill_latency(engine, prompt_len: int, repeats: int = 5) -> float:
    """Median seconds for one request alone to get its first token (its prefill step), on an
    otherwise idle engine: the least time to first token a prompt this long can have."""
    import statistics

    from mqinfer.scheduler.request import SamplingParams

    vocab = engine.info.vocab_size

    def once(k: int) -> float:
        ids = [3 + (i * 7919 + k * 104729) % (vocab - 3) for i in range(prompt_len)]  # no shared prefix
        engine.add_request(f"prefill-{prompt_len}-{k}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                          ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    once(-1)  # warm
    return statistics.median(once(k) for k in range(repeats))


def step_medians(engine, batch: int = 64, context: int = 200, prefill: int = 512,
                 steps: int = 150, prefills: int = 40, joins: int = 1) -> tuple[float, float]:
    """Median seconds of a decoding step (``batch`` sequences with ``context``-token prompts) and
    of a step where ``joins`` new ``prefill``-token prompts join them (a step of continuous
    batching: decodes and prompt chunks together): medians over many steps hold still on a noisy
    machine where a whole run's throughput moves by 10%."""
    import statistics

    from mqinfer.scheduler.request import SamplingParams

    vocab = engine.info.vocab_size
    longest = steps + prefills + 4
    for b in range(batch):
        ids = [3 + (b * 31 + i * 7) % (vocab - 3) for i in range(context)]
        engine.add_request(f"decode-{b}", ids, SamplingParams(max_tokens=longest, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()

    def timed_step() -> float:
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    decode = [timed_step() for _ in range(steps)]
    joined = []
    for k in range(prefills):
        for j in range(joins):
            ids = [3 + ((k * joins + j) * 131 + i * 17) % (vocab - 3) for i in range(prefill)]
            engine.add_request(f"join-{k}-{j}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        joined.append(timed_step())
    while engine.has_unfinished():
        engine.step()
    return statistics.median(decode), statistics.median(joined)


def ab_rounds(engine, requests: list[dict[str, Any]], setting: str, rounds: int) -> list[tuple[float, float]]:
    """The requests run alternately as the engine is and with the environment ``setting``
    (``VAR=VALUE``: the kernels' switches are read at every call, so one engine serves both),
    ``rounds`` times, alternating which goes first; each round's throughput ratio (as is / with the
    setting) by wall time and by CPU time, printed as it goes. The CPU-time ratio holds still on a
    shared machine, where other processes stretch wall time."""
    import os

    variable, _, value = setting.partition("=")
    if not variable or not value:
        raise ValueError(f"--ab takes VAR=VALUE, got {setting!r}")
    before = os.environ.get(variable)
    ratios, outputs = [], {}
    try:
        for k in range(rounds):
            got = {}
            for switched in ((False, True) if k % 2 == 0 else (True, False)):
                if switched:
                    os.environ[variable] = value
                elif before is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = before
                fig = run_engine(engine, [dict(r, id=f"{r['id']}-ab{k}{int(switched)}") for r in requests])
                got[switched] = fig
                outputs.setdefault(switched, {}).update({rid.rsplit("-", 1)[0]: ids for rid, ids in fig.outputs.items()})
                print(f"[{k}] {'with ' + setting if switched else 'as is':<40} {fig.throughput:8.1f} tok/s "
                      f"({fig.wall_s:.2f}s wall), {fig.tokens / fig.cpu_s:8.1f} tok per CPU-second")
            ratios.append((got[False].throughput / got[True].throughput, got[True].cpu_s / got[False].cpu_s))
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
    print(f"as is / with {setting} (wall, CPU): " + ", ".join(f"{w:.3f}x / {c:.3f}x" for w, c in ratios)
          + f"; greedy agreement: {_agreement(outputs[False], outputs[True])}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.repeat < 1:
        parser.error("--num-requests and --repeat must be at least 1")

    from mqinfer.procs import short_openmp_spin

    short_openmp_spin()  # the OpenMP setting a worker runs with (transformers measured no different)
    import torch

    work = _standard_requests(args)
    requests = work.requests
    t = time.perf_counter()
    engine = build_engine(work.model, args)
    _log(f"engine ready in {time.perf_counter() - t:.1f}s ({torch.get_num_threads()} threads)")
    if args.prefill_latency:
        try:
            lengths = [int(x) for x in args.prefill_latency.split(",")]
        except ValueError:
            parser.error(f"--prefill-latency takes comma-separated prompt lengths, got {args.prefill_latency!r}")
        for n in lengths:
            print(f"prompt of {n} tokens alone: first token after {prefill_latency(engine, n) * 1000:.1f} ms "
                  f"(median of 5, {torch.get_num_threads()} threads)")
        return 0
    if args.step_medians:
        if min(args.step_batch, args.step_prefill, args.step_joins) < 1:
            parser.error("--step-batch, --step-prefill and --step-joins must be at least 1")
        if args.step_prefill * args.step_joins + args.step_batch > args.max_num_batched_tokens:
            parser.error("the joining prompts and the decodes must fit one step: --step-prefill x --step-joins + "
                         "--step-batch at most --max-num-batched-tokens")
        decode, joined = step_medians(engine, batch=args.step_batch, prefill=args.step_prefill, joins=args.step_joins)
        print(f"decoding step ({args.step_batch} sequences) median {decode * 1e3:.2f} ms; step where "
              f"{args.step_joins} prompt(s) of {args.step_prefill} tokens join them median {joined * 1e3:.2f} ms "
              f"({torch.get_num_threads()} threads)")
        return 0
    warm = [dict(r, id=f"warm-{r['id']}", max_tokens=4) for r in requests[:8]]
    run_engine(engine, warm)
    if args.ab:
        print(f"profile_engine --ab: {work.stats.num_requests} standard requests, {args.dtype}, "
              f"{torch.get_num_threads()} threads")
        ab_rounds(engine, requests, args.ab, args.repeat)
        return 0
    _engine_beside_hf(args, engine, work)
    if args.ops:
        _time_ops(engine, requests, args.dtype)
    if args.torch_profile:
        _torch_profile(engine, requests, args.top)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.profile_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64, help="Requests of the standard workload (default: 64).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default: 0).")
    parser.add_argument("--model", default=None, help="Checkpoint folder (default: the standard checkpoint).")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", choices=("none", "w8a8", "w8a16"),
                        help="8-bit weights for the engine (default: none).")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
                        help="KV cache storage: the model dtype (auto) or 8 bits with a scale per token and KV "
                             "head (default: auto).")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: every core).")
    parser.add_argument("--hf-batch-size", type=int, default=64,
                        help="transformers static batch size; 0 skips the comparison (default: 64).")
    parser.add_argument("--repeat", type=int, default=1, help="Alternate engine and transformers this many times.")
    parser.add_argument("--torch-profile", action="store_true",
                        help="Also profile the engine's steps with torch.profiler and print the top operators.")
    parser.add_argument("--ops", action="store_true",
                        help="Also time the model's kernels op by op over one more run (CPU: the native kernels "
                             "torch.profiler cannot see into), each against its roof measured on this machine: "
                             "dense layers against PyTorch's matmul at the same shapes, attention and the "
                             "elementwise ops against copy bandwidth; and the time outside the ops. In that run the "
                             "decoder layers make one kernel call at a time, so that each is clocked (a bfloat16 "
                             "step on an AMX CPU otherwise runs them all in one native call).")
    parser.add_argument("--top", type=int, default=20, help="Rows of the torch.profiler table (default: 20).")
    parser.add_argument("--ab", default=None, metavar="VAR=VALUE",
                        help="Run the requests alternately as they are and with this environment setting (a kernel "
                             "switch such as MQINFER_CPU_LINEAR=torch or MQINFER_ATTENTION_AMX=off), --repeat rounds, "
                             "and print the ratios by wall and by CPU time; then exit.")
    parser.add_argument("--step-medians", action="store_true",
                        help="Only time steps: the median decoding step of --step-batch sequences, and the median "
                             "step where --step-joins prompts of --step-prefill tokens join them; then exit.")
    parser.add_argument("--step-batch", type=int, default=64, metavar="B",
                        help="For --step-medians: sequences decoding (default: 64).")
    parser.add_argument("--step-prefill", type=int, default=512, metavar="T",
                        help="For --step-medians: tokens of each joining prompt (default: 512).")
    parser.add_argument("--step-joins", type=int, default=1, metavar="N",
                        help="For --step-medians: prompts joining each timed step (default: 1).")
    parser.add_argument("--prefill-latency", default=None, metavar="L[,L...]",
                        help="Only time one request alone per prompt length (its prefill step: the least time to "
                             "first token such a prompt can have), e.g. 16,136,256; then exit.")
    return parser


@dataclass
class _Workload:
    """The checkpoint and the seeded subset of the standard workload (in its vocabulary) it runs."""
    model: str
    requests: list[dict[str, Any]]
    stats: Any  # loadgen.workload.WorkloadStats


def _standard_requests(args: argparse.Namespace) -> _Workload:
    """The checkpoint (built or reused when ``--model`` is not given) and the workload."""
    from mqinfer.loadgen.checkpoint import make_standard_checkpoint, read_config
    from mqinfer.loadgen.workload import standard_workload, workload_stats

    model = args.model or str(make_standard_checkpoint())
    config = read_config(model)
    requests = standard_workload(vocab_size=int(config["vocab_size"]), n=args.num_requests, seed=args.seed)
    stats = workload_stats(requests)
    _log(f"{stats.num_requests} requests, {stats.prompt_tokens} prompt tokens, {stats.output_tokens} output tokens")
    return _Workload(model, requests, stats)


def _engine_beside_hf(args: argparse.Namespace, engine, work: _Workload) -> None:
    """``--repeat`` rounds of the engine, each followed by transformers' static batching (unless
    ``--hf-batch-size 0``), and the ratios between them."""
    import torch

    requests, stats = work.requests, work.stats
    hf = None
    if args.hf_batch_size:
        from mqinfer.loadgen.hf_baseline import load_hf_model, warm_up

        hf = load_hf_model(work.model, dtype=args.dtype)
        warm_up(hf, requests)

    print(f"profile_engine: {stats.num_requests} standard requests (seed {args.seed}), {stats.prompt_tokens} prompt "
          f"+ {stats.output_tokens} output tokens, {args.dtype}, KV cache {args.kv_cache_dtype}, {torch.get_num_threads()} threads, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    ratios = []
    for k in range(args.repeat):
        fig = run_engine(engine, [dict(r, id=f"{r['id']}-{k}") for r in requests])
        print(f"[{k}] mqinfer engine: {fig.throughput:8.1f} tok/s ({fig.wall_s:.2f}s wall, {fig.cpu_s:.2f}s CPU); "
              f"{format_phases(fig)}")
        if hf is not None:
            ratios.append(_hf_round(k, fig, hf, requests, args.hf_batch_size))
    if ratios:
        print(f"ratio mqinfer / hf static@{args.hf_batch_size} (wall, CPU): "
              + ", ".join(f"{r:.2f}x / {c:.2f}x" for r, c in ratios))


def _hf_round(k: int, fig: EngineFigures, hf, requests: list[dict[str, Any]], batch_size: int) -> tuple[float, float]:
    """transformers' static batching on the requests after the engine's round ``k``; the ratios
    mqinfer / hf by wall time and by CPU time, printed with the greedy agreement."""
    from mqinfer.loadgen.hf_baseline import run_static

    c0 = time.process_time()
    base = run_static(hf, requests, batch_size, progress=None)
    hf_cpu = time.process_time() - c0
    ratio = fig.throughput / base.throughput
    # On a shared machine the CPU seconds each system got say more than wall time.
    cpu_ratio = hf_cpu / fig.cpu_s if fig.cpu_s > 0 else float("nan")
    ours = {rid.rsplit("-", 1)[0]: ids for rid, ids in fig.outputs.items()}
    print(f"[{k}] hf static@{batch_size}: {base.throughput:8.1f} tok/s "
          f"({base.summary.span_s:.2f}s wall, {hf_cpu:.2f}s CPU); mqinfer / hf = {ratio:.2f}x by wall "
          f"time, {cpu_ratio:.2f}x by CPU time; greedy agreement: {_agreement(ours, base.outputs)}")
    return ratio, cpu_ratio


def _time_ops(engine, requests: list[dict[str, Any]], dtype: str) -> None:
    """One more run with the model's kernels timed op by op, then each op's roof measured on this
    machine (loadgen/op_roofs.py), and their table."""
    from mqinfer.loadgen.op_roofs import measure_roofs, roof_table
    from mqinfer.loadgen.op_timer import timing_ops

    with timing_ops(engine.model) as times:
        fig = run_engine(engine, [dict(r, id=f"{r['id']}-ops") for r in requests])
    _log("measuring each op's roof: the copy bandwidth and the matmul rate at every dense op's shape")
    roofs = measure_roofs(times, dtype)
    print(f"op by op ({fig.steps} steps, forward {fig.phase_seconds['forward']:.2f}s of {fig.wall_s:.2f}s; the "
          f"clocks add a few microseconds per call; copy bandwidth {roofs.copy_bytes_per_s / 1e9:.2f} GB/s):")
    print(roof_table(times, roofs, fig.phase_seconds["forward"], fig.phase_seconds))


def _torch_profile(engine, requests: list[dict[str, Any]], top: int) -> None:
    """One more run under torch.profiler, and its ``top`` operators by their own CPU time."""
    from torch.profiler import ProfilerActivity, profile, schedule

    steps = schedule(wait=2, warmup=2, active=20, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=steps, record_shapes=False) as prof:
        run_engine(engine, [dict(r, id=f"{r['id']}-prof") for r in requests], profiler=prof)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


if __name__ == "__main__":
    sys.exit(main())
