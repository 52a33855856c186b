"""The adaptive rule of speculative decoding: step-cost fit, proposal depth, and the scheduler
running fewer proposals for requests whose guesses fail once steps cost per token."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.scheduler.speculation import PRIOR_ACCEPTANCE, SpeculationPolicy, StepCostModel
from tests.helpers import FakeClock
from tests.scheduler.test_speculative_scheduler import GuessingProposer, SpecModel


def test_step_cost_fit_recovers_a_line():
    model = StepCostModel()
    assert model.fit() is None
    for n in (1, 5, 2, 9, 33, 4, 17) * 3:
        model.record(n, 0.020 + 0.0005 * n)
    a, b = model.fit()
    assert a == pytest.approx(0.020, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)


def test_step_cost_fit_waits_for_steps_of_different_sizes():
    model = StepCostModel()
    for _ in range(50):
        model.record(8, 0.01)
    assert model.fit() is None


def _policy(a: float, b: float) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    for n in range(1, 65):
        policy.record_step(n, a + b * n)
    return policy


def test_depth_follows_acceptance_and_load():
    # Steps whose time is nearly all fixed cost: even poor guesses are worth running.
    flat = _policy(a=0.05, b=1e-6)
    assert flat.depth(0.3, 4, num_tokens=1) == 4
    # A fixed cost of 10 tokens' worth. One request decoding (1 useful token): depth j runs while
    # 0.5**j * (a + b * (1 + j)) >= b * (1 + 0.5 + ... + 0.5**j): 0.00325 >= 0.00175 at j = 2,
    # 0.00175 < 0.001875 at j = 3.
    mixed = _policy(a=0.010, b=0.001)
    assert mixed.depth(0.5, 4, num_tokens=1) == 2
    assert mixed.depth(0.9, 4, num_tokens=1) == 4
    # The same rates in a step already holding 200 tokens: nothing is worth proposing.
    assert mixed.depth(0.9, 4, num_tokens=200) == 0
    # Without a fit (no steps of different sizes yet) only the caller's limit applies.
    assert SpeculationPolicy().depth(0.01, 3, num_tokens=500) == 3


def test_a_draft_forward_is_weighed_per_depth():
    """A draft forward costing half a step: worth it only for a request that guesses well, and
    once a step's draft runs that deep, other requests' proposals to that depth cost only b."""
    policy = _policy(a=0.010, b=0.0001)
    for _ in range(20):
        policy.record_step(5, 0.010 + 0.0005 + 0.020, draft_seconds=0.020, draft_depth=4)
    assert policy.draft_forward_s == pytest.approx(0.005)
    assert policy.step_cost.fit()[0] == pytest.approx(0.010, rel=0.05)
    # One decoding request: the first proposal must be accepted more often than about 1 in 3.
    assert policy.depth(0.2, 4, num_tokens=1) == 0
    assert policy.depth(0.95, 4, num_tokens=1) == 4
    # Within a depth the draft already runs, a middling guesser is cheap to add.
    assert policy.depth(0.45, 4, num_tokens=6, useful_tokens=3.0, draft_depth=4) == 4
    assert policy.depth(0.45, 4, num_tokens=6, useful_tokens=3.0, draft_depth=0) < 4


def test_request_rate_moves_from_the_prior_to_its_own_record():
    policy = SpeculationPolicy()
    assert policy.request_rate(0, 0) == pytest.approx(PRIOR_ACCEPTANCE)
    assert policy.request_rate(400, 0) < 0.01
    assert policy.request_rate(400, 400) > 0.99
    policy.record_check(100, 90)
    assert policy.request_rate(0, 0) == pytest.approx((90 + 4 * PRIOR_ACCEPTANCE) / 104)


def test_the_proposers_rate_recovers_when_nothing_is_proposed():
    """After a spell of rejections, steps with no proposals bring the prior back, so that
    requests try proposing again instead of never."""
    policy = _policy(a=0.010, b=0.001)
    policy.record_check(50, 0)
    assert policy.depth(policy.request_rate(0, 0), 4, num_tokens=1) == 0
    for i in range(400):
        n = 1 + i % 8
        policy.record_step(n, 0.010 + 0.001 * n)
    assert policy.step_cost.fit() is not None
    assert policy.request_rate(0, 0) == pytest.approx(PRIOR_ACCEPTANCE, abs=0.01)
    assert policy.depth(policy.request_rate(0, 0), 4, num_tokens=1) >= 1


def test_scheduler_stops_proposing_for_a_request_whose_guesses_fail():
    """Two requests decode side by side under a step cost with a real per-token part; one's
    proposals are always wrong, the other's always right. Once each has a record, the wrong one
    runs (almost) no proposals, and the right one keeps running them."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8,
                             max_model_len=512, num_speculative_tokens=4, speculative_max_batched_tokens=64)

    class PerRequest:
        def __init__(self):
            self.good = GuessingProposer(0.0)
            self.bad = GuessingProposer(1.0)

        def propose(self, request, k):
            return (self.bad if request.request_id == "bad" else self.good).propose(request, k)

    scheduler = Scheduler(config, clock=FakeClock(1_700_000_000.0), proposer=PerRequest())
    model = SpecModel(scheduler)
    requests = {rid: EngineRequest(rid, [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0), max_model_len=512)
                for rid in ("bad", "good")}
    for request in requests.values():
        scheduler.add_request(request)
    proposed_late = {"bad": 0, "good": 0}
    for step in range(60):
        out = scheduler.schedule()
        # A step costs 5 ms plus 1 ms per token: proposals are never free.
        scheduler.record_step_time(out.num_batched_tokens, 0.005 + 0.001 * out.num_batched_tokens)
        if step >= 30:
            for sr in out.scheduled:
                proposed_late[sr.request.request_id] += len(sr.spec_token_ids)
        sampled, accepted = model.run(out)
        scheduler.update_from_output(out, sampled, accepted)
    bad, good = requests["bad"], requests["good"]
    assert not bad.is_finished and not good.is_finished
    assert bad.num_accepted_tokens == 0 and bad.num_rejected_tokens > 0
    assert good.num_rejected_tokens == 0 and good.num_accepted_tokens > 0
    # The failing request may probe again now and then as the proposer's own rate climbs (it is
    # the prior), but it runs a small fraction of what the other runs, which stays near 4 a step.
    assert proposed_late["good"] >= 3 * 30
    assert proposed_late["bad"] <= proposed_late["good"] / 10
