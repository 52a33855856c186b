"""Steps planned to latency targets (scheduler/slo.py), driven by the fake model over a shadow KV
cache (tests/scheduler/test_scheduler.py) on a fake clock, with step times from a known cost
function so that the step-time model has something true to learn."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.scheduler.slo import (
    BULK_MAX_EVERY, BULK_MAX_WAIT_S, BULK_MIN_EVERY, MIN_BULK_PROMPT_TOKENS, MIN_STEPS, RECENT_S, SAFETY, WARM_S, StepShape, StepTimeModel, bulk_min_every,
    format_tenant_slos, parse_tenant_slos,
)
from tests.helpers import FakeClock
from tests.scheduler.test_scheduler import FakeModel

T0 = 1_700_000_000.0


def step_seconds(shape: StepShape) -> float:
    """The fake machine: 2 ms a step, 20 us a token, 300 us a sequence, a little for attention."""
    return 0.002 + 2e-5 * shape.tokens + 3e-4 * shape.seqs + 1e-9 * shape.pairs + 2e-8 * shape.decode_context


class Driver:
    """schedule -> fake model -> update, the clock moved by each step's (fake) time, which the
    scheduler records as the engine does."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.clock = FakeClock(T0)
        self.scheduler = Scheduler(config, clock=self.clock)
        self.model = FakeModel(self.scheduler)
        self.steps: list[dict[str, int]] = []
        self.step_s: list[float] = []
        self.preempted: list[str] = []
        self.finished: dict[str, EngineRequest] = {}
        self._seq = 0

    def add(self, prompt_len: int, max_tokens: int, *, rid: str | None = None, **fields) -> EngineRequest:
        self._seq += 1
        request = EngineRequest(rid or f"r{self._seq}", [5 + (self._seq * 7 + i) % 50 for i in range(prompt_len)],
                                SamplingParams(max_tokens=max_tokens), arrival_time=self.clock(), **fields)
        self.scheduler.add_request(request)
        return request

    def step(self):
        scheduler = self.scheduler
        out = scheduler.schedule()
        shape = StepShape.of((sr.num_new_tokens, sr.request.num_computed_tokens + sr.num_new_tokens)
                             for sr in out.scheduled)
        seconds = step_seconds(shape) if out.scheduled else 0.0
        sampled = self.model.run(out)
        for request in scheduler.update_from_output(out, sampled) + out.finished:
            self.finished[request.request_id] = request
        self.preempted += [r.request_id for r in out.preempted]
        self.steps.append({sr.request.request_id: sr.num_new_tokens for sr in out.scheduled})
        self.step_s.append(seconds)
        self.clock.advance(seconds)
        scheduler.record_step(seconds)
        return out

    def give_up(self):
        """A step scheduled and then given up in its forward pass, as the engine reports one:
        nothing ran, nothing advances."""
        out = self.scheduler.schedule()
        self.scheduler.step_interrupted()
        self.steps.append({})
        self.step_s.append(0.0)
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests left unfinished")


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"num_kv_blocks": 2048, "max_num_seqs": 128, "max_num_batched_tokens": 512,
                              "max_model_len": 1024, **kw})


def test_tenant_slos_parse_and_refuse_bad_entries():
    slos = parse_tenant_slos(" chat = 500/50 , a=b=2000/100")
    assert slos == {"chat": (500, 50), "a=b": (2000, 100)}
    assert parse_tenant_slos(format_tenant_slos(slos)) == slos
    assert parse_tenant_slos("") == {} and parse_tenant_slos(None) == {}
    for bad, words in [("chat=500", "TTFT_MS/TPOT_MS"), ("chat=0/50", "TTFT target"), ("chat=500/-1", "TPOT target"),
                       ("chat=1.5/50", "TTFT target"), ("chat=500/x", "TPOT target"), ("=500/50", "not tenant="),
                       ("chat=500/50,chat=1/1", "twice"), ("chat=500/50,", "entry 2 is empty"),
                       ("chat=500/99999999999", "TPOT target")]:
        with pytest.raises(ValueError, match=words):
            parse_tenant_slos(bad)


def test_engine_request_refuses_a_target_that_is_not_a_positive_integer():
    for bad in (0, -3, 1.5, "50", True):
        with pytest.raises(ValueError, match="slo_tpot_ms must be a positive integer"):
            EngineRequest("r", [1, 2], SamplingParams(), slo_tpot_ms=bad)
    assert EngineRequest("r", [1], SamplingParams(), slo_ttft_ms=200).interactive
    assert not EngineRequest("r", [1], SamplingParams()).interactive


def test_step_time_model_learns_a_linear_machine_and_predicts_new_shapes():
    model = StepTimeModel()
    shapes = [StepShape.of([(1, 100 + i)] * (1 + i % 40) + ([(64, 64 + i)] if i % 5 == 0 else []))
              for i in range(120)]
    for shape in shapes:
        assert not model.ready or model.num_steps >= MIN_STEPS
        model.observe(shape, step_seconds(shape))
    assert model.ready
    for shape in (StepShape.of([(1, 300)] * 7), StepShape.of([(1, 50)] * 90), StepShape.of([(128, 128), (1, 80)])):
        assert model.predict(shape) == pytest.approx(step_seconds(shape), rel=0.05)
    assert all(c >= 0 for c in model.coefficients())


def test_without_interactive_requests_steps_are_exactly_those_without_plans():
    """Bulk only: the plan hook never changes a step (the same steps, token for token, as a
    scheduler without it), though its model learns from every step."""
    traces = []
    for plans in (True, False):
        d = Driver(config(slo_step_plans=plans, block_size=4, num_kv_blocks=40, max_num_seqs=16,
                              max_num_batched_tokens=64))
        for i in range(40):
            d.add(20 + (i * 13) % 90, 5 + (i * 7) % 30)
        for _ in range(10):
            d.step()
        for i in range(10):  # later arrivals, and KV pressure (40 blocks of 4 tokens)
            d.add(60 + i * 11, 40)
        d.run()
        traces.append((d.steps, d.preempted))
        if plans:
            assert d.scheduler.slo.num_planned_steps == 0 and d.scheduler.slo.model.ready
    assert traces[0] == traces[1]
    assert traces[0][1], "the workload was meant to preempt"


def warm(d: Driver, n_bulk: int = 60, prompt: int = 48, max_tokens: int = 400) -> list[EngineRequest]:
    bulk = [d.add(prompt, max_tokens) for _ in range(n_bulk)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in bulk):
        d.step()
    for _ in range(MIN_STEPS):
        d.step()
    return bulk


def test_steps_beside_a_backlog_hold_the_tightest_tpot_target_and_bulk_keeps_its_kv():
    d = Driver(config())
    # Long enough to outlast both interactive requests (a left-out sequence decodes at most once a
    # step), short enough that running them to the end stays cheap.
    bulk = warm(d, max_tokens=120)
    full_step = d.step_s[-1]
    target_ms = 12
    assert full_step > target_ms / 1000  # without plans every step would miss the target
    chat = d.add(32, 40, slo_ttft_ms=200, slo_tpot_ms=target_ms)
    loose = d.add(16, 40, slo_tpot_ms=500)
    first = len(d.steps)
    before = {r.request_id: (list(r.block_ids), r.num_computed_tokens) for r in bulk}
    out = d.step()
    left_out = [r for r in bulk if r.request_id not in d.steps[-1]]
    assert left_out, "a planned step leaves bulk decodes out"
    for r in left_out:  # a left-out sequence keeps its KV and position
        assert r.status is RequestStatus.RUNNING and (r.block_ids, r.num_computed_tokens) == before[r.request_id]
    assert out.scheduled[0].request is chat or chat.request_id in d.steps[-1]
    while not chat.is_finished:
        d.step()
        assert chat.request_id in d.steps[-1]  # an interactive request runs every step
    steps = d.step_s[first:]
    # Predicted within SAFETY of the tightest target; the model is fitted to the same machine.
    assert max(steps) <= target_ms / 1000 * (SAFETY + 0.1), max(steps)
    # TTFT: the prompt ran at once (it arrived with the first planned step's clock).
    assert chat.num_output_tokens == 40 and not d.preempted
    assert not any(r.is_finished for r in bulk)  # the backlog was there all along
    # The looser target did not widen the steps while the tighter one ran; after both leave, steps
    # are planned for RECENT_S more seconds, then composed as without targets.
    d.run()
    assert {r.request_id for r in bulk} <= set(d.finished) and loose.request_id in d.finished


def test_every_bulk_sequence_runs_at_least_once_in_every_bulk_min_every_steps():
    d = Driver(config())
    bulk = warm(d, n_bulk=80, max_tokens=300)
    start = len(d.steps)
    chats = [d.add(16, 200, slo_tpot_ms=1)]  # a target no step can meet: the least bulk possible
    every = bulk_min_every(0.001)
    for _ in range(2 * every + 10):
        d.step()
    for r in bulk:
        ran = [i for i in range(start, len(d.steps)) if r.request_id in d.steps[i]]
        gaps = [b - a for a, b in zip([start - 1] + ran, ran + [len(d.steps)])]
        assert max(gaps) <= every, (r.request_id, gaps)
    assert all(c.request_id in d.steps[-1] for c in chats)


def test_a_bulk_sequence_in_a_given_up_step_has_not_had_its_turn():
    """Every other planned step given up (an interactive request arriving at each): every bulk
    sequence still runs at least once in every bulk_min_every(target) steps that ran."""
    d = Driver(config())
    bulk = warm(d, n_bulk=80, max_tokens=300)
    d.add(16, 400, slo_tpot_ms=1)  # a target no step can meet: the least bulk possible
    every = bulk_min_every(0.001)
    start = len(d.steps)
    for _ in range(2 * every + 10):
        d.give_up()
        d.step()
    ran_steps = [i for i in range(start, len(d.steps)) if d.steps[i]]
    for r in bulk:
        ran = [n for n, i in enumerate(ran_steps) if r.request_id in d.steps[i]]
        gaps = [b - a for a, b in zip([-1] + ran, ran + [len(ran_steps)])]
        assert max(gaps) <= every, (r.request_id, gaps)


def test_the_starvation_bound_is_a_wait_in_seconds_within_a_step_range():
    assert bulk_min_every(BULK_MAX_WAIT_S / 20) == 20
    assert bulk_min_every(BULK_MAX_WAIT_S / 20 * 1.01) == 20  # rounded up: at most the wait
    assert bulk_min_every(10.0) == BULK_MIN_EVERY
    assert bulk_min_every(1e-6) == bulk_min_every(0.0) == BULK_MAX_EVERY


def test_a_large_backlog_does_not_push_its_minimum_rate_into_every_step_past_the_target():
    """128 bulk decodes beside a 6 ms target on the fake machine (2 ms + 0.3 ms a sequence): the
    target holds about a dozen sequences. The starvation bound must not force more than that in:
    one in BULK_MIN_EVERY of the backlog (16 a step) would make every step miss the target."""
    d = Driver(config(max_num_seqs=160, num_kv_blocks=4096))
    bulk = warm(d, n_bulk=128, prompt=16, max_tokens=400)
    target_ms = 6
    assert d.step_s[-1] > 3 * target_ms / 1000
    chat = d.add(16, 60, slo_tpot_ms=target_ms)
    first = len(d.steps)
    while not chat.is_finished:
        d.step()
    steps = d.step_s[first:]
    assert max(steps) <= target_ms / 1000 * (SAFETY + 0.1), max(steps)
    # ... while the backlog still moves: its minimum share ran beside the chat.
    ran = {rid for step in d.steps[first:] for rid in step}
    assert sum(r.request_id in ran for r in bulk) >= len(bulk) // 2


def test_an_interactive_prompt_beside_bulk_work_alone_runs_whole_and_first():
    """No interactive decode to protect: the prompt is not spread over its TTFT slack (the bulk
    work is what waits), and it is admitted ahead of the bulk prompts queued before it."""
    d = Driver(config(max_num_batched_tokens=1024))
    bulk = warm(d, n_bulk=30, max_tokens=40)  # still decoding when the prompt arrives
    waiting_bulk = [d.add(300, 10) for _ in range(4)]
    chat = d.add(600, 4, slo_ttft_ms=60, slo_tpot_ms=5)
    d.step()
    assert d.steps[-1][chat.request_id] == 600 and chat.num_output_tokens == 1
    assert not any(r.is_finished for r in bulk)
    # The bulk prompts queued before it get no more than the floor that keeps them moving.
    assert sum(d.steps[-1].get(r.request_id, 0) for r in waiting_bulk) <= MIN_BULK_PROMPT_TOKENS
    d.run()
    assert all(r.num_output_tokens == 10 for r in waiting_bulk)



def test_a_step_with_an_interactive_prompt_takes_only_the_bulk_work_the_starvation_bound_needs():
    """The target would hold the whole backlog's decodes (17 ms of a 50 ms target on the fake
    machine), but each bulk decode in the step with the prompt would delay the first token: that
    step runs the minimum share of bulk decodes, and the next one, decoding, takes them all."""
    d = Driver(config())
    bulk = warm(d, n_bulk=50, max_tokens=200)
    target_ms = 50
    assert d.step_s[-1] < target_ms / 1000 * SAFETY / 2
    chat = d.add(32, 8, slo_ttft_ms=500, slo_tpot_ms=target_ms)
    d.step()
    assert chat.request_id in d.steps[-1] and chat.num_output_tokens == 1
    in_first = sum(r.request_id in d.steps[-1] for r in bulk)
    assert in_first <= -(-len(bulk) // bulk_min_every(target_ms / 1000))
    d.step()
    assert d.steps[-1][chat.request_id] == 1
    assert all(r.request_id in d.steps[-1] for r in bulk)
    d.run()
    assert all(r.num_output_tokens == 200 for r in bulk)

def test_an_interactive_prompt_is_not_chunked_beside_running_interactive_decodes():
    """Chunking a new prompt would cost the running decodes the same compute (their TPOT is a
    mean over their tokens) and the new request its first token steps later: it runs whole, and
    the bulk work is what the step leaves out."""
    d = Driver(config(max_num_batched_tokens=1024))
    bulk = warm(d, n_bulk=30)
    talking = [d.add(16, 400, slo_ttft_ms=1000, slo_tpot_ms=5) for _ in range(2)]
    while any(r.num_output_tokens < 3 for r in talking):
        d.step()
    chat = d.add(600, 4, slo_ttft_ms=60, slo_tpot_ms=5)
    d.step()
    step = d.steps[-1]
    assert step[chat.request_id] == 600 and chat.num_output_tokens == 1
    assert all(step[r.request_id] == 1 for r in talking)
    assert sum(r.request_id in step for r in bulk) < len(bulk)


def test_light_steps_after_the_last_interactive_request_bound_bulk_prompts_and_run_every_decode():
    """From RECENT_S to WARM_S after the last interactive request left, every running sequence
    runs (nothing left out) but a bulk prompt no longer fills the whole step: a sporadic
    producer's next request arrives during a short step. After WARM_S, steps are unplanned."""
    d = Driver(config(max_num_batched_tokens=1024))
    warm(d, n_bulk=20, max_tokens=100_000)
    chat = d.add(8, 3, slo_tpot_ms=5)
    while not chat.is_finished:
        d.step()
    left_at = d.clock()
    d.clock.advance(RECENT_S)
    slo = d.scheduler.slo
    planned, light = slo.num_planned_steps, slo.num_light_steps
    running = {r.request_id for r in d.scheduler._running}
    prompts = [d.add(900, 4) for _ in range(2)]
    d.step()
    step = d.steps[-1]
    assert slo.num_planned_steps == planned and slo.num_light_steps == light + 1
    assert running <= set(step) and all(step[rid] == 1 for rid in running)
    bounded = sum(step.get(r.request_id, 0) for r in prompts)
    assert 0 < bounded < 900, bounded
    full = step_seconds(StepShape.of([(1, 60)] * len(running)))
    assert d.step_s[-1] <= max(2 * full, 0.005) * 1.2
    d.clock.advance(left_at + WARM_S - d.clock())
    d.step()
    assert slo.num_light_steps == light + 1  # past WARM_S: composed as without targets
    assert sum(d.steps[-1].get(r.request_id, 0) for r in prompts) > bounded


def test_light_steps_with_few_decodes_admit_bulk_prompts_up_to_half_the_ttft_target():
    """When few bulk sequences run, a light step bounded to a decode step's time would admit about
    one bulk prompt a step for the whole warm period; bounded to half the last TTFT target it
    refills the running set while a new interactive request still meets its TTFT."""
    d = Driver(config(max_num_batched_tokens=2048))
    warm(d, n_bulk=2, max_tokens=100_000)
    ttft_ms = 40
    chat = d.add(8, 3, slo_ttft_ms=ttft_ms, slo_tpot_ms=5)
    while not chat.is_finished:
        d.step()
    d.clock.advance(RECENT_S)
    slo = d.scheduler.slo
    light = slo.num_light_steps
    prompts = [d.add(900, 4) for _ in range(2)]
    d.step()
    assert slo.num_light_steps == light + 1
    decodes_alone = step_seconds(StepShape.of([(1, 60)] * 2))
    assert 2 * decodes_alone < ttft_ms / 1000 / 4  # so the TTFT share is what bounds this step
    assert ttft_ms / 1000 * 0.3 <= d.step_s[-1] <= ttft_ms / 1000 * 0.5 * 1.2, d.step_s[-1]
    assert 0 < sum(d.steps[-1].get(r.request_id, 0) for r in prompts) < 1800


def test_a_prompt_is_not_held_back_for_a_target_the_machine_cannot_meet():
    # The fake machine's step takes at least 2 ms: a 1 ms TPOT target cannot be held even by the
    # interactive decodes alone, so chunking a new prompt would only delay its first token.
    d = Driver(config(max_num_batched_tokens=1024))
    warm(d, n_bulk=4)
    talking = [d.add(16, 400, slo_ttft_ms=1000, slo_tpot_ms=1) for _ in range(3)]
    while any(r.num_output_tokens == 0 for r in talking):
        d.step()
    chat = d.add(600, 4, slo_ttft_ms=1000, slo_tpot_ms=1)
    d.step()
    assert d.steps[-1][chat.request_id] == 600  # its whole prompt in one step, not spread to 1 s
    assert chat.num_output_tokens == 1


def test_an_interactive_request_is_never_preempted_for_a_bulk_one():
    # 40 blocks of 16 tokens: the bulk requests outgrow the cache and preempt one another.
    d = Driver(config(num_kv_blocks=40, max_num_batched_tokens=256))
    for _ in range(6):
        d.add(64, 120)
    for _ in range(3):
        d.step()
    chat = d.add(32, 150, slo_tpot_ms=50)
    d.run()
    assert d.preempted, "the cache was meant to run out"
    assert chat.request_id not in d.preempted
    assert chat.num_output_tokens == 150 and len(d.finished) == 7


def test_plans_stop_recent_s_after_the_last_interactive_request_left():
    d = Driver(config())
    warm(d, max_tokens=2000)
    chat = d.add(8, 3, slo_tpot_ms=5)
    while not chat.is_finished:
        d.step()
    slo = d.scheduler.slo
    left_at = d.clock()
    planned = slo.num_planned_steps
    while d.clock() < left_at + RECENT_S:
        d.step()
    assert slo.num_planned_steps > planned  # still planned for a while: the next one may come soon
    planned = slo.num_planned_steps
    running = {r.request_id for r in d.scheduler._running}
    d.step()
    assert slo.num_planned_steps == planned and set(d.steps[-1]) == running


def test_an_interactive_request_takes_a_bulk_slot_when_every_slot_is_full():
    """One tenant, every slot held by its bulk requests: the interactive request does not wait for
    one of them to finish; the bulk request it displaces comes back and finishes."""
    d = Driver(config(max_num_seqs=4))
    bulk = [d.add(16, 60, tenant="t") for _ in range(6)]
    for _ in range(3):
        d.step()
    chat = d.add(8, 5, tenant="t", slo_tpot_ms=1000)
    d.step()
    assert chat.request_id in d.steps[-1] and len(d.steps[-1]) <= 4
    assert len(d.preempted) == 1 and d.preempted[0] in {r.request_id for r in bulk}
    d.run()
    assert all(r.num_output_tokens == 60 for r in bulk) and chat.num_output_tokens == 5


def interactive_alone(plans: bool, prompt_len: int, tpot_ms: int, n: int = 30, every_s: float = 0.004,
                      max_tokens: int = 24) -> dict[str, float]:
    """Interactive requests alone, arriving every ``every_s`` fake seconds: each one's TTFT."""
    d = Driver(config(slo_step_plans=plans, max_num_batched_tokens=1024))
    warm(d, n_bulk=8, max_tokens=4)  # the step-time model learns, then the bulk requests leave
    d.run()
    start = d.clock()
    arrivals = [start + i * every_s for i in range(n)]
    requests: list[EngineRequest] = []
    ttft: dict[str, float] = {}
    while arrivals or d.scheduler.has_unfinished_requests():
        while arrivals and arrivals[0] <= d.clock():
            arrivals.pop(0)
            requests.append(d.add(prompt_len, max_tokens, slo_ttft_ms=500, slo_tpot_ms=tpot_ms))
        if not d.scheduler.has_unfinished_requests():
            d.clock.advance(arrivals[0] - d.clock())
            continue
        d.step()
        for r in requests:
            if r.num_output_tokens and r.request_id not in ttft:
                ttft[r.request_id] = d.clock() - r.arrival_time
    assert len(ttft) == n
    return ttft


def test_interactive_requests_alone_get_their_first_token_no_later_with_plans_than_without():
    """Alone, with nothing bulk to leave out, a planned step is the step without plans: an
    interactive prompt is never spread over its TTFT slack, so every request's first token comes
    exactly when it would without targets."""
    for tpot_ms in (5, 8, 12):
        for every_s in (0.004, 0.008):
            planned = interactive_alone(True, 200, tpot_ms, every_s=every_s)
            unplanned = interactive_alone(False, 200, tpot_ms, every_s=every_s)
            assert planned == pytest.approx(unplanned), (tpot_ms, every_s)
