"""What the scheduler decided for one step: plain data handed to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from mqinfer.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """Run ``num_new_tokens`` tokens of ``request`` this step.

    The tokens are ``request.all_token_ids[c : c + num_new_tokens]`` with
    ``c = request.num_computed_tokens`` (read before ``update_from_output``); their KV goes to
    the slots given by ``request.block_ids``. When ``c + num_new_tokens == request.num_tokens``
    the chunk reaches the end of the known tokens and the runner samples one token for it;
    otherwise (a prompt chunk in the middle of chunked prefill) it samples nothing.
    """

    request: Request
    num_new_tokens: int

    @property
    def needs_sample(self) -> bool:
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted by this schedule() call (their blocks are already freed).
    preempted: list[Request] = field(default_factory=list)
    # Requests that ended inside schedule() (expired deadline, can never fit, ...).
    finished: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
