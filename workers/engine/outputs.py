"""Output processing: a step's sampled tokens become one ``RequestOutput`` per touched request.

Owns the engine's per-sequence state (:class:`Tracked`: its incremental detokenizer, logprobs, the
tokens not yet handed over) and :class:`OutputProcessor`, which after the model has run applies the
sampled tokens (``scheduler.update_from_output``), detokenizes them, matches stop strings (a match
ends the request with ``stop``: ``scheduler.finish_requests``), advances grammars (structured
output, ``workers/engine/structured.py``) and lets go of every finished sequence.

A request with ``n`` > 1 choices runs as n sequences: choice 0 under the request's id, choice i
under :func:`choice_id` (``<id>#<i>``). The other choices wait outside the scheduler until choice
0 has computed the prompt (or ended), and then join it (:meth:`OutputProcessor.release_choices`):
the prompt's full KV blocks are in the prefix cache by then, so they take them as hits and compute
only the prompt's last, partial block themselves. Outputs carry the request's id and the choice's
``index``; the scheduler and the KV cache know the sequence's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable

from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, RequestStatus
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.workers.engine.logits_processors import LogitsProcessors
from mqinfer.workers.engine.model_runner import ModelRunnerOutput
from mqinfer.workers.engine.structured import StructuredOutputs
from mqinfer.workers.engine.tokenizer import IncrementalDetokenizer, Tokenizer

# Separates a request's id from its choice number in the sequence id of choice i > 0.
CHOICE_SEPARATOR = "#"


def choice_id(request_id: str, index: int) -> str:
    """The engine's sequence id of choice ``index`` of a request: the request's own id for choice 0."""
    return request_id if index == 0 else f"{request_id}{CHOICE_SEPARATOR}{index}"


@dataclass
class RequestOutput:
    """What happened to one request in one step.

    ``new_token_ids`` / ``new_text`` are this step's delta. ``output_token_ids`` and
    ``logprobs`` are cumulative (everything generated so far; the last
    ``len(new_token_ids)`` entries are this step's). They are the engine's live lists, shared
    rather than copied so that a step costs only its new tokens: while the request runs, later
    steps append to them, so read them in the step that returned them and copy what must be
    kept; once finished they no longer change. Never modify them. ``text`` is set once
    finished (cut before a matched stop string; None for a model without a tokenizer).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    error_code: str | None
    error: str | None
    output_token_ids: list[int]
    text: str | None
    logprobs: list[dict] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    first_token_time: float | None
    # Preemptions that kept the KV in host memory (a subset of num_preemptions).
    num_swaps: int = 0
    # Proposed tokens computed and rejected so far (speculative decoding).
    num_rejected_tokens: int = 0
    # Set once finished, for a request with a grammar: whether its text follows the grammar (see
    # workers/engine/structured.py); None for free text and for error endings.
    schema_valid: bool | None = None
    # The choice (0 to n - 1) of a request with n choices; ``request_id`` is the request's.
    index: int = 0
    # Of num_cached_tokens, those copied up from each KV tier below the device cache (tier -> tokens).
    tier_cached_tokens: dict[str, int] | None = None


@dataclass
class SpecStats:
    """Speculative decoding's running totals for one proposer (``none``: all stay 0)."""

    proposer: str
    # Proposed tokens the model checked.
    proposed_tokens: int = 0
    # Proposed tokens kept (equal to what the model sampled there).
    accepted_tokens: int = 0
    # Tokens requests emitted in the steps where they had proposals: accepted ones and the one
    # sampled after them, less any cut by a stop rule.
    emitted_tokens: int = 0
    # Request-steps that had proposals.
    num_checks: int = 0


@dataclass
class Choices:
    """A request with n > 1 choices while any of them is unfinished."""

    # Choice 0, the one that computes the prompt.
    first: EngineRequest
    # Choices 1..n-1 not given to the scheduler yet (until the first has computed the prompt).
    held: list[EngineRequest]
    # Sequence ids of every choice, in index order.
    ids: list[str]
    # Choices not yet reported finished.
    unfinished: int


@dataclass
class Tracked:
    """Engine-side state of an unfinished sequence (a request, or one choice of it)."""

    request: EngineRequest
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict] | None
    # Highest num_computed_tokens reached: tokens below it that run again are recomputation.
    high_water: int = 0
    first_token_time: float | None = None
    new_token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    """The engine's unfinished sequences and choice groups, and what a step's tokens do to them.

    ``tracked``: every unfinished sequence by its id; ``choices``: requests with n > 1 choices
    by request id, and ``choice_of`` each such choice's (request id, index); ``ended_outside``:
    requests ended between steps (cancel), reported by the next step."""

    def __init__(self, scheduler: Scheduler, structured: StructuredOutputs | None, processors: LogitsProcessors,
                 proposer, spec_stats: SpecStats, tokenizer: Tokenizer | None, clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.structured = structured
        self.processors = processors
        self.proposer = proposer
        self.spec_stats = spec_stats
        self.clock = clock
        self.tracked: dict[str, Tracked] = {}
        self.choices: dict[str, Choices] = {}
        self.choice_of: dict[str, tuple[str, int]] = {}
        self.ended_outside: list[EngineRequest] = []

    def knows(self, seq_id: str) -> bool:
        """Whether ``seq_id`` is an unfinished sequence, or a request with unfinished choices."""
        return seq_id in self.tracked or seq_id in self.choices or seq_id in self.choice_of

    def add(self, request_id: str, choices: list[EngineRequest], share_prompt: bool) -> None:
        """Track a request's sequences (one per choice) and give the scheduler what may run now:
        choice 0, and the others too unless they wait to ``share_prompt`` through the prefix cache."""
        sampling = choices[0].sampling
        for request in choices:
            self.processors.add(request)
            detok = (IncrementalDetokenizer(self.tokenizer, sampling.stop, request.prompt_token_ids)
                     if self.tokenizer is not None else None)
            self.tracked[request.request_id] = Tracked(request, detok, [] if sampling.logprobs is not None else None)
        self.scheduler.add_request(choices[0])
        if len(choices) == 1:
            return
        ids = [request.request_id for request in choices]
        self.choices[request_id] = Choices(choices[0], choices[1:] if share_prompt else [], ids, len(choices))
        for i, rid in enumerate(ids[1:], start=1):
            self.choice_of[rid] = (request_id, i)
        if not share_prompt:
            for request in choices[1:]:
                self.scheduler.add_request(request)

    def cancel(self, request_id: str) -> None:
        """End a request (all its choices) as cancelled; the next step reports them."""
        group = self.choices.get(request_id)
        if group is None:
            self.ended_outside.extend(self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_CANCELLED))
            return
        self.ended_outside.extend(self.scheduler.finish_requests(group.ids, RequestStatus.FINISHED_CANCELLED))
        for request in group.held:
            request.status = RequestStatus.FINISHED_CANCELLED
            self.ended_outside.append(request)
        group.held = []

    def withdraw(self, request_ids: list[str]) -> None:
        """End requests (all their choices) without reporting them in any step."""
        seq_ids: list[str] = []
        for rid in request_ids:
            group = self.choices.pop(rid, None)
            if group is None:
                seq_ids.append(rid)
                continue
            seq_ids.extend(group.ids)
            for request in group.held:
                self.forget(request.request_id)
            for sid in group.ids[1:]:
                self.choice_of.pop(sid, None)
        for request in self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_CANCELLED):
            self.forget(request.request_id)

    def holds(self, request_id: str) -> bool:
        """Whether any choice of the request is still in the engine (waiting, running, or held back
        until the first has computed the prompt)."""
        group = self.choices.get(request_id)
        if group is None:
            return self.scheduler.get_request(request_id) is not None
        return bool(group.held) or any(self.scheduler.get_request(sid) is not None for sid in group.ids)

    def num_held(self) -> int:
        """Choices held back from the scheduler until their first choice has computed the prompt."""
        return sum(len(group.held) for group in self.choices.values()) if self.choices else 0

    def forget(self, seq_id: str) -> None:
        """Drop a sequence that will never be reported (withdrawn): its tracking, proposals,
        grammar and logits processors."""
        self.tracked.pop(seq_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq_id)
        if self.structured is not None:
            self.structured.forget(seq_id)
        self.processors.forget(seq_id)

    def postprocess(self, scheduler_output: SchedulerOutput,
                     ran: ModelRunnerOutput | None) -> list[RequestOutput]:
        """Apply the sampled tokens; one output per request that got a token or ended."""
        ended = (*self.ended_outside, *scheduler_output.finished)
        touched = {request.request_id: request for request in ended}
        self.ended_outside = []
        if ran is not None and scheduler_output.scheduled:
            scheduled = scheduler_output.scheduled
            num_before = [sr.request.num_output_tokens for sr in scheduled]
            self.scheduler.update_from_output(scheduler_output, ran.sampled_token_ids, ran.num_accepted)
            now = self.clock()
            logprobs = ran.logprobs or repeat(None)
            accepted = ran.num_accepted or repeat(0)
            stats = self.spec_stats
            for sr, token, lp, before, a in zip(scheduled, ran.sampled_token_ids, logprobs, num_before, accepted):
                if token is None:
                    continue
                request = sr.request
                tracked = self.tracked[request.request_id]
                # One token, or with proposals the accepted ones and then the sampled one (up to
                # the first that met a stop rule).
                new = request.output_token_ids[before:]
                if not new:
                    continue
                if sr.spec_token_ids:
                    stats.num_checks += 1
                    stats.proposed_tokens += len(sr.spec_token_ids)
                    stats.accepted_tokens += a
                    stats.emitted_tokens += len(new)
                if len(new) == 1:
                    tracked.new_token_ids.append(new[0])
                else:
                    tracked.new_token_ids.extend(new)
                if tracked.first_token_time is None:
                    tracked.first_token_time = now
                if lp is not None:
                    tracked.logprobs.extend(entry.to_dict() for entry in lp[: len(new)])
                touched[request.request_id] = request
        if self.structured is not None and len(self.structured):
            self._advance_grammars(touched.values())
        outputs = [self._output(request) for request in touched.values()]
        # Stop strings end requests here; their blocks go back before the next schedule().
        stopped = [request.request_id for request, o in zip(touched.values(), outputs)
                   if o.finished and not request.is_finished]
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.choices:
            self.release_choices()
        return outputs

    def release_choices(self) -> None:
        """Give the scheduler the held-back choices of requests whose first choice has computed the
        prompt (its full blocks are in the prefix cache now) or has ended."""
        for group in self.choices.values():
            if not group.held:
                continue
            first = group.first
            if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
                for request in group.held:
                    self.scheduler.add_request(request)
                group.held = []

    def _advance_grammars(self, requests) -> None:
        """Feed this step's tokens to the constrained requests' matchers; a grammar that is complete
        ends its request with "stop" (even where the same token reached a length limit: the text is
        whole), one whose matcher failed ends it with an error."""
        structured = self.structured
        done, failed = [], []
        for request in requests:
            rid = request.request_id
            tracked = self.tracked.get(rid)
            if tracked is None or not tracked.new_token_ids or rid not in structured:
                continue
            outcome = structured.advance(request, tracked.new_token_ids)
            if outcome is None:
                continue
            kind, message = outcome
            if kind == "error":
                failed.append((request, message))
            elif request.status is RequestStatus.FINISHED_LENGTH:
                request.status = RequestStatus.FINISHED_STOPPED
            elif not request.is_finished:
                done.append(rid)
        if done:
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)
        for request, message in failed:
            if request.is_finished:
                # Ended this step by a token the mask allowed only because nothing else could
                # come (the constraint cannot be completed): an error, never a valid "stop".
                request.status = RequestStatus.FINISHED_ERROR
                request.error_code, request.error = "invalid_response_format", message
                continue
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR,
                                           "invalid_response_format", message)

    def _output(self, request: EngineRequest) -> RequestOutput:
        """The sequence's output for this step: the new tokens handed over, the cumulative lists
        shared (see ``RequestOutput``), so the cost follows the new tokens, not the total."""
        rid = request.request_id
        parent, index = self.choice_of.get(rid, (rid, 0))
        tracked = self.tracked.get(rid)
        new_ids: list[int] = []
        if tracked is not None:
            new_ids, tracked.new_token_ids = tracked.new_token_ids, []
        finished = request.is_finished
        status = request.status
        new_text, text = "", None
        detok = tracked.detokenizer if tracked is not None else None
        if detok is not None:
            feed = new_ids
            if (finished and status is RequestStatus.FINISHED_STOPPED and new_ids
                    and self._is_stop_token(request, new_ids[-1])):
                feed = new_ids[:-1]  # a stop token ends the text; it is not part of it
            if len(feed) > 1 and detok.stop:
                # Several tokens in one step (accepted proposals): a stop string ends the request
                # at the token that completes it, as if they had come one step at a time.
                new_text = ""
                for n, token in enumerate(feed, start=1):
                    new_text += detok.feed((token,))
                    if detok.stopped:
                        break
                if detok.stopped and n < len(new_ids):
                    dropped = len(new_ids) - n
                    request.truncate_output(len(request.output_token_ids) - dropped)
                    self.spec_stats.emitted_tokens -= dropped
                    new_ids = new_ids[:n]
                    if tracked.logprobs is not None:
                        del tracked.logprobs[len(request.output_token_ids):]
            else:
                new_text = detok.feed(feed) if feed else ""
            if detok.stopped and status is not RequestStatus.FINISHED_STOPPED:
                # A stop string matched: the request ends with "stop", even if a length limit
                # was reached by the same token. The caller frees a still-running one.
                finished, status = True, RequestStatus.FINISHED_STOPPED
                if request.is_finished:
                    request.status = status
            if finished:
                new_text += detok.flush()
                # An error row has no text; every other ending has (possibly empty) text.
                text = detok.text if status is not RequestStatus.FINISHED_ERROR else None
        schema_valid = None
        if finished:
            schema_valid = self._retire(rid, parent, status, detok is not None and detok.stopped)
        return RequestOutput(
            request_id=parent,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=status.finish_reason if finished else None,
            error_code=request.error_code if finished else None,
            error=request.error if finished else None,
            output_token_ids=request.output_token_ids,
            text=text,
            logprobs=tracked.logprobs if tracked is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_preemptions=request.num_preemptions,
            first_token_time=tracked.first_token_time if tracked is not None else None,
            num_swaps=request.num_swaps,
            num_rejected_tokens=request.num_rejected_tokens,
            schema_valid=schema_valid,
            index=index,
            tier_cached_tokens=request.tier_cached_tokens,
        )

    def _retire(self, rid: str, parent: str, status: RequestStatus, text_cut: bool) -> bool | None:
        """Let go of a sequence that has finished (its tracking, proposals, grammar and logits
        processors; its request's choice group once every choice has finished). Returns whether its
        text validated against its schema (``structured.finish``; ``text_cut``: a stop string ended
        the text)."""
        self.tracked.pop(rid, None)
        if self.proposer is not None:
            self.proposer.forget(rid)
        schema_valid = None
        if self.structured is not None:
            schema_valid = self.structured.finish(rid, status.finish_reason, text_cut)
        self.processors.forget(rid)
        group = self.choices.get(parent)
        if group is not None:
            group.unfinished -= 1
            if group.unfinished <= 0:
                del self.choices[parent]
                for sid in group.ids[1:]:
                    self.choice_of.pop(sid, None)
        return schema_valid

    @staticmethod
    def _is_stop_token(request: EngineRequest, token: int) -> bool:
        sampling = request.sampling
        return token in sampling.stop_token_ids or (token in request.eos_token_ids and not sampling.ignore_eos)
