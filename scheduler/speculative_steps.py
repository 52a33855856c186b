"""Speculative decoding in a step: proposed tokens added to the scheduled requests that are about to
sample (``add_proposals``), and a step's checked proposals applied to them (``apply_proposals``).

How many a request runs is the speculation policy's decision (scheduler/speculation.py); the
scheduler (scheduler/scheduler.py) calls these after the running requests and the admissions, so
proposals use only what the step has spare, and from ``update_from_output``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mqinfer.scheduler.output import ScheduledRequest, SchedulerOutput, stop_status
from mqinfer.scheduler.request import EngineRequest, RequestStatus
from mqinfer.scheduler.speculation import SpeculationPolicy

if TYPE_CHECKING:
    from mqinfer.scheduler.config import SchedulerConfig
    from mqinfer.scheduler.kv_cache_manager import KVCacheManager


class Proposer(Protocol):
    """Proposes how a request continues (speculative decoding)."""

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` (>= 1) tokens that may follow ``request.all_token_ids``; [] for none."""
        ...


def add_proposals(out: SchedulerOutput, config: "SchedulerConfig", kv: "KVCacheManager", proposer: Proposer,
                  policy: SpeculationPolicy | None) -> None:
    """Give the scheduled requests about to sample their proposed tokens, while the step stays
    within ``speculative_max_batched_tokens``, as many as ``policy`` finds worth their cost (None:
    as many as configured); a request whose extra slots do not fit in the free blocks runs without."""
    limit = min(config.speculative_max_batched_tokens, config.max_num_batched_tokens)
    total = out.num_batched_tokens
    propose = proposer.propose
    # For the policy: the step's expected useful tokens (known ones, and proposals weighted by
    # their chance of acceptance) and the deepest run of proposals so far (draft forwards).
    useful = float(total)
    depth = 0
    for sr in out.scheduled:
        spare = limit - total
        if spare <= 0:
            break
        request = sr.request
        if not request.speculative or not sr.needs_sample:
            continue
        # Each accepted proposal is emitted along with one more sampled token: propose no more
        # than the request can still emit, minus that one.
        room = min(request.sampling.max_tokens - request.num_output_tokens,
                   request.max_model_len - request.num_tokens) - 1
        k = min(config.num_speculative_tokens, spare, room)
        if k <= 0:
            continue
        if policy is not None:
            rate = policy.request_rate(request.num_accepted_tokens + request.num_rejected_tokens,
                                       request.num_accepted_tokens)
            k = policy.depth(rate, k, num_tokens=total, useful_tokens=useful, draft_depth=depth)
            if k <= 0:
                continue
        proposal = propose(request, k)[:k]
        if not proposal or not kv.allocate_slots(request, sr.num_new_tokens + len(proposal)):
            continue
        sr.spec_token_ids = list(proposal)
        sr.num_new_tokens += len(proposal)
        total += len(proposal)
        if policy is not None:
            useful += sum(rate ** j for j in range(1, len(proposal) + 1))
            depth = max(depth, len(proposal))


def apply_proposals(sr: ScheduledRequest, token: int | None, accepted: int, policy: SpeculationPolicy,
                    kv: "KVCacheManager") -> RequestStatus | None:
    """A request that ran proposals: its output grows by the ``accepted`` leading ones and then
    the sampled ``token``, up to the first that meets a stop rule (its status, else None);
    the rejected proposals' computed tokens are rolled back and their blocks given back."""
    request, spec = sr.request, sr.spec_token_ids
    rejected = len(spec) - accepted
    request.num_rejected_tokens += rejected
    request.num_accepted_tokens += accepted
    policy.record_check(len(spec), accepted)
    # The KV of the known tokens and of the accepted proposals is written; the rejected
    # proposals' slots hold garbage that the next step overwrites.
    computed = request.num_computed_tokens + sr.num_new_tokens - rejected
    status = None
    for t in (*spec[:accepted], token):
        request.append_output_token(t)
        status = stop_status(request, t)
        if status is not None:
            break
    # A stop rule met before the end of the run leaves accepted tokens out: never count
    # more computed tokens than the request has.
    request.num_computed_tokens = min(computed, request.num_tokens)
    if status is None and rejected:
        kv.trim(request, request.num_tokens)
    return status
