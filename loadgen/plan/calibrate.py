"""Calibration for `mqinfer plan`: the real engine run on a few batch shapes, its steps timed and fitted.

``calibrate(config)`` builds an ``LLMEngine`` from the worker's engine configuration (prefix
caching off, so that repeated prompts are computed every time), runs a fixed set of scenarios
directly on it (no Redis, no worker loop) and times every step together with its shape (batched
tokens, requests, attention pairs):

- single prompts of 16 tokens up to the step's token budget (prefill steps: many tokens, one
  request, about L*L/2 pairs);
- several 64-token prompts admitted in one step (many tokens and many requests, few pairs each);
- decode batches of 1 request up to ``max_num_seqs`` at a short context (tokens = requests);
- decode batches at a long context (the pairs grow, the tokens do not);
- a long prompt chunk joining a running decode batch (a mixed step).

The steps are fitted by ``model.fit_step_costs``; how far repeated steps of one shape fall
from their median is kept as the spread the simulation draws step times from (``step_noise``).
Then short runs of the real pipeline (pipeline) measure what the engine alone does not
show: a worker's start-up, the worker loop around the engine (gaps between steps, flushes of
result rows, the wake-up on an arrival) and a fresh worker's slow first steps.

Where the layout puts several workers on one CPU machine, a few of the shapes are timed again
while other engine processes (``--contention-probe``) run busily beside this one: how much slower
a step gets when workers share the cores (``contention``), at one other engine and at all of them.

Without the pipeline runs (``pipeline=False``) the loop is left out and the start-up is that of
a fresh process that only builds the engine. The whole calibration stays within a time budget (two
minutes on two cores for the tiny model); shapes that would not fit in it are left out and the
fit says how many steps it had.

``python -m mqinfer.loadgen.plan.calibrate --startup-probe JSON`` is that fresh process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from mqinfer.loadgen.plan.model import (
    Calibration,
    StepSample,
    StepShape,
    contention_probes,
    fit_step_costs,
    now_text,
    processor_name,
    quantile_samples,
)
from mqinfer.loadgen.plan.pipeline import measure_pipeline

log = logging.getLogger("mqinfer.plan")

# The engine settings a start-up probe passes on to its fresh process.
_PROBE_FIELDS = ("model", "device", "dtype", "quantization", "kv_cache_dtype", "num_threads", "num_kv_blocks",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "tensor_parallel_size",
                 "pipeline_parallel_size")


@dataclass(frozen=True)
class Scenario:
    """Requests added to the engine at once, run until all are done; ``late`` requests join after
    ``late_after_steps`` steps (a prompt arriving while others decode). Each entry of ``requests``
    and ``late`` is (count, prompt tokens, output tokens)."""

    name: str
    requests: tuple[tuple[int, int, int], ...]
    repeats: int = 1
    late: tuple[tuple[int, int, int], ...] = ()
    late_after_steps: int = 0

    def num_blocks(self, block_size: int) -> int:
        """KV blocks the scenario holds at its peak (every request at its full length)."""
        entries = (*self.requests, *self.late)
        return sum(count * -(-(prompt + output) // block_size) for count, prompt, output in entries)


def scenarios(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_kv_blocks: int,
              block_size: int) -> list[Scenario]:
    """The calibration scenarios that fit the engine's limits, cheapest kinds first, so that a short
    time budget still covers every feature."""
    longest = min(max_num_batched_tokens, max_model_len - 1)
    out: list[Scenario] = []
    for length in (16, 64, 256, 1024, 2048, 4096):
        if length <= longest:
            out.append(Scenario(f"prefill {length}", ((1, length, 1),), repeats=3))
    for count in (4, 16, 64):
        if count <= max_num_seqs and count * 64 <= max_num_batched_tokens:
            out.append(Scenario(f"prefill {count}x64", ((count, 64, 1),), repeats=2))
    batches = sorted({b for b in (1, 8, 32, 128, 256) if b <= max_num_seqs} | {max_num_seqs})
    for batch in batches:
        out.append(Scenario(f"decode {batch} at 32", ((batch, 32, 12),), repeats=2))
    context = min(1024, max_model_len - 16)
    if context > 64:
        for batch in (4, 32):
            if batch <= max_num_seqs:
                out.append(Scenario(f"decode {batch} at {context}", ((batch, context, 8),)))
    mixed = min(32, max_num_seqs - 1)
    prompt = min(512, longest - mixed)
    if mixed >= 1 and prompt >= 16:
        out.append(Scenario(f"prefill {prompt} with {mixed} decoding", ((mixed, 32, 24),),
                            late=((1, prompt, 1),), late_after_steps=4))
    return [s for s in out if s.num_blocks(block_size) <= num_kv_blocks]


def _prompt(length: int, salt: int) -> list[int]:
    # Byte-range ids (valid for every model); the salt keeps prompts apart.
    return [3 + (salt * 7919 + i * 31) % 250 for i in range(length)]


def run_scenario(engine, scenario: Scenario, salt: int) -> list[StepSample]:
    """Every step of one run of ``scenario`` with its shape and wall seconds."""
    from mqinfer.scheduler.request import SamplingParams

    def add(entries, tag: str) -> None:
        k = 0
        for count, prompt, output in entries:
            for _ in range(count):
                engine.add_request(f"calib-{salt}-{tag}-{k}", _prompt(prompt, salt * 1000 + k),
                                   SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
                k += 1

    add(scenario.requests, "a")
    samples: list[StepSample] = []
    steps = 0
    late_added = not scenario.late
    while engine.has_unfinished() or not late_added:
        if not late_added and steps >= scenario.late_after_steps:
            add(scenario.late, "b")
            late_added = True
        t0 = time.perf_counter()
        result = engine.step()
        seconds = time.perf_counter() - t0
        steps += 1
        if result.work:
            samples.append(StepSample(StepShape.of((w.num_tokens, w.context_len) for w in result.work), seconds))
    return samples


def median_by_shape(samples: list[StepSample]) -> list[StepSample]:
    """One sample per distinct step shape, with the median of its measured times: a step that
    another process on the machine slowed down counts less than in a plain fit."""
    by_shape: dict[StepShape, list[float]] = {}
    for sample in samples:
        by_shape.setdefault(sample.shape, []).append(sample.seconds)
    return [StepSample(shape, statistics.median(times)) for shape, times in by_shape.items()]


def step_noise(samples: list[StepSample]) -> list[float]:
    """Each measured step of a shape measured more than once over its shape's median: how much a
    step's time varies on this machine (its slow tail included)."""
    by_shape: dict[StepShape, list[float]] = {}
    for sample in samples:
        by_shape.setdefault(sample.shape, []).append(sample.seconds)
    return [t / statistics.median(times) for times in by_shape.values() if len(times) > 1 for t in times]


def measure_startup(config, timeout_s: float = 300.0) -> float:
    """Seconds from starting a fresh Python process to its engine being ready (imports included)."""
    settings = {name: getattr(config, name) for name in _PROBE_FIELDS}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mqinfer.loadgen.plan.calibrate", "--startup-probe",
                             json.dumps(settings)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        ready = time.perf_counter() - t0
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"the start-up probe took more than {timeout_s:.0f}s") from None
    if proc.returncode != 0 or line.strip() != "ready":
        raise RuntimeError(f"the start-up probe failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return ready


# What a contention probe's engine keeps running: prompts and decodes together, like a busy worker.
_BUSY = Scenario("busy", ((16, 64, 16),))
# The shapes timed again beside busy engines (those of them that fit the engine's limits).
_CONTENTION_SHAPES = ("prefill 256", "prefill 4x64", "decode 8 at 32", "decode 32 at 32")
def _start_probes(config, count: int, timeout_s: float = 300.0) -> list[subprocess.Popen]:
    """``count`` fresh processes, each running an engine busily until its stdin closes."""
    settings = {name: getattr(config, name) for name in _PROBE_FIELDS}
    settings["enable_prefix_caching"] = False
    procs = [subprocess.Popen([sys.executable, "-m", "mqinfer.loadgen.plan.calibrate", "--contention-probe",
                               json.dumps(settings)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(count)]
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        line = proc.stdout.readline().strip()
        late = time.monotonic() > deadline
        if line != "busy" or late:
            _stop_probes(procs)
            why = f"took more than {timeout_s:.0f}s to start" if late else f"failed (exit {proc.poll()}): {line!r}"
            raise RuntimeError(f"a contention probe {why}")
    return procs


def _stop_probes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def slowdown(alone: list[StepSample], loaded: list[StepSample]) -> float:
    """The median over step shapes of (median seconds beside busy engines) / (median alone),
    at least 1: other engines cannot make a step faster, and a ratio below 1 is noise."""
    def medians(samples):
        by_shape: dict[StepShape, list[float]] = {}
        for sample in samples:
            by_shape.setdefault(sample.shape, []).append(sample.seconds)
        return {shape: statistics.median(times) for shape, times in by_shape.items()}

    base, busy = medians(alone), medians(loaded)
    ratios = [busy[shape] / base[shape] for shape in busy if shape in base and base[shape] > 0]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def measure_contention(engine, config, chosen: list[Scenario], alone: list[StepSample],
                       progress: Callable[[str], None]) -> list[float]:
    """Step slowdowns beside 1, 2, ... busy engines (as many as the layout puts beside a worker on
    one machine): a few of the calibration's shapes timed again with other engine processes
    running; measured at one other and at all of them, interpolated in between."""
    most = contention_probes(config)
    if most < 1:
        return []
    timed = [s for s in chosen if s.name in _CONTENTION_SHAPES] or chosen[:3]
    measured: dict[int, float] = {}
    for others in sorted({1, most}):
        progress(f"calibration: timing steps beside {others} busy engine(s) (workers sharing this machine)")
        procs = _start_probes(config, others)
        try:
            loaded: list[StepSample] = []
            for i, scenario in enumerate(timed):
                for r in range(max(2, scenario.repeats)):
                    loaded += run_scenario(engine, scenario, salt=10_000 + 100 * i + r)
        finally:
            _stop_probes(procs)
        measured[others] = slowdown(alone, loaded)
    low, high = measured[1], measured[most]
    factors = [low + (high - low) * (k - 1) / max(1, most - 1) for k in range(1, most + 1)]
    progress("calibration: a step beside busy engines takes " + ", ".join(
        f"{f:.2f}x ({k} other{'s' if k > 1 else ''})" for k, f in measured.items()))
    return factors


def calibrate(config, *, budget_s: float = 60.0, model_id: str = "", pipeline: bool = True,
              progress: Callable[[str], None] = log.info) -> Calibration:
    """Fit the step-cost model of ``config`` (an ``EngineConfig``) on this machine, timing batch
    shapes for at most ``budget_s`` seconds; with ``pipeline``, also measure the worker loop's
    overheads and start-up on the real pipeline."""
    from mqinfer.workers.engine.core import LLMEngine

    started = time.perf_counter()
    startup_s = None
    if not pipeline:
        progress("calibration: measuring the start-up of a fresh engine process")
        startup_s = measure_startup(config)
    progress("calibration: timing engine steps on a few batch shapes")
    # The KV cache as a worker sizes it, recorded for the plan; the calibration engine itself runs
    # without prefix caching so that repeated prompts are computed again.
    engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False))
    try:
        sc = engine.scheduler_config
        chosen = scenarios(sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, sc.num_kv_blocks,
                           sc.block_size)
        # Warm-up (lazy initialisation, first-touch allocations): not measured.
        run_scenario(engine, Scenario("warm-up", ((4, 64, 8),)), salt=0)
        samples: list[StepSample] = []
        salt = 1
        skipped = []
        shapes_started = time.perf_counter()
        for scenario in chosen:
            for _ in range(scenario.repeats):
                if time.perf_counter() - shapes_started > budget_s:
                    skipped.append(scenario.name)
                    break
                samples += run_scenario(engine, scenario, salt)
                salt += 1
        device, threads = str(engine.device), engine.num_threads
        contention = measure_contention(engine, config, chosen, samples, progress)
    finally:
        engine.close()
    if skipped:
        progress(f"calibration: time budget {budget_s:.0f}s reached; left out: {', '.join(skipped)}")
    model, quality = fit_step_costs(median_by_shape(samples))
    progress(f"calibration: {quality.num_steps} steps fitted ({quality.num_dropped} outliers dropped), median "
             f"error {100 * quality.median_abs_rel_error:.1f}%, p90 {100 * quality.p90_abs_rel_error:.1f}%")
    calibration = Calibration(
        model=model, quality=quality, startup_s=startup_s or 0.0, num_kv_blocks=sc.num_kv_blocks,
        block_size=sc.block_size, max_model_len=sc.max_model_len, max_num_seqs=sc.max_num_seqs,
        model_id=model_id or str(config.model), device=device, num_threads=threads,
        machine={"processor": processor_name(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        measured_at=now_text(), step_noise=quantile_samples(step_noise(samples)), contention=contention,
    )
    if pipeline:
        calibration = measure_pipeline(config, calibration, progress=progress)
        if calibration.startup_source != "worker":
            calibration = dataclasses.replace(calibration, startup_s=measure_startup(config))
    calibration.calibration_s = time.perf_counter() - started
    return calibration


def _startup_probe(settings_json: str) -> int:
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    logging.disable(logging.INFO)
    engine = LLMEngine(EngineConfig(**json.loads(settings_json)))
    print("ready", flush=True)
    engine.close()
    return 0


def _contention_probe(settings_json: str) -> int:
    """Keep an engine busy (prompts and decodes) until stdin closes."""
    import threading

    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    logging.disable(logging.INFO)
    engine = LLMEngine(EngineConfig(**json.loads(settings_json)))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    run_scenario(engine, Scenario("warm-up", ((4, 64, 8),)), salt=0)
    print("busy", flush=True)
    salt = 1
    while not stop.is_set():
        run_scenario(engine, _BUSY, salt)
        salt += 1
    engine.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--startup-probe":
        sys.exit(_startup_probe(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--contention-probe":
        sys.exit(_contention_probe(sys.argv[2]))
    print("usage: python -m mqinfer.loadgen.plan.calibrate --startup-probe JSON | --contention-probe JSON",
          file=sys.stderr)
    sys.exit(2)
