"""What the scheduler decided for one step: plain data handed to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from mqinfer.scheduler.request import EngineRequest


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
