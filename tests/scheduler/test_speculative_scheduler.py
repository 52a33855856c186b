"""The scheduler's side of speculative decoding, driven by a fake model over a shadow KV cache.

The fake model's token is a fixed function of the prefix, and a fake proposer guesses it right
only some of the time, so steps accept some proposals and reject others. The shadow records,
per slot, the token prefix its KV was computed from (proposals included), so a rejected
proposal's KV that a request later reads as its own, or a prefix-cache block that covers a
rejected token, fails the test.
"""

from __future__ import annotations

import random

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from tests.helpers import FakeClock, ShadowKV

BS = 4


def next_token(prefix) -> int:
    """The fake model's token after ``prefix``: deterministic, so runs can be compared."""
    return (sum(prefix) * 31 + len(prefix) * 7) % 40 + 3


class GuessingProposer:
    """Proposes the fake model's continuation, with each token wrong with probability ``p_wrong``."""

    def __init__(self, p_wrong: float, seed: int = 0) -> None:
        self.p_wrong = p_wrong
        self.rng = random.Random(seed)
        self.asked: list[tuple[str, int]] = []

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        self.asked.append((request.request_id, max_tokens))
        tokens = list(request.all_token_ids)
        out = []
        for _ in range(max_tokens):
            t = next_token(tokens)
            if self.rng.random() < self.p_wrong:
                t = 100 + self.rng.randrange(5)  # never the model's token
            out.append(t)
            tokens.append(t)
        return out


class SpecModel:
    """Runs a step on the shadow KV: reads the earlier positions, writes the chunk's KV (the known
    tokens, then each proposal on top of the ones before it) and samples at every row."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.kv = ShadowKV(BS)

    def run(self, out: SchedulerOutput) -> tuple[list[int | None], list[int] | None]:
        sampled: list[int | None] = []
        accepted: list[int] = []
        for sr in out.scheduled:
            request, spec = sr.request, sr.spec_token_ids
            start = request.num_computed_tokens
            assert len(request.block_ids) * BS >= start + sr.num_new_tokens
            self.kv.check_reads(request, start)
            known = request.all_token_ids
            seq = list(known) + list(spec)
            for pos in range(start, start + sr.num_new_tokens):
                self.kv.device[self.kv.slot(request, pos)] = tuple(seq[: pos + 1])
            if not sr.needs_sample:
                sampled.append(None)
                accepted.append(0)
                continue
            a = 0
            while a < len(spec) and spec[a] == next_token(seq[: len(known) + a]):
                a += 1
            sampled.append(next_token(seq[: len(known) + a]))
            accepted.append(a)
        return sampled, accepted


def _run(config: SchedulerConfig, prompts, proposer=None, max_tokens=24, arrivals=None, stop_token_ids=()):
    scheduler = Scheduler(config, clock=FakeClock(1_700_000_000.0), proposer=proposer)
    model = SpecModel(scheduler)
    kv = scheduler.kv_cache_manager
    arrivals = arrivals or [0] * len(prompts)
    requests = {}
    step = 0
    stats = {"proposed": 0, "accepted": 0, "steps": 0}
    while step == 0 or scheduler.has_unfinished_requests() or len(requests) < len(prompts):
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                r = EngineRequest(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  stop_token_ids=tuple(stop_token_ids)),
                            max_model_len=config.max_model_len)
                requests[r.request_id] = r
                scheduler.add_request(r)
        out = scheduler.schedule()
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        spec_tokens = sum(len(sr.spec_token_ids) for sr in out.scheduled)
        if spec_tokens:
            assert out.num_batched_tokens <= config.speculative_max_batched_tokens
        sampled, accepted = model.run(out)
        stats["proposed"] += spec_tokens
        stats["accepted"] += sum(accepted)
        scheduler.update_from_output(out, sampled, accepted)
        # Rejected slots are given back: a running request holds only the blocks its tokens need.
        for r in requests.values():
            if r.status is RequestStatus.RUNNING:
                assert r.num_computed_tokens == r.num_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens
                assert len(r.block_ids) <= kv.num_blocks_for(r.num_tokens)
        # Every cached block holds KV computed from the tokens it is cached under.
        for _, block in kv.block_pool.cached_blocks():
            record = model.kv.device.get(block.block_id * BS + BS - 1)
            assert record is not None and record[-BS:] == block.token_ids
        step += 1
        stats["steps"] += 1
        assert step < 5000
    assert kv.num_free_blocks == kv.num_blocks
    return {rid: r.output_token_ids for rid, r in requests.items()}, {rid: r for rid, r in requests.items()}, stats


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 40) for _ in range(9)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 40) for _ in range(rng.randint(1, 11))] for i in range(n)]


def test_outputs_and_kv_are_exact_with_rejected_proposals_preemption_and_prefix_hits():
    config = SchedulerConfig(block_size=BS, num_kv_blocks=20, max_num_batched_tokens=32, max_num_seqs=6,
                             max_model_len=64, num_speculative_tokens=3, speculative_max_batched_tokens=32)
    prompts = _prompts(10)
    arrivals = [0, 0, 0, 1, 2, 5, 9, 15, 30, 40]
    plain, _, plain_stats = _run(config, prompts, None, arrivals=arrivals)
    proposer = GuessingProposer(p_wrong=0.3)
    spec, requests, stats = _run(config, prompts, proposer, arrivals=arrivals)
    assert spec == plain
    assert all(len(out) == 24 for out in spec.values())
    assert stats["accepted"] > 0 and stats["proposed"] > stats["accepted"]
    assert sum(r.num_rejected_tokens for r in requests.values()) == stats["proposed"] - stats["accepted"]
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert sum(r.num_cached_tokens for r in requests.values()) > 0
    assert stats["steps"] < plain_stats["steps"]


def test_proposals_only_while_the_step_is_small_and_never_past_max_tokens():
    config = SchedulerConfig(block_size=BS, num_kv_blocks=200, max_num_batched_tokens=64, max_num_seqs=8,
                             max_model_len=128, num_speculative_tokens=4, speculative_max_batched_tokens=6)
    proposer = GuessingProposer(p_wrong=0.0)
    scheduler = Scheduler(config, clock=FakeClock(0.0), proposer=proposer)
    model = SpecModel(scheduler)
    reqs = [EngineRequest(f"r{i}", [5 + i] * 3, SamplingParams(max_tokens=7, temperature=0.0)) for i in range(2)]
    for r in reqs:
        scheduler.add_request(r)
    out = scheduler.schedule()
    # The prompts (6 tokens) fill the step: nothing proposed.
    assert [sr.spec_token_ids for sr in out.scheduled] == [[], []]
    scheduler.update_from_output(out, *model.run(out))
    out = scheduler.schedule()
    # Two decodes (2 tokens) leave 4 under the threshold: the first request takes them all.
    assert [len(sr.spec_token_ids) for sr in out.scheduled] == [4, 0]
    assert out.num_batched_tokens == 6
    scheduler.update_from_output(out, *model.run(out))
    assert [r.num_output_tokens for r in reqs] == [6, 2]
    out = scheduler.schedule()
    # One token left for r0 (max_tokens 7): no proposal can be emitted with it.
    assert [len(sr.spec_token_ids) for sr in out.scheduled] == [0, 4]
    assert proposer.asked[-1] == ("r1", 4)
    # A request that opted out is never asked.
    scheduler.update_from_output(out, *model.run(out))
    late = EngineRequest("late", [9, 9, 9], SamplingParams(max_tokens=5, temperature=0.0), speculative=False)
    scheduler.add_request(late)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, *model.run(out))
    assert all(rid != "late" for rid, _ in proposer.asked)
    assert late.num_output_tokens == 5 and all(r.num_output_tokens == 7 for r in reqs)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    config = SchedulerConfig(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=64, num_speculative_tokens=4, speculative_max_batched_tokens=32)
    prompt = [3, 4, 5, 6, 7]
    plain, _, _ = _run(config, [prompt], None, max_tokens=30)
    stop = plain["r0"][6]
    cut = plain["r0"].index(stop) + 1
    plain_stopped, _, _ = _run(config, [prompt], None, max_tokens=30, stop_token_ids=[stop])
    assert plain_stopped["r0"] == plain["r0"][:cut]
    spec, requests, stats = _run(config, [prompt], GuessingProposer(p_wrong=0.0), max_tokens=30,
                                 stop_token_ids=[stop])
    assert spec == plain_stopped
    assert requests["r0"].status is RequestStatus.FINISHED_STOPPED
    # Every proposal was right, so the stop token came in the middle of a run of accepted ones.
    assert stats["accepted"] >= cut
