"""`mqinfer plan`: the step-cost fit, the simulation with the real scheduler and batcher, the worker
count search, the bill, and the command (its JSON contract, its errors, a real calibration)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mqinfer import cli
from mqinfer.loadgen.plan import command as planner
from mqinfer.loadgen.plan.model import (
    Calibration,
    FitQuality,
    StepCostModel,
    StepSample,
    StepShape,
    WorkerLoop,
    chunk_pairs,
    fit_step_costs,
    load_calibration,
    nnls,
    quantile_samples,
    save_calibration,
)
from mqinfer.loadgen.plan.options import PLAN_CMD
from mqinfer.loadgen.plan.sim import SimRequest, WorkerSettings, simulate
from mqinfer.scheduler.config import SchedulerConfig

CONTRACT_KEYS = {"output_tokens_per_s", "workers", "ttft_p99_s", "cost_per_request_usd", "cost_per_million_tokens_usd"}


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(3 + (salt * 131 + i * 7) % 250 for i in range(n))


def _settings(max_wait_ms: float = 0.0, flush_interval_s: float = 0.5, **scheduler) -> WorkerSettings:
    base = dict(num_kv_blocks=4096, max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048)
    return WorkerSettings(SchedulerConfig(**{**base, **scheduler}), max_batch=64, max_wait_ms=max_wait_ms,
                          flush_interval_s=flush_interval_s)


# -- the fit -------------------------------------------------------------------------------------
def test_chunk_pairs_counts_causal_query_key_pairs():
    assert chunk_pairs(1, 10) == 10  # one decode token attends to the whole context
    assert chunk_pairs(4, 4) == 1 + 2 + 3 + 4  # a 4-token prompt
    assert chunk_pairs(2, 6) == 5 + 6  # a chunk at positions 4 and 5
    # A prompt chunk's pairs and a decode token's context are counted apart.
    shape = StepShape.of([(4, 4), (1, 10), (1, 7)])
    assert (shape.tokens, shape.seqs, shape.pairs, shape.decode_context) == (6, 3, 10, 17)


def test_nnls_solves_and_keeps_coefficients_non_negative():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert np.allclose(nnls(a, a @ np.array([2.0, 3.0])), [2.0, 3.0])
    # The unconstrained answer has a negative second coefficient: it is clamped to 0.
    x = nnls(np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]), np.array([3.0, 2.0, 1.0]))
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)


def _synthetic_samples(truth: StepCostModel, noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    shapes = [StepShape.of([(length, length)]) for length in (16, 64, 256, 1024, 2048)]
    shapes += [StepShape.of([(64, 64)] * k) for k in (4, 16, 64)]
    shapes += [StepShape.of([(1, ctx)] * b) for b in (1, 8, 32, 128, 256) for ctx in (40, 1000)]
    return [StepSample(s, truth.step_seconds(s) * (1 + noise * rng.standard_normal())) for s in shapes * 4]


def test_the_fit_recovers_a_known_step_cost_function():
    truth = StepCostModel(step_s_fixed=0.002, token_s=5e-5, seq_s=3e-5, pair_s=1.2e-7, decode_ctx_s=4e-7)
    model, quality = fit_step_costs(_synthetic_samples(truth, noise=0.02))
    for got, want in zip(model.coefficients, truth.coefficients):
        assert got == pytest.approx(want, rel=0.1)
    assert quality.median_abs_rel_error < 0.03
    # Exact data: exact coefficients.
    exact, _ = fit_step_costs(_synthetic_samples(truth, noise=0.0))
    for got, want in zip(exact.coefficients, truth.coefficients):
        assert got == pytest.approx(want, rel=1e-6)


def test_the_fit_drops_steps_another_process_slowed_down():
    truth = StepCostModel(step_s_fixed=0.002, token_s=5e-5, seq_s=3e-5, pair_s=1.2e-7, decode_ctx_s=4e-7)
    samples = _synthetic_samples(truth, noise=0.01)
    slowed = [StepSample(s.shape, s.seconds * 6) for s in samples[::15]]
    model, quality = fit_step_costs(samples + slowed)
    assert quality.num_dropped >= len(slowed)
    for got, want in zip(model.coefficients, truth.coefficients):
        assert got == pytest.approx(want, rel=0.1)


def test_repeated_shapes_count_once_at_their_median():
    from mqinfer.loadgen.plan.calibrate import median_by_shape

    a, b = StepShape.of([(64, 64)]), StepShape.of([(1, 40)] * 8)
    merged = median_by_shape([StepSample(a, 0.010), StepSample(a, 0.090), StepSample(a, 0.012),
                              StepSample(b, 0.004)])
    assert sorted((s.shape.tokens, s.seconds) for s in merged) == [(8, 0.004), (64, 0.012)]


def test_a_fit_needs_enough_steps_and_coefficients_are_checked():
    with pytest.raises(ValueError, match="at least 5"):
        fit_step_costs([StepSample(StepShape(1, 1, 1), 0.01)])
    with pytest.raises(ValueError, match="token_s"):
        StepCostModel(0.001, -1.0, 0.0, 0.0)


def test_a_stored_calibration_reads_back(tmp_path):
    calibration = _calibration(step_overhead_s=-0.0001, gap_samples_s=[0.0004, 0.001], wake_samples_s=[0.001, 0.009],
                               flush_samples_s=[0.02, 0.03], step_noise=[0.97, 1.0, 1.2], first_step_s=0.5,
                               step_noise_bounds_s=[0.004], step_noise_by_size=[[1.1, 1.3], [1.0]])
    save_calibration(calibration, tmp_path / "plan" / "fit.json")
    assert load_calibration(tmp_path / "plan" / "fit.json") == calibration
    assert calibration.loop == WorkerLoop(-0.0001, (0.0004, 0.001), (0.001, 0.009), (0.02, 0.03), (0.97, 1.0, 1.2), 0.5,
                                          step_noise_bounds_s=(0.004,), step_noise_by_size=((1.1, 1.3), (1.0,)))
    assert load_calibration(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert load_calibration(tmp_path / "bad.json") is None


# -- the simulation --------------------------------------------------------------------------------
MODEL = StepCostModel(step_s_fixed=0.001, token_s=1e-5, seq_s=2e-5, pair_s=1e-8, decode_ctx_s=3e-8)


def test_one_request_alone_waits_for_the_batcher_then_its_prefill_step():
    for wait_ms in (0.0, 10.0):
        req = SimRequest("a", _prompt(100), output_tokens=5, arrival_s=1.0)
        sim = simulate([req], 1, _settings(max_wait_ms=wait_ms), MODEL)
        o = sim.outcomes[0]
        prefill = MODEL.step_seconds(StepShape.of([(100, 100)]))
        assert o.ttft_s == pytest.approx(wait_ms / 1000 + prefill)
        # Then one decode step per further token, each at its context length.
        decodes = sum(MODEL.step_seconds(StepShape.of([(1, 100 + k)])) for k in range(1, 5))
        assert o.finished_s - o.first_token_s == pytest.approx(decodes)
        assert o.output_tokens == 5 and sim.num_steps == 5


def test_the_simulation_plans_steps_to_latency_targets_as_the_worker_does():
    """The plan runs the real scheduler: interactive requests beside a backlog decode at their
    target, as on a worker, instead of at the backlog's step time."""
    def tpot_s(targets: dict) -> float:
        bulk = [SimRequest(f"b{i}", _prompt(128, i), 300) for i in range(100)]
        chats = [SimRequest(f"c{i}", _prompt(32, 500 + i), 40, arrival_s=1.0 + 0.2 * i, tenant="chat", **targets)
                 for i in range(4)]
        sim = simulate(bulk + chats, 1, _settings(max_num_seqs=128), MODEL)
        assert [o.output_tokens for o in sim.outcomes] == [r.output_tokens for r in bulk + chats]
        return max(o.tpot_s for o in sim.outcomes[100:])

    backlog_step = MODEL.step_seconds(StepShape.of([(1, 200)] * 101))
    assert tpot_s({}) == pytest.approx(backlog_step, rel=0.3)
    assert tpot_s({"slo_ttft_ms": 500, "slo_tpot_ms": 2}) <= 0.002


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    sim = simulate([SimRequest("a", _prompt(300), 2)], 1, _settings(max_num_batched_tokens=128), MODEL)
    chunks = [(128, 128), (128, 256), (44, 300)]
    assert sim.outcomes[0].ttft_s == pytest.approx(sum(MODEL.step_seconds(StepShape.of([c])) for c in chunks))


def test_every_request_generates_exactly_its_output_length():
    reqs = [SimRequest(f"r{i}", _prompt(10 + i, i), output_tokens=1 + i % 7) for i in range(30)]
    sim = simulate(reqs, 2, _settings(max_num_seqs=4), MODEL)
    assert [o.output_tokens for o in sim.outcomes] == [r.output_tokens for r in reqs]
    assert all(o.error is None and o.finished_s >= o.first_token_s >= o.arrival_s for o in sim.outcomes)


def test_throughput_saturates_at_the_batch_limit():
    # Every step costs 1 ms whatever it holds: output tokens per second = requests per step.
    flat = StepCostModel(0.001, 0.0, 0.0, 0.0)
    reqs = [SimRequest(f"r{i}", _prompt(16, i), output_tokens=50) for i in range(40)]
    from mqinfer.loadgen.plan.command import summarize

    for seqs in (4, 8):
        ev = summarize(simulate(reqs, 1, _settings(max_num_seqs=seqs), flat))
        assert ev.output_tokens_per_s == pytest.approx(seqs * 1000, rel=0.02)
    # Twice as many workers, twice the throughput of a saturated one.
    ev = summarize(simulate(reqs, 2, _settings(max_num_seqs=4), flat))
    assert ev.output_tokens_per_s == pytest.approx(8000, rel=0.05)


def test_pooled_simulations_take_percentiles_over_every_request_and_average_the_rest():
    from mqinfer.loadgen.plan.target import summarize, summarize_pooled

    reqs = [SimRequest(f"r{i}", _prompt(16, i), output_tokens=20, arrival_s=0.01 * i) for i in range(30)]
    loop = WorkerLoop(step_noise=[0.5, 1.0, 3.0])  # each draw's steps differ
    sims = [simulate(reqs, 1, _settings(), MODEL, loop=loop, seed=k) for k in range(3)]
    pooled, alone = summarize_pooled(sims), [summarize(s) for s in sims]
    assert summarize_pooled(sims[:1]) == alone[0]
    ttfts = sorted(o.ttft_s for s in sims for o in s.outcomes)
    assert pooled.ttft_p99_s == pytest.approx(np.percentile(ttfts, 99))
    assert pooled.output_tokens_per_s == pytest.approx(sum(e.output_tokens_per_s for e in alone) / 3)
    assert pooled.num_requests == 30 and len({e.ttft_p99_s for e in alone}) > 1


def test_the_kv_cache_limit_preempts_as_the_engine_does():
    reqs = [SimRequest(f"r{i}", _prompt(64, i), output_tokens=64) for i in range(8)]
    roomy = simulate(reqs, 1, _settings(), MODEL)
    tight = simulate(reqs, 1, _settings(num_kv_blocks=24, max_model_len=128), MODEL)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert tight.end_s > roomy.end_s
    assert all(o.output_tokens == 64 for o in tight.outcomes)


def test_a_prompt_too_long_for_the_context_is_an_error_not_a_hang():
    reqs = [SimRequest("long", _prompt(300), 4), SimRequest("ok", _prompt(20), 4)]
    sim = simulate(reqs, 1, _settings(max_model_len=256), MODEL)
    assert sim.outcomes[0].error == "prompt_too_long" and sim.outcomes[1].error is None


def test_arrivals_to_an_idle_worker_pay_the_wake_up_and_every_step_the_loop_gap():
    req = SimRequest("a", _prompt(50), 3, arrival_s=0.5)
    plain = simulate([req], 1, _settings(), MODEL).outcomes[0]
    loop = WorkerLoop(step_overhead_s=0.0005, gap_samples_s=[0.0015], wake_samples_s=[0.004])
    slow = simulate([req], 1, _settings(), MODEL, loop=loop).outcomes[0]
    assert plain.to_idle_worker and slow.to_idle_worker
    # The wake-up, then before each step the gap (a request starts with its engine step).
    assert slow.started_s - slow.arrival_s == pytest.approx(0.004 + 0.002)
    assert slow.ttft_s == pytest.approx(plain.ttft_s + 0.004 + 0.002)
    assert slow.finished_s - slow.first_token_s == pytest.approx(plain.finished_s - plain.first_token_s + 2 * 0.002)
    # Measured wake-ups: one drawn for each arrival to an idle worker, the same draws for a seed.
    reqs = [SimRequest(f"r{i}", _prompt(20, i), 2, arrival_s=1.0 + i) for i in range(40)]
    draws = WorkerLoop(wake_samples_s=[0.001, 0.005, 0.02])
    drawn = simulate(reqs, 1, _settings(), MODEL, loop=draws, seed=3)
    fixed = simulate(reqs, 1, _settings(), MODEL)
    extra = {round(d.ttft_s - f.ttft_s, 9) for d, f in zip(drawn.outcomes, fixed.outcomes)}
    assert extra == {0.001, 0.005, 0.02}
    again = simulate(reqs, 1, _settings(), MODEL, loop=draws, seed=3)
    assert [o.ttft_s for o in again.outcomes] == [o.ttft_s for o in drawn.outcomes]


def test_a_worker_flushes_its_rows_when_its_engine_empties_and_arrivals_wait_for_it():
    loop = WorkerLoop(flush_samples_s=[0.03])
    first = SimRequest("a", _prompt(20), 2, arrival_s=0.0)
    alone = simulate([first], 1, _settings(), MODEL, loop=loop)
    assert alone.num_flushes == 1  # the engine emptied: its two rows flushed
    done = alone.outcomes[0].finished_s
    # A request arriving 10 ms into that flush starts when the flush is over.
    late = SimRequest("b", _prompt(20, 1), 2, arrival_s=done + 0.01)
    o = simulate([first, late], 1, _settings(), MODEL, loop=loop).outcomes[1]
    assert o.started_s == pytest.approx(done + 0.03)
    unflushed = simulate([first, late], 1, _settings(), MODEL).outcomes[1]
    assert o.ttft_s == pytest.approx(unflushed.ttft_s + 0.02)
    assert alone.busy_s[0] == pytest.approx(sum(MODEL.step_seconds(StepShape.of([c])) for c in [(20, 20), (1, 21)])
                                            + 0.03)


def test_a_busy_worker_flushes_every_interval_and_the_steps_wait():
    # 40 requests finishing one after another over about a second of steps, rows flushed every 0.1 s.
    reqs = [SimRequest(f"r{i}", _prompt(16, i), 20 + 10 * i) for i in range(40)]
    loop = WorkerLoop(flush_samples_s=[0.01])
    quick = simulate(reqs, 1, _settings(flush_interval_s=0.1), MODEL)
    flushed = simulate(reqs, 1, _settings(flush_interval_s=0.1), MODEL, loop=loop)
    assert quick.end_s > 0.3
    assert flushed.num_flushes >= quick.end_s / 0.1 - 1
    # Every flush but the one after the last request held the steps up.
    assert flushed.end_s == pytest.approx(quick.end_s + 0.01 * (flushed.num_flushes - 1), rel=1e-6)


def test_step_noise_and_a_fresh_workers_first_step_scale_the_engine_time():
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(16)]
    base = simulate(reqs, 1, _settings(), MODEL)
    doubled = simulate(reqs, 1, _settings(), MODEL, loop=WorkerLoop(step_noise=[2.0]))
    assert doubled.end_s == pytest.approx(2 * base.end_s)
    mixed = [simulate(reqs, 1, _settings(), MODEL, loop=WorkerLoop(step_noise=[0.5, 1.5]), seed=s).end_s
             for s in range(20)]
    assert min(mixed) < base.end_s < max(mixed) and sum(mixed) / 20 == pytest.approx(base.end_s, rel=0.05)
    cold = WorkerLoop(first_step_s=0.25)
    assert simulate(reqs, 1, _settings(), MODEL, loop=cold).end_s == pytest.approx(base.end_s)  # warm workers
    fresh = simulate(reqs, 2, _settings(), MODEL, loop=cold, fresh=True)
    assert fresh.end_s == pytest.approx(simulate(reqs, 2, _settings(), MODEL).end_s + 0.25)
    assert min(o.first_token_s for o in fresh.outcomes) >= 0.25


def test_workers_sharing_a_machine_slow_each_others_steps_down():
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(32)]
    loop = WorkerLoop(contention=[1.5])
    apart = simulate(reqs, 2, _settings(max_num_seqs=8), MODEL, loop=loop)
    plain = simulate(reqs, 2, _settings(max_num_seqs=8), MODEL)
    # One worker per machine (the default): the factor never applies.
    assert apart.end_s == pytest.approx(plain.end_s)
    shared = WorkerSettings(_settings(max_num_seqs=8).scheduler, max_batch=64, max_wait_ms=0.0, workers_per_machine=2)
    together = simulate(reqs, 2, shared, MODEL, loop=loop)
    # Both workers are busy from the start to nearly the end: almost every step is 1.5x longer.
    assert 1.3 * plain.end_s < together.end_s <= 1.5 * plain.end_s + 1e-9
    # A worker alone on its machine (the second machine's only worker) is not slowed down.
    single = simulate(reqs, 1, shared, MODEL, loop=loop)
    assert single.end_s == pytest.approx(simulate(reqs, 1, _settings(max_num_seqs=8), MODEL).end_s)
    # Past the measured entries the last one holds; none measured: no slowdown.
    assert WorkerLoop(contention=[1.2, 1.4]).contention_factor(5) == 1.4
    assert WorkerLoop().contention_factor(3) == 1.0 and loop.contention_factor(0) == 1.0


def test_the_contention_factor_is_the_median_slowdown_over_shapes():
    from mqinfer.loadgen.plan.calibrate import slowdown

    a, b, c = StepShape.of([(64, 64)]), StepShape.of([(1, 40)] * 8), StepShape.of([(1, 40)])
    alone = [StepSample(a, 0.010), StepSample(a, 0.012), StepSample(b, 0.004), StepSample(c, 0.002)]
    loaded = [StepSample(a, 0.022), StepSample(b, 0.006), StepSample(b, 0.006), StepSample(c, 0.0042)]
    # Ratios 2.0, 1.5, 2.1: the median.
    assert slowdown(alone, loaded) == pytest.approx(2.0)
    # Faster beside busy engines is noise: never below 1; no shape in common: 1.
    assert slowdown(alone, [StepSample(a, 0.005)]) == 1.0
    assert slowdown(alone, [StepSample(StepShape.of([(9, 9)]), 1.0)]) == 1.0


def test_quantile_samples_keep_the_extremes_and_thin_the_rest():
    assert quantile_samples([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    thinned = quantile_samples([float(i) for i in range(1001)], limit=11)
    assert thinned == [float(i) for i in range(0, 1001, 100)]
    with pytest.raises(ValueError, match="gap_samples_s"):
        WorkerLoop(gap_samples_s=[-0.1])


def test_shared_prefixes_hit_the_real_prefix_cache():
    prefix = _prompt(256)
    reqs = [SimRequest(f"r{i}", prefix + _prompt(8, i + 1), 2, arrival_s=0.1 * i) for i in range(6)]
    cached = simulate(reqs, 1, _settings(), MODEL)
    uncached = simulate(reqs, 1, _settings(enable_prefix_caching=False), MODEL)
    later = [o.ttft_s for o in cached.outcomes[1:]]
    assert max(later) < min(o.ttft_s for o in uncached.outcomes[1:])


def test_the_loop_is_read_from_a_workers_json_step_log(tmp_path):
    """Gaps between steps that left work, flushes from a step's end to its first row line, from
    lines as `mqinfer worker --log-format json --log-level debug` writes them."""
    import logging

    from mqinfer.cli import JsonFormatter
    from mqinfer.loadgen.plan.pipeline import loop_samples, read_timeline

    lines = []

    def emit(ts: float, msg: str) -> None:
        record = logging.LogRecord("mqinfer.worker", logging.DEBUG, __file__, 0, msg, (), None)
        record.created = ts
        lines.append(JsonFormatter().format(record))

    def step(end: float, seconds: float, running: int) -> None:
        emit(end, "step " + json.dumps({"requests": 1, "tokens": 1, "running": running, "waiting": 0,
                                        "step_s": seconds}))

    step(100.010, 0.010, 2)
    step(100.022, 0.010, 2)  # 2 ms after the first: a gap
    emit(100.050, 'finished {"id": "a"}')  # rows flushed after the second step: 28 ms
    emit(100.051, 'finished {"id": "b"}')
    step(100.062, 0.010, 0)  # after the flush: no gap counted; this step leaves nothing
    emit(100.080, 'finished {"id": "c"}')  # the flush after the engine emptied: 18 ms
    emit(160.0, 'finished {"id": "d"}')  # a later flush (the exit's) after an idle wait: not one
    step(170.012, 0.010, 1)  # after an idle wait: no gap counted
    lines.insert(3, "a line that is not JSON")
    path = tmp_path / "worker-0.log"
    path.write_text("\n".join(lines) + "\n")
    timeline = read_timeline(path)
    assert len(timeline.steps) == 4 and len(timeline.row_times) == 4
    gaps, flushes = loop_samples(timeline, since=0.0)
    assert gaps == pytest.approx([0.002])
    assert flushes == pytest.approx([0.028, 0.018])
    assert loop_samples(timeline, since=100.011) == ([], pytest.approx([0.028, 0.018]))  # from the second step


def test_the_gaps_between_steps_are_fitted_with_a_cost_per_request_finished_and_started():
    from mqinfer.loadgen.plan.pipeline import LoggedStep, WorkerTimeline, gap_costs, gap_records

    steps = [LoggedStep(0.0, 0.010, True, finished=1), LoggedStep(0.0125, 0.020, True, prefills=2),
             LoggedStep(0.021, 0.030, False)]
    gaps, flushes, counts = gap_records(WorkerTimeline(steps, []), since=0.0)
    assert gaps == pytest.approx([0.0025, 0.001]) and not flushes and counts == [(1, 2), (0, 0)]
    # Gaps of 0.6 ms, +0.15 ms per request finished before and +0.8 ms per request started after,
    # with a little noise: the fit finds the two costs and leaves the constant part.
    rng = np.random.default_rng(3)
    counts = [(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(400)]
    gaps = [0.0006 + 0.00015 * f + 0.0008 * p + float(rng.normal(0, 2e-5)) for f, p in counts]
    rest, per_finished, per_started = gap_costs(gaps, counts)
    assert per_finished == pytest.approx(0.00015, rel=0.05) and per_started == pytest.approx(0.0008, rel=0.05)
    assert np.median(rest) == pytest.approx(0.0006, rel=0.05)
    # No request beside enough gaps: the gaps as they are.
    assert gap_costs(gaps[:10], counts[:10]) == (gaps[:10], 0.0, 0.0)
    assert gap_costs(gaps, [(0, 0)] * len(gaps))[1:] == (0.0, 0.0)


def test_the_simulated_loop_spends_the_per_request_gap_costs():
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 4, arrival_s=0.0) for i in range(3)]
    plain = simulate(reqs, 1, _settings(max_num_seqs=1), MODEL, loop=WorkerLoop())
    costly = simulate(reqs, 1, _settings(max_num_seqs=1), MODEL,
                      loop=WorkerLoop(gap_per_finished_s=0.01, gap_per_started_s=0.02))
    # One request at a time: each start costs 20 ms, and each after the first follows a finish (10 ms).
    assert costly.end_s - plain.end_s == pytest.approx(3 * 0.02 + 2 * 0.01)
    with pytest.raises(ValueError, match="gap_per_started_s"):
        WorkerLoop(gap_per_started_s=-1.0)


def test_a_logged_steps_shape_and_its_ratio_to_the_model_by_size(tmp_path):
    """The worker's step log names each prompt chunk and the decode context: the shape the model
    prices, and a worker's steps over it, binned by modelled size."""
    from mqinfer.loadgen.plan.pipeline import LoggedStep, WorkerTimeline, logged_shape, noise_by_size, step_ratios

    logged = {"requests": 5, "tokens": 67, "prompt_chunks": [[32, 32], [32, 96]], "decode_context": 300,
              "step_s": 0.01}
    shape = logged_shape(logged)
    assert shape == StepShape.of([(32, 32), (32, 96), (1, 100), (1, 100), (1, 100)])
    assert logged_shape({"requests": 1, "tokens": 1, "step_s": 0.01}) is None  # an older log: no shape
    small, big = StepShape(1, 1, 0.0), StepShape(1000, 8, 0.0)
    steps = [LoggedStep(10.0, 10.0 + 1.2 * MODEL.step_seconds(small), True, small),
             LoggedStep(11.0, 11.0 + 1.0 * MODEL.step_seconds(big), True, big),
             LoggedStep(12.0, 12.5, True, None)]
    ratios = step_ratios(WorkerTimeline(steps, []), since=10.5, model=MODEL)
    assert ratios == [(11.0, pytest.approx(MODEL.step_seconds(big)), pytest.approx(1.0))]
    ratios = [(float(i), 0.001 * (i + 1), 1.5 if i < 50 else 1.0) for i in range(100)]  # small steps slower
    bounds, bins, top = noise_by_size(ratios, bins=2)
    assert bounds == [pytest.approx(0.051)] and set(bins[0]) == {1.5} and set(bins[1]) == {1.0}
    assert top == pytest.approx(0.0755)  # the larger bin's median modelled seconds
    loop = WorkerLoop(step_noise=[0.9], step_noise_bounds_s=bounds, step_noise_by_size=bins)
    assert set(loop.noise_for(0.01)) == {1.5} and set(loop.noise_for(0.2)) == {1.0}
    assert WorkerLoop(step_noise=[0.9]).noise_for(0.01) == (0.9,)
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(4)]
    base = simulate(reqs, 1, _settings(), MODEL).end_s
    slowed = WorkerLoop(step_noise_bounds_s=[1.0], step_noise_by_size=[[2.0], [1.0]])  # every step below 1 s
    assert simulate(reqs, 1, _settings(), MODEL, loop=slowed).end_s == pytest.approx(2 * base)
    with pytest.raises(ValueError, match="one bin more"):
        WorkerLoop(step_noise_bounds_s=[0.1, 0.2], step_noise_by_size=[[1.0]])


def test_a_step_larger_than_the_largest_bins_takes_that_bins_extra_seconds_not_its_share():
    loop = WorkerLoop(step_noise_bounds_s=[], step_noise_by_size=[[1.2]], step_noise_top_s=0.005)
    assert loop.scaled_noise(1.2, 0.004) == 1.2 and loop.scaled_noise(1.2, 0.005) == 1.2
    assert loop.scaled_noise(1.2, 0.050) == pytest.approx(1.02)  # 1 ms extra on a 50 ms step
    assert loop.scaled_noise(0.9, 0.010) == pytest.approx(0.95)  # a fast draw shrinks the same way
    assert WorkerLoop().scaled_noise(1.2, 0.050) == 1.2
    # In the simulation: steps of about 15 ms drawn at 2x, against a bin measured at 5 ms.
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(4)]
    flat = StepCostModel(0.015, 0.0, 0.0, 0.0)
    base = simulate(reqs, 1, _settings(), flat).end_s
    share = WorkerLoop(step_noise_bounds_s=[], step_noise_by_size=[[2.0]])
    extra = WorkerLoop(step_noise_bounds_s=[], step_noise_by_size=[[2.0]], step_noise_top_s=0.005)
    assert simulate(reqs, 1, _settings(), flat, loop=share).end_s == pytest.approx(2 * base)
    assert simulate(reqs, 1, _settings(), flat, loop=extra).end_s == pytest.approx(base * (1 + 0.005 / 0.015))
    with pytest.raises(ValueError, match="step_noise_top_s"):
        WorkerLoop(step_noise_top_s=-1.0)


def test_the_series_of_slow_steps_ranks_each_step_in_its_bin_and_measures_how_long_slowness_lasts():
    from mqinfer.loadgen.plan.pipeline import MIN_STEP_RATIOS, rank_series, slow_period_steps

    # Two size bins; each step's rank is where its ratio lies among its own bin's samples.
    bounds, by_size = [0.01], [[1.0, 1.1, 1.2, 1.3], [2.0, 3.0]]
    ranks = rank_series([(5.0, 0.001, 1.0), (5.5, 0.001, 1.3), (6.0, 0.02, 3.0), (6.5, 0.02, 2.5)], bounds, by_size)
    assert ranks == [0.125, 0.875, 0.75, 0.5]
    assert rank_series([(5.0, 0.001, 1.0)], [], []) == []
    # Slowness that lasts 20 steps is walked in longer stretches than slowness that changes every
    # step; a series too short to tell gives no walk.
    runs = [1.0 if (i // 20) % 2 else 0.0 for i in range(400)]
    alternating = [float(i % 2) for i in range(400)]
    assert slow_period_steps(alternating) == 4  # four times a correlation time of one step
    assert 20 < slow_period_steps(runs) <= 200  # at most half the series
    assert slow_period_steps(runs[:MIN_STEP_RATIOS - 1]) == 0


def test_the_simulation_walks_the_measured_series_of_slow_steps():
    from mqinfer.loadgen.plan.sim import _Draws, _SlowPeriods

    # A stretch of the series is walked in order, step by step, then the walk jumps.
    ranks = [i / 100 for i in range(100)]
    walk = _SlowPeriods(ranks, 5, _Draws(3))
    stretch = [walk.next_rank(0) for _ in range(5)]
    assert stretch == pytest.approx([stretch[0] + k / 100 for k in range(5)])
    assert [walk.next_rank(0) for _ in range(5)] != pytest.approx([stretch[-1] + k / 100 for k in range(1, 6)])
    # Each machine walks its own stretch.
    assert [walk.next_rank(1) for _ in range(5)] != pytest.approx(stretch)
    # Steps take their factor at the walked rank: a series all slow runs every step at its bin's
    # slowest factor, one all fast at its fastest.
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(4)]
    def loop(rank):
        return WorkerLoop(step_noise_bounds_s=[], step_noise_by_size=[[1.0, 2.0, 3.0]],
                          step_noise_series=[rank] * 100, step_noise_block_steps=10)
    fast, slow = (simulate(reqs, 1, _settings(), MODEL, loop=loop(rank)).end_s for rank in (0.0, 0.999))
    assert slow == pytest.approx(3 * fast)
    with pytest.raises(ValueError, match="ranks in"):
        WorkerLoop(step_noise_by_size=[[1.0]], step_noise_series=[1.5], step_noise_block_steps=1)
    with pytest.raises(ValueError, match="needs step_noise_by_size"):
        WorkerLoop(step_noise_series=[0.5], step_noise_block_steps=1)


def test_contention_in_the_pipeline_is_a_step_over_a_lone_workers_by_how_many_others_were_in_a_step():
    from mqinfer.loadgen.plan.pipeline import LoggedStep, WorkerTimeline, contention_ratios

    shape = StepShape(10, 1, 0.0)
    m = MODEL.step_seconds(shape)
    # Worker A: a step alone at 1.0x, then one at 1.5x that starts while B is in a step.
    a = WorkerTimeline([LoggedStep(10.0, 10.0 + 1.0 * m, True, shape), LoggedStep(20.0, 20.0 + 1.5 * m, True, shape)], [])
    # Worker B: a step from 19.9995 (A's second step starts inside it), 1.2x; and one before `since`.
    b = WorkerTimeline([LoggedStep(5.0, 5.0 + m, True, shape), LoggedStep(19.9995, 19.9995 + 1.2 * m, True, shape)], [])
    out = contention_ratios([a, b], since=9.0, model=MODEL, bounds=[], by_size=[[0.9, 1.0, 1.1]])
    # Over the lone worker's median (1.0): A's first step and B's step started with nobody else in one.
    assert sorted(out[0]) == pytest.approx([1.0, 1.2]) and out[1] == [pytest.approx(1.5)]


def test_step_noise_is_each_repeated_step_over_its_shapes_median():
    from mqinfer.loadgen.plan.calibrate import step_noise

    a, b = StepShape(10, 1, 0.0), StepShape(20, 2, 0.0)
    samples = [StepSample(a, 1.0), StepSample(a, 1.0), StepSample(a, 2.0), StepSample(b, 3.0)]
    assert sorted(step_noise(samples)) == [1.0, 1.0, 2.0]  # b measured once: no spread known


# -- the search and the bill ----------------------------------------------------------------------
def _ev(workers: int, met: bool, excess: float) -> planner.Evaluation:
    return planner.Evaluation(workers, 10, 0, 100, 100, 0.1, 0.2, 0.01, 0.01, 100.0, 0.5, 10.0, 10.0, 1, 0,
                              met=met, excess=excess)


def test_the_search_finds_the_fewest_workers_that_meet_the_target():
    calls = []

    def evaluate(n):
        calls.append(n)
        return _ev(n, n >= 7, 7 / n)

    best, tried = planner.fewest_workers(evaluate)
    assert best.workers == 7 and best.met
    assert [e.workers for e in tried] == sorted(set(calls))
    assert all(e.met == (e.workers >= 7) for e in tried)
    assert len(calls) <= 6  # 1, 2, 4, 8, then bisection 6, 7


def test_the_search_gives_up_when_more_workers_stop_helping():
    # A floor: from 4 workers on, the latency no longer falls, and stays above the target.
    best, tried = planner.fewest_workers(lambda n: _ev(n, False, max(1.5, 6 / n)))
    assert not best.met and best.workers == 4
    assert max(e.workers for e in tried) == 8


def test_more_load_or_a_tighter_slo_never_needs_fewer_workers():
    reqs = [SimRequest(f"r{i}", _prompt(64 + i % 64, i), 32 + i % 32) for i in range(200)]
    settings = _settings(max_num_seqs=8, max_wait_ms=2.0)
    calibration = _calibration()

    def needed(rate: float, slo_s: float) -> int:
        requests = planner.with_arrivals(reqs, rate, len(reqs), seed=0)
        target = planner.Target(rate=rate, slo_ttft_p99_s=slo_s)

        def evaluate(n):
            return planner.judge(planner.summarize(simulate(requests, n, settings, calibration.model)), target, 1.0)

        best, _ = planner.fewest_workers(evaluate, upper=64)
        assert best.met
        return best.workers

    by_rate = [needed(rate, 0.05) for rate in (20, 60, 180)]
    assert by_rate == sorted(by_rate) and by_rate[-1] > by_rate[0]
    by_slo = [needed(100, slo) for slo in (0.2, 0.05, 0.02)]
    assert by_slo == sorted(by_slo) and by_slo[-1] > by_slo[0]


def test_the_bill_online_is_workers_times_their_share_over_the_rate():
    ev = _ev(3, True, 0.5)
    layout = planner.Layout("cpu", 1, 0.5)
    online = planner.bill(ev, planner.Target(rate=2.0), layout, price=4.0, startup_s=3.6)
    assert online.worker_hour_usd == 2.0
    assert online.cost_per_request_usd == pytest.approx(3 * 2.0 / 3600 / 2.0)
    assert online.cost_per_million_tokens_usd == pytest.approx(online.cost_per_request_usd * 10 / 200 * 1e6)
    assert online.startup_usd == pytest.approx(3 * 2.0 * 3.6 / 3600)
    bulk = planner.bill(ev, planner.Target(deadline_s=60), layout, price=4.0, startup_s=3.6)
    # The job: 10 s of running plus 3.6 s of start-up, on 3 workers, over 10 requests.
    assert bulk.cost_per_request_usd == pytest.approx(3 * 2.0 * 13.6 / 3600 / 10)
    assert bulk.startup_share == pytest.approx(3.6 / 13.6)
    assert math.isclose(bulk.startup_share + bulk.warm_share, 1.0)


def test_the_machines_speed_in_a_run_is_its_steps_over_what_the_calibration_expects_of_them():
    from mqinfer.loadgen.plan.pipeline import LoggedStep, WorkerTimeline, machine_speed

    # The calibration saw a worker's small steps 1.2x the model and its large ones 1.0x; in the run
    # both ran 10% slower than that, and a step after the run's window ran far slower still.
    calibration = _calibration(step_noise_bounds_s=[0.005], step_noise_by_size=[[1.1, 1.2, 1.3], [0.9, 1.0, 1.1]])
    model = calibration.model
    small, big = StepShape(1, 1, 0.0), StepShape(1000, 8, 0.0)
    assert model.step_seconds(small) < 0.005 < model.step_seconds(big)
    steps = [LoggedStep(10.0 + i, 10.0 + i + 1.1 * 1.2 * model.step_seconds(small), True, small) for i in range(3)]
    steps += [LoggedStep(20.0 + i, 20.0 + i + 1.1 * model.step_seconds(big), True, big) for i in range(2)]
    steps += [LoggedStep(40.0, 40.0 + 3.0 * model.step_seconds(big), True, big)]
    timelines = [WorkerTimeline(steps, [])]
    assert machine_speed(timelines, 10.0, 30.0, calibration) == pytest.approx(1.1)
    assert machine_speed(timelines, 50.0, 60.0, calibration) is None


def test_plan_check_prints_the_runs_speed_and_the_p99_predicted_at_it():
    from mqinfer.loadgen.plan.check import CheckRow, format_table, rate_row

    runs = [CheckRow("online 30 req/s", 1, 2000.0, 2000.0, 0.050, 0.040, run_speeds=[speed],
                     predicted_ttft_p99_at_speed_s=at) for speed, at in ((1.02, 0.045), (1.08, 0.052))]
    row = rate_row(runs)
    assert row.run_speeds == [1.02, 1.08] and row.predicted_ttft_p99_at_speed_s == pytest.approx(0.0485)
    table = format_table([row])
    assert "online 30 req/s: 1.020, 1.080x, 48.5 ms (-3.0%)" in table


# -- the command ----------------------------------------------------------------------------------
def _calibration(**changes) -> Calibration:
    base = dict(model=StepCostModel(0.002, 5e-5, 3e-5, 1.2e-7), quality=FitQuality(100, 0, 0.03, 0.08),
                startup_s=1.5, num_kv_blocks=4096, block_size=16, max_model_len=2048, max_num_seqs=256,
                model_id="tiny", device="cpu", num_threads=1, measured_at="2026-01-01 00:00:00")
    return Calibration(**{**base, **changes})


@pytest.fixture
def plan_cache(tmp_path, monkeypatch):
    """A cache folder of the test's own for plan fits, sharing the built native kernels (building
    them again would take most of a test's time)."""
    from mqinfer.loadgen.plan.model import cache_dir

    kernels = cache_dir() / "kernels"
    folder = tmp_path / "cache"
    folder.mkdir()
    if kernels.is_dir():
        (folder / "kernels").symlink_to(kernels)
    monkeypatch.setenv("MQINFER_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def cache(plan_cache, monkeypatch):
    """The test's cache folder, holding a calibration for the tiny model, one thread."""
    for name in [o.env for o in PLAN_CMD] + [o.negative_env for o in PLAN_CMD if o.is_switch]:
        monkeypatch.delenv(name, raising=False)
    opts = {o.name: o.default for o in PLAN_CMD}
    path = planner.calibration_path(opts, planner.worker_layout({**opts, "device": "cpu"}))
    save_calibration(_calibration(), path)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_planned_worker_with_tensor_and_pipeline_ranks_bills_and_holds_them_all():
    from mqinfer.workers.devices import cpu_device_share

    opts = {o.name: o.default for o in PLAN_CMD}
    opts.update(device="cpu", num_threads=1, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert planner.worker_ranks(opts) == 4
    layout = planner.worker_layout(opts)
    assert layout.device_share == pytest.approx(cpu_device_share(1, 4))
    # Another split of the layers is another engine: its own calibration.
    assert planner.calibration_path(opts, layout) != planner.calibration_path({**opts, "pipeline_parallel_size": 1},
                                                                              layout)


def test_plan_json_has_the_contract_keys(cache, capsys):
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "120", "--rate", "20",
                        "--slo-ttft-p99-ms", "200", "--device", "cpu", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    assert CONTRACT_KEYS <= set(plan)
    assert plan["workers"] >= 1 and plan["target"]["met"]
    assert plan["ttft_p99_s"] <= 0.2 and plan["output_tokens_per_s"] > 0
    assert plan["cost_per_request_usd"] > 0 and plan["cost_per_million_tokens_usd"] > 0
    assert plan["keda"]["min_replicas"] == plan["workers"] <= plan["keda"]["max_replicas"]
    assert plan["calibration"]["path"] == str(cache)
    # The count found is the fewest: one fewer, if tried, missed the SLO.
    fewer = [s for s in plan["search"] if s["workers"] == plan["workers"] - 1]
    assert all(not s["met"] for s in fewer)
    # The p99 on a machine 5% faster and 5% slower brackets the plan's.
    band = plan["ttft_p99_band"]
    assert band["speed_change"] == 0.05
    assert band["ttft_p99_s_faster"] <= plan["ttft_p99_s"] <= band["ttft_p99_s_slower"]
    assert band["ttft_p99_s_faster"] < band["ttft_p99_s_slower"]


def test_a_slower_or_faster_machine_scales_every_step():
    slower = MODEL.scaled(1.05)
    shape = StepShape.of([(64, 64), (1, 300), (1, 40)])
    assert slower.step_seconds(shape) == pytest.approx(1.05 * MODEL.step_seconds(shape))
    reqs = [SimRequest(f"r{i}", _prompt(32, i), 30) for i in range(8)]
    assert simulate(reqs, 1, _settings(), slower).end_s == pytest.approx(1.05 * simulate(reqs, 1, _settings(), MODEL).end_s)


def test_plan_reads_flags_from_the_environment_and_the_config_file(cache, capsys, monkeypatch, tmp_path):
    config = tmp_path / "plan.toml"
    config.write_text('[plan]\nworkload = "fixed"\nnum-requests = 40\nformat = "json"\n')
    monkeypatch.setenv("MQINFER_DEADLINE_S", "60")
    code, out, _ = _run(capsys, "--config", str(config), "--device", "cpu")
    assert code == 0
    plan = json.loads(out)
    assert plan["workload"] == "fixed" and plan["num_requests"] == 40
    assert plan["target"]["deadline_s"] == 60 and plan["target"]["met"]
    assert plan["job_s"] <= 60 and plan["keda"]["min_replicas"] == 0


def test_a_bulk_deadline_gets_the_fewest_workers_that_finish_in_time(cache, capsys):
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "256", "--device", "cpu",
                        "--format", "json")
    assert code == 0
    one = json.loads(out)  # no target: the machine's own layout
    assert one["target"]["kind"] == "bulk" and one["job_s"] > 1.5
    running = one["job_s"] - 1.5
    deadline = 1.5 + 0.6 * running / one["workers"]  # needs more workers than the layout's
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "256", "--device", "cpu",
                        "--deadline-s", f"{deadline:.3f}", "--format", "json")
    plan = json.loads(out)
    assert code == 0 and plan["workers"] > one["workers"] and plan["job_s"] <= deadline
    assert all(not s["met"] for s in plan["search"] if s["workers"] < plan["workers"])


def test_plan_of_a_jsonl_file_counts_text_prompts_with_the_models_tokenizer(cache, capsys, tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [{"id": f"t{i}", "prompt": "x" * (10 + i), "max_tokens": 8} for i in range(5)]
    lines.append({"id": "ids", "prompt_token_ids": [5] * 30, "max_tokens": 4})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    code, out, _ = _run(capsys, str(path), "--device", "cpu", "--workers", "1", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    # The byte tokenizer: a BOS and one token per byte.
    assert plan["prompt_tokens"] == sum(11 + i for i in range(5)) + 30
    assert plan["output_tokens"] == 5 * 8 + 4
    assert plan["workers"] == 1 and any("invalid" in n for n in plan["notes"])


def test_plan_table_names_the_workers_and_the_costs(cache, capsys):
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "100", "--rate", "5", "--device", "cpu")
    assert code == 0
    for text in ("workers", "TTFT p50 / p99", "if this machine runs 5% faster or slower", "output_tokens_per_s",
                 "cost per request", "cost per 1M tokens", "start-up vs warm", "minReplicaCount"):
        assert text in out


def test_plot_draws_p99_against_the_rate_for_the_planned_count_and_its_neighbours(cache, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plots" / "p99.png"
    # The sweep simulates every point with the workload's requests: a few dozen draw the same curves.
    code, out, err = _run(capsys, "--workload", "standard", "--num-requests", "60", "--rate", "20",
                          "--slo-ttft-p99-ms", "200", "--device", "cpu", "--format", "json", "--plot", str(path))
    assert code == 0 and str(path) in err
    plan = json.loads(out)
    n = plan["workers"]
    assert {p["workers"] for p in plan["sweep"]} == {k for k in (n - 1, n, n + 1) if k >= 1}
    assert sorted({p["rate"] for p in plan["sweep"]}) == pytest.approx([20 * f for f in planner.SWEEP_RATE_FACTORS])
    assert all(p["ttft_p99_s"] > 0 for p in plan["sweep"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_without_matplotlib_the_plot_is_a_note_and_the_plan_stands(cache, capsys, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "p99.svg"
    code, out, err = _run(capsys, "--workload", "standard", "--num-requests", "40", "--rate", "5",
                          "--device", "cpu", "--plot", str(path))
    assert code == 0 and "cost per request" in out
    assert "matplotlib is not installed" in err and not path.exists()
    # The JSON still gains the sweep's points, which it shows without a plot.
    code, out, err = _run(capsys, "--workload", "standard", "--num-requests", "8", "--rate", "5",
                          "--device", "cpu", "--plot", str(path), "--format", "json")
    assert code == 0 and "matplotlib is not installed" in err and not path.exists()
    assert sorted({p["rate"] for p in json.loads(out)["sweep"]}) == pytest.approx([5 * f for f in planner.SWEEP_RATE_FACTORS])


def test_without_calibration_the_command_says_to_calibrate(plan_cache, capsys):
    code, out, err = _run(capsys, "--workload", "standard", "--rate", "5", "--device", "cpu")
    assert code == 2 and out == ""
    assert "no calibration" in err and "--calibrate" in err


@pytest.mark.parametrize("argv, message", [
    (["--workload", "standard", "--rate", "5", "--deadline-s", "10"], "exclude each other"),
    (["--workload", "standard", "--slo-ttft-p99-ms", "100"], "need --rate"),
    (["--rate", "5"], "INPUT"),
    (["--workload", "standard", "--rate", "-1"], "--rate"),
    (["--workload", "standard", "--speculative", "ngram"], "speculative"),
])
def test_bad_targets_are_errors_naming_the_flag(cache, capsys, argv, message):
    code, _, err = _run(capsys, *argv, "--device", "cpu")
    assert code == 2 and message in err


def test_an_out_of_reach_slo_is_reported_unmet(cache, capsys):
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "40", "--rate", "5",
                        "--slo-ttft-p99-ms", "1", "--device", "cpu", "--format", "json")
    plan = json.loads(out)
    assert code == 1 and not plan["target"]["met"]
    assert len(plan["search"]) <= 4 and any("out of reach" in n for n in plan["notes"])


def test_calibrating_the_tiny_model_then_planning(plan_cache, capsys):
    """A real calibration of the engine's steps (no pipeline run: that is the slow test's), then a plan."""
    from mqinfer.loadgen.plan.calibrate import calibrate, contention_probes
    from mqinfer.workers.config import EngineConfig

    calibration = calibrate(EngineConfig(model="tiny", device="cpu", num_threads=1, max_num_seqs=32,
                                         max_num_batched_tokens=512, num_kv_blocks=512),
                            budget_s=10.0, pipeline=False, progress=lambda _: None)
    assert calibration.startup_s > 0 and calibration.quality.num_steps >= 20
    # Beside busy engine processes, as many as this machine's cores hold besides this one (none on
    # one core): a step is never faster, and the slowdown is a real measurement, not a guess.
    assert len(calibration.contention) == contention_probes(EngineConfig(device="cpu", num_threads=1))
    assert all(1.0 <= f < 20 for f in calibration.contention)
    m = calibration.model
    assert m.step_s_fixed > 0 and m.token_s > 0
    # A 512-token prefill costs more than a one-token decode, and a 32-request decode more than one.
    assert m.step_seconds(StepShape.of([(512, 512)])) > 3 * m.step_seconds(StepShape.of([(1, 40)]))
    assert m.step_seconds(StepShape.of([(1, 40)] * 32)) > m.step_seconds(StepShape.of([(1, 40)]))
    opts = {o.name: o.default for o in PLAN_CMD}
    opts.update(device="cpu", max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=512)
    save_calibration(calibration, planner.calibration_path(opts, planner.worker_layout(opts)))
    # A target any machine meets, however busy while it calibrated (the plan exits 1 when its
    # target is out of reach; this test is about the calibration, not this machine's speed).
    code, out, _ = _run(capsys, "--workload", "standard", "--num-requests", "64", "--rate", "10", "--device", "cpu",
                        "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--num-kv-blocks", "512",
                        "--slo-ttft-p99-ms", "60000", "--format", "json")
    assert code == 0 and CONTRACT_KEYS <= set(json.loads(out))


def test_calibrate_end_to_end_through_the_command(plan_cache, capsys, monkeypatch):
    """`mqinfer plan --calibrate` on the tiny model: engine steps, a real worker's start-up and loop
    overheads, the fit stored and reused by the next plan."""
    from mqinfer.loadgen.plan import calibrate as plan_calibrate
    from mqinfer.loadgen.plan import pipeline as plan_pipeline

    # Fewer and smaller batches to calibrate (a KV cache too small for 32 long contexts leaves that
    # decode batch out), and a smaller workload for the pipeline runs: the same path, quicker. The
    # busy engines beside the timed one are the other calibration test's (their processes cost
    # seconds of both cores).
    monkeypatch.setattr(plan_pipeline, "PIPELINE_REQUESTS", 12)
    monkeypatch.setattr(plan_calibrate, "contention_probes", lambda config: 0)
    monkeypatch.setattr(plan_pipeline, "contention_probes", lambda config: 0)
    # A target any machine meets, however busy while it calibrates: the plan exits 1 when its
    # target is not met, and this test is about the calibration, not this machine's speed.
    argv = ["--workload", "standard", "--num-requests", "64", "--rate", "10", "--device", "cpu", "--format", "json",
            "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--num-kv-blocks", "512",
            "--slo-ttft-p99-ms", "60000"]
    code, out, err = _run(capsys, *argv, "--calibrate")
    assert code == 0, err[-3000:]
    first = json.loads(out)
    assert CONTRACT_KEYS <= set(first)
    c = first["calibration"]
    assert c["startup_source"] == "worker" and c["startup_s"] > 0
    # The worker loop, from the warm worker's step log: gaps between steps, flushes of rows (each
    # request's rows are flushed when the engine empties, so there is at least one), a spread of
    # step times, and the fresh worker's first steps measured against the warm one's.
    assert c["mean_gap_s"] > 0 and c["flush_s"] > 0 and c["step_noise_p90"] >= 1.0
    assert c["first_step_s"] >= 0 and c["wake_s"] is not None
    stored = load_calibration(planner.calibration_path(
        {**{o.name: o.default for o in PLAN_CMD}, "device": "cpu"},
        planner.worker_layout({**{o.name: o.default for o in PLAN_CMD}, "device": "cpu"})))
    assert len(stored.gap_samples_s) >= 20 and stored.flush_samples_s and stored.wake_samples_s
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and json.loads(out)["calibration"]["measured_at"] == c["measured_at"]


def test_plan_check_takes_the_median_over_repeated_runs_and_prints_each_runs_p99():
    from mqinfer.loadgen.plan.check import CheckRow, format_table, rate_row

    runs = [CheckRow("online 30 req/s", 1, 2000.0, 2100.0, 0.070, 0.080, predicted_ttft_p99_band_s=[0.06, 0.11]),
            CheckRow("online 30 req/s", 1, 2200.0, 2000.0, 0.140, 0.090, predicted_ttft_p99_band_s=[0.07, 0.13]),
            CheckRow("online 30 req/s", 1, 2100.0, 1900.0, 0.100, 0.070, predicted_ttft_p99_band_s=[0.05, 0.09])]
    row = rate_row(runs)
    assert (row.case, row.measured_tok_s, row.predicted_tok_s) == ("online 30 req/s, 3 runs", 2100.0, 2000.0)
    assert (row.measured_ttft_p99_s, row.predicted_ttft_p99_s) == (0.100, 0.080)
    assert row.ttft_error == pytest.approx(-0.2) and row.measured_ttft_p99_runs_s == [0.070, 0.140, 0.100]
    assert row.predicted_ttft_p99_band_s == [0.06, 0.11] and row.in_band
    assert runs[0].in_band and not runs[1].in_band and runs[1].to_dict()["measured_in_band"] is False
    assert CheckRow("offline bulk", 1, 1.0, 1.0, 0.5, 0.5).in_band is None
    assert rate_row(runs[:1]) is runs[0]
    table = format_table([runs[0], row])
    assert "online 30 req/s, 3 runs" in table and "online 30 req/s: 70.0, 140.0, 100.0)" in table
    assert "60.0-110.0 in" in table and "pred at +-5% speed" in table
    assert "each run's" not in format_table(runs[:1])


def test_plan_check_pools_a_rates_runs_before_taking_the_p99():
    from mqinfer.loadgen.plan.check import CheckRow, format_table, rate_row

    # Three runs of 100 requests: two calm ones and one with a slow spell; simulated likewise.
    calm = [0.010 + 0.0001 * i for i in range(100)]
    spell = calm[:90] + [0.2] * 10
    runs = [CheckRow("online 30 req/s", 1, 2000.0, 2000.0, None, None, measured_ttfts_s=m, predicted_ttfts_s=p,
                     band_ttfts_s=[p, [2 * t for t in p]])
            for m, p in ((calm, calm), (calm, spell), (spell, calm))]
    for r in runs:
        r.measured_ttft_p99_s = sorted(r.measured_ttfts_s)[98]
        r.predicted_ttft_p99_s = sorted(r.predicted_ttfts_s)[98]
    row = rate_row(runs)
    # 300 requests together, 10 of them slow: the p99 is a slow one on both sides; the medians of
    # the runs' p99s are the calm runs' (about 20 ms).
    assert row.measured_ttft_p99_s == pytest.approx(0.2) and row.predicted_ttft_p99_s == pytest.approx(0.2)
    assert row.ttft_p99_medians_s == pytest.approx([0.0198, 0.0198])
    assert row.predicted_ttft_p99_band_s == pytest.approx([0.2, 0.4])
    assert "measured_ttfts_s" not in row.to_dict() and "measured_ttfts_s" not in runs[0].to_dict()
    table = format_table([row])
    assert "all their requests together" in table and "(median 19.8, predicted 19.8)" in table


def test_plan_check_says_whether_each_measured_p99_lies_in_the_simulated_runs_spread():
    from mqinfer.loadgen.plan.check import CheckRow, format_table, rate_row, spread_of

    assert spread_of([0.01 * i for i in range(1, 12)]) == pytest.approx([0.02, 0.10])
    assert spread_of([0.05]) is None
    runs = [CheckRow("online 30 req/s", 1, 2000.0, 2000.0, 0.070, 0.080, predicted_ttft_p99_spread_s=[0.06, 0.11]),
            CheckRow("online 30 req/s", 1, 2000.0, 2000.0, 0.140, 0.090, predicted_ttft_p99_spread_s=[0.07, 0.13]),
            CheckRow("online 30 req/s", 1, 2000.0, 2000.0, 0.080, 0.070, predicted_ttft_p99_spread_s=[0.05, 0.09])]
    assert [r.in_spread for r in runs] == [True, False, True]
    assert runs[1].to_dict()["measured_in_spread"] is False
    row = rate_row(runs)
    assert row.predicted_ttft_p99_spread_s == [0.06, 0.11] and row.runs_in_spread == 2
    table = format_table([runs[1], row])
    assert "70.0-130.0 out" in table and "60.0-110.0 2/3 in" in table and "pred runs p10-p90" in table


def test_plan_gives_a_tenants_requests_its_tenant_slos_and_reports_their_p99s(cache, capsys, tmp_path):
    """A file of bulk requests and a chat tenant's, none with targets of its own: with --tenant-slos
    the chat requests are interactive in the simulation, planned as a worker plans them (their p99
    TPOT beside the bulk ones held to the 5 ms target), and the plan reports their p99s."""
    lines = [{"id": f"b{i}", "prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(96)], "max_tokens": 120,
              "tenant": "batch"} for i in range(60)]
    lines += [{"id": f"c{i}", "prompt_token_ids": [7 + (i * 11 + j) % 200 for j in range(24)], "max_tokens": 30,
               "tenant": "chat"} for i in range(12)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plans = {}
    for name, extra in (("without", ()), ("with", ("--tenant-slos", "chat=2000/5"))):
        code, out, _ = _run(capsys, str(path), "--rate", "40", "--num-requests", "72", "--workers", "1",
                            "--device", "cpu", "--format", "json", *extra)
        assert code in (0, 1), out
        plans[name] = json.loads(out)
    assert plans["without"]["interactive_ttft_p99_s"] is None and plans["without"]["interactive_tpot_p99_s"] is None
    chat = plans["with"]
    assert chat["interactive_ttft_p99_s"] > 0 and chat["interactive_tpot_p99_s"] > 0
    assert chat["interactive_tpot_p99_s"] <= 0.005
    assert chat["interactive_tpot_p99_s"] < plans["without"]["tpot_p99_s"]
    code, out, _ = _run(capsys, str(path), "--rate", "40", "--num-requests", "72", "--workers", "1",
                        "--device", "cpu", "--tenant-slos", "chat=2000/5")
    assert "interactive p99 TTFT / TPOT" in out
    code, _, err = _run(capsys, str(path), "--rate", "40", "--device", "cpu", "--tenant-slos", "chat=0/5")
    assert code != 0 and "TTFT target of tenant 'chat'" in err
