"""What the scheduler decided for one step: plain data handed to the model runner; and the checks
and stop rules that apply the step's sampled tokens to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mqinfer.scheduler.request import EngineRequest, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """Run ``num_new_tokens`` tokens of ``request`` this step.

    The tokens are ``request.all_token_ids[c : c + num_new_tokens - s]`` with
    ``c = request.num_computed_tokens`` (read before ``update_from_output``), followed by the
    ``s = len(spec_token_ids)`` proposed tokens; their KV goes to the slots given by
    ``request.block_ids``. When the known tokens reach the end (``needs_sample``) the runner
    samples one token after the last known one and one after each proposal, and keeps the
    proposals up to the first one that differs from what it sampled; otherwise (a prompt chunk
    in the middle of chunked prefill, never with proposals) it samples nothing.
    """

    request: EngineRequest
    num_new_tokens: int
    # Proposed continuation (speculative decoding), counted in num_new_tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def needs_sample(self) -> bool:
        return (self.request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work.

    Swap preemption adds block copies that the runner must execute before the forward pass,
    all of ``swap_out`` first, then all of ``swap_in``: a device block given up by a swapped-out
    request may be handed, in the same step, to a request swapped in or to one that writes it
    in the forward pass, so it must be read out before anything writes it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted by this schedule() call (their device blocks are already released).
    preempted: list[EngineRequest] = field(default_factory=list)
    # Requests that ended inside schedule() (expired deadline, can never fit, ...).
    finished: list[EngineRequest] = field(default_factory=list)
    # (device block, host block) pairs to copy device -> host, for requests swapped out.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block) pairs to copy host -> device, for requests swapped back in.
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do: no tokens to run and no blocks to copy."""
        return not self.scheduled and not self.swap_out and not self.swap_in


def check_step_output(scheduled: list[ScheduledRequest], sampled_token_ids: list[int | None],
                      num_accepted: Sequence[int] | None) -> None:
    """Refuse a step's output that does not fit its schedule (``Scheduler.update_from_output``'s
    arguments), before anything is changed."""
    if len(sampled_token_ids) != len(scheduled):
        raise ValueError(f"got {len(sampled_token_ids)} sampled tokens for {len(scheduled)} scheduled requests")
    if num_accepted is not None:
        if len(num_accepted) != len(scheduled):
            raise ValueError(f"got {len(num_accepted)} accepted counts for {len(scheduled)} scheduled requests")
        for sr, a in zip(scheduled, num_accepted):
            if not 0 <= a <= len(sr.spec_token_ids):
                raise ValueError(f"request {sr.request.request_id!r}: {a} accepted of "
                                 f"{len(sr.spec_token_ids)} proposed tokens")
    # Check everything before changing anything, so a bad call leaves the state as it was.
    for sr, token in zip(scheduled, sampled_token_ids):
        request = sr.request
        needs_sample = sr.needs_sample
        if (token is None) == needs_sample and request.status is RequestStatus.RUNNING:
            need = "a sampled token" if needs_sample else "None (a prompt chunk samples nothing)"
            raise ValueError(f"request {request.request_id!r} needs {need}, got {token!r}")


def stop_status(request: EngineRequest, token: int) -> RequestStatus | None:
    """The token-level stop rules for ``token``, just appended to ``request``'s output: its
    finished status, or None; a stop token wins over a length limit reached with it."""
    sampling = request.sampling
    num_output = len(request.output_token_ids)
    if num_output >= sampling.min_tokens and (
        (token in request.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids
    ):
        return RequestStatus.FINISHED_STOPPED
    if num_output >= sampling.max_tokens or len(request.all_token_ids) >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
