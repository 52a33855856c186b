"""The engine's logits processing: which requests change their logits before sampling, the token
counts their penalties read, and applying it all to a step's logits (kernels/penalties.py).

A request joins when its ``SamplingParams`` ask for a presence, frequency or repetition penalty, a
``logit_bias``, or ``min_tokens`` (its EOS and stop tokens are held back until it has that many
output tokens). The engine hands the processors to the model runner only while it holds such a
request; the runner, as it packs the step, notes the sampling rows of the requests held here and
calls :meth:`LogitsProcessors.apply` with those rows alone. The other rows are left as they are and
cost nothing, and a request's row comes out the same alone or in any batch.

The penalties need each request's tokens so far, kept here on the logits' device and brought up
to date incrementally: a ``[V]`` count of the output tokens (frequency and presence penalties) and
a ``[V]`` mask of the tokens in the prompt or the output (repetition penalty), each step adding the
tokens the request got since the last one. A penalised request samples one row per step, so the
engine keeps it out of speculative decoding (a proposal's row would need the counts with the
proposals before it); a bias and ``min_tokens`` depend only on the row's position and work with
proposals.

The processed logits are float32. They are the runner's logits themselves when those are float32
and nobody in the step wants logprobs (which come from the raw distribution), else a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mqinfer.kernels.penalties import apply_logit_bias, apply_penalties, hold_back_tokens
from mqinfer.scheduler.request import Request


@dataclass(slots=True)
class _State:
    """What one request's processing needs, its tensors on the logits' device."""

    num_prompt_tokens: int
    min_tokens: int
    repetition: float
    frequency: float
    presence: float
    # Tokens in the prompt or the output (only with a repetition penalty).
    seen: torch.Tensor | None = None
    # Occurrences of each token in the output (only with a frequency or presence penalty).
    counts: torch.Tensor | None = None
    # Output tokens already folded into ``seen`` and ``counts``.
    num_counted: int = 0
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # EOS (unless ignore_eos) and stop_token_ids, held back before min_tokens.
    stop_ids: torch.Tensor | None = None

    @property
    def penalised(self) -> bool:
        return self.seen is not None or self.counts is not None


class LogitsProcessors:
    """The engine's requests that process their logits, keyed by request id."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._states: dict[str, _State] = {}
        # Stand-ins for a penalised row without the other penalty's tensor (penalty 1 or 0 makes
        # the row's value irrelevant).
        self._nothing_seen: torch.Tensor | None = None
        self._no_counts: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def request_ids(self):
        """The ids of the requests held (a live view, for fast membership tests)."""
        return self._states.keys()

    def add(self, request: Request) -> None:
        """Hold ``request`` if its sampling parameters process logits (else do nothing). Its
        ``logit_bias`` token ids must be in the vocabulary (the engine checks them first)."""
        sampling = request.sampling
        if not sampling.processes_logits:
            return
        device, vocab = self.device, self.vocab_size
        state = _State(num_prompt_tokens=request.num_prompt_tokens, min_tokens=sampling.min_tokens,
                       repetition=sampling.repetition_penalty, frequency=sampling.frequency_penalty,
                       presence=sampling.presence_penalty)
        if sampling.repetition_penalty != 1.0:
            state.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            state.seen[torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=device)] = True
        if sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0:
            state.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            state.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
            state.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        if sampling.min_tokens > 0:
            stops = set(sampling.stop_token_ids)
            if not sampling.ignore_eos:
                stops |= request.eos_token_ids
            stops = sorted(t for t in stops if 0 <= t < vocab)
            if stops:
                state.stop_ids = torch.tensor(stops, dtype=torch.int64, device=device)
        self._states[request.request_id] = state
        if state.penalised:
            self._sync(state, request)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _sync(self, state: _State, request: Request) -> None:
        """Fold the request's output tokens since the last call into its counts and mask."""
        output = request.output_token_ids
        n = len(output)
        if n == state.num_counted:
            return
        device = self.device
        if n < state.num_counted:  # output cut short (a stop string): count it again from the start
            if state.seen is not None:
                state.seen.zero_()
                state.seen[torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=device)] = True
            if state.counts is not None:
                state.counts.zero_()
            state.num_counted = 0
        new = torch.tensor(output[state.num_counted:], dtype=torch.int64, device=device)
        if state.seen is not None:
            state.seen[new] = True
        if state.counts is not None:
            state.counts.index_put_((new,), torch.ones_like(new, dtype=torch.int32), accumulate=True)
        state.num_counted = n

    def apply(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[Request],
              positions: Sequence[int], keep_raw: bool) -> torch.Tensor:
        """The logits ``[B, V]`` (row ``j`` samples for ``requests[j]`` the token at position
        ``positions[j]``) with the processing of ``rows`` (rows of requests held here) applied,
        float32: in place when ``logits`` are float32 and ``keep_raw`` is False, else in a copy.
        ``logits`` themselves when no row needs anything this step."""
        states = self._states
        picked = [(j, states[requests[j].request_id]) for j in rows]
        penalised: list[tuple[int, _State]] = []
        biased: list[tuple[int, _State]] = []
        held: list[tuple[int, _State]] = []
        done: list[str] = []
        for j, state in picked:
            if state.penalised:
                self._sync(state, requests[j])
                penalised.append((j, state))
            if state.bias_ids is not None:
                biased.append((j, state))
            if state.stop_ids is not None and positions[j] - state.num_prompt_tokens < state.min_tokens:
                held.append((j, state))
            elif not state.penalised and state.bias_ids is None:
                done.append(requests[j].request_id)  # past its min_tokens: nothing left to do
        for request_id in done:
            states.pop(request_id, None)
        if not (penalised or biased or held):
            return logits
        if logits.dtype != torch.float32:
            out = logits.float()
        else:
            out = logits.clone() if keep_raw else logits
        device = out.device
        if biased:
            rows = torch.cat([torch.full((len(s.bias_ids),), j, dtype=torch.int64, device=device) for j, s in biased])
            apply_logit_bias(out, rows, torch.cat([s.bias_ids for _, s in biased]),
                             torch.cat([s.bias_values for _, s in biased]))
        if penalised:
            self._penalise(out, penalised)
        if held:
            rows = torch.cat([torch.full((len(s.stop_ids),), j, dtype=torch.int64, device=device) for j, s in held])
            hold_back_tokens(out, rows, torch.cat([s.stop_ids for _, s in held]))
        return out

    def _penalise(self, out: torch.Tensor, penalised: list[tuple[int, _State]]) -> None:
        device = out.device
        states = [s for _, s in penalised]
        any_repetition = any(s.seen is not None for s in states)
        any_count = any(s.counts is not None for s in states)
        seen = counts = None
        if any_repetition:
            if self._nothing_seen is None:
                self._nothing_seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen = torch.stack([s.seen if s.seen is not None else self._nothing_seen for s in states])
        if any_count:
            if self._no_counts is None:
                self._no_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            counts = torch.stack([s.counts if s.counts is not None else self._no_counts for s in states])

        def column(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        repetition = column([s.repetition for s in states], 1.0) if any_repetition else None
        frequency = column([s.frequency for s in states], 0.0) if any_count else None
        presence = column([s.presence for s in states], 0.0) if any_count else None
        if len(penalised) == out.shape[0]:
            apply_penalties(out, seen, counts, repetition, frequency, presence)
            return
        rows = torch.tensor([j for j, _ in penalised], dtype=torch.int64, device=device)
        sub = apply_penalties(out.index_select(0, rows), seen, counts, repetition, frequency, presence)
        out.index_copy_(0, rows, sub)


__all__ = ["LogitsProcessors"]
