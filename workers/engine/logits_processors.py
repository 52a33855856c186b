"""The engine's logits processing: which requests change their logits before sampling, the token
counts their penalties read, and applying it all to a step's logits (kernels/penalties.py).

A request joins when its ``SamplingParams`` ask for a presence, frequency or repetition penalty, a
``logit_bias``, or ``min_tokens`` (its EOS and stop tokens are held back until it has that many
output tokens). The engine hands the processors to the model runner only while it holds such a
request; the runner, as it packs the step, notes the sampling rows of the requests held here and
calls :meth:`LogitsProcessors.apply` with those rows alone. The other rows are left as they are and
cost nothing, and a request's row comes out the same alone or in any batch.

The penalties need each request's tokens so far, kept here and brought up to date incrementally
with the tokens it got since the last step: the distinct tokens of its prompt and output
(repetition penalty) and the distinct tokens of its output with their counts (frequency and
presence penalties), as small tensors on the logits' device. A step then touches only those
(row, token) pairs, not whole rows. A penalised request samples one row per step, so the engine
keeps it out of speculative decoding (a proposal's row would need the counts with the proposals
before it); a bias and ``min_tokens`` depend only on the row's position and work with proposals.

The processed logits are float32. They are the runner's logits themselves when those are float32
and nobody in the step wants logprobs (which come from the raw distribution), else a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mqinfer.kernels.penalties import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    hold_back_tokens,
)
from mqinfer.scheduler.request import EngineRequest


@dataclass(slots=True)
class _State:
    """What one request's processing needs, its tensors on the logits' device."""

    num_prompt_tokens: int
    min_tokens: int
    repetition: float
    frequency: float
    presence: float
    # Distinct tokens of the prompt and the output (only with a repetition penalty): as a set, and
    # in the order they came as a tensor.
    seen: set[int] | None = None
    seen_ids: torch.Tensor | None = None
    # Distinct tokens of the output and how often each came (only with a frequency or presence
    # penalty): token -> its position in ``output_ids`` and ``output_counts``.
    output_index: dict[int, int] | None = None
    output_ids: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    # Output tokens already counted.
    num_counted: int = 0
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # EOS (unless ignore_eos) and stop_token_ids, held back before min_tokens.
    stop_ids: torch.Tensor | None = None

    @property
    def penalised(self) -> bool:
        return self.seen is not None or self.output_index is not None


class LogitsProcessors:
    """The engine's requests that process their logits, keyed by request id."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._states: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def request_ids(self):
        """The ids of the requests held (a live view, for fast membership tests)."""
        return self._states.keys()

    def add(self, request: EngineRequest) -> None:
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
            state.seen = set()
            state.seen_ids = torch.empty(0, dtype=torch.int64, device=device)
            self._see(state, request.prompt_token_ids)
        if sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0:
            state.output_index = {}
            state.output_ids = torch.empty(0, dtype=torch.int64, device=device)
            state.output_counts = torch.empty(0, dtype=torch.float32, device=device)
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

    def _see(self, state: _State, tokens) -> None:
        new = []
        for t in tokens:
            if t not in state.seen:
                state.seen.add(t)
                new.append(t)
        if new:
            state.seen_ids = torch.cat([state.seen_ids, torch.tensor(new, dtype=torch.int64, device=self.device)])

    def _count(self, state: _State, tokens) -> None:
        index, new, bumps = state.output_index, [], []
        for t in tokens:
            k = index.get(t)
            if k is None:
                k = index[t] = len(index)
                new.append(t)
            bumps.append(k)
        device = self.device
        if new:
            state.output_ids = torch.cat([state.output_ids, torch.tensor(new, dtype=torch.int64, device=device)])
            state.output_counts = torch.cat([state.output_counts, torch.zeros(len(new), device=device)])
        if len(bumps) == 1:
            state.output_counts[bumps[0]] += 1.0
        else:
            positions = torch.tensor(bumps, dtype=torch.int64, device=device)
            state.output_counts.index_put_((positions,), torch.ones(len(bumps), device=device), accumulate=True)

    def _sync(self, state: _State, request: EngineRequest) -> None:
        """Fold the request's output tokens since the last call into its seen tokens and counts."""
        output = request.output_token_ids
        n = len(output)
        if n == state.num_counted:
            return
        if n < state.num_counted:  # output cut short (a stop string): count it again from the start
            device = self.device
            if state.seen is not None:
                state.seen = set()
                state.seen_ids = torch.empty(0, dtype=torch.int64, device=device)
                self._see(state, request.prompt_token_ids)
            if state.output_index is not None:
                state.output_index = {}
                state.output_ids = torch.empty(0, dtype=torch.int64, device=device)
                state.output_counts = torch.empty(0, dtype=torch.float32, device=device)
            state.num_counted = 0
        new = output[state.num_counted:]
        if state.seen is not None:
            self._see(state, new)
        if state.output_index is not None:
            self._count(state, new)
        state.num_counted = n

    def apply(self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[EngineRequest],
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
        """The penalties of the penalised rows, over their (row, token) pairs."""
        device = out.device
        repeated = [(j, s) for j, s in penalised if s.seen_ids is not None and s.seen_ids.numel()]
        if repeated:
            sizes = torch.tensor([s.seen_ids.numel() for _, s in repeated], device=device)
            rows = torch.tensor([j for j, _ in repeated], dtype=torch.int64, device=device).repeat_interleave(sizes)
            factors = torch.tensor([s.repetition for _, s in repeated], device=device).repeat_interleave(sizes)
            apply_repetition_penalty(out, rows, torch.cat([s.seen_ids for _, s in repeated]), factors)
        counted = [(j, s) for j, s in penalised if s.output_ids is not None and s.output_ids.numel()]
        if counted:
            sizes = torch.tensor([s.output_ids.numel() for _, s in counted], device=device)
            rows = torch.tensor([j for j, _ in counted], dtype=torch.int64, device=device).repeat_interleave(sizes)
            frequency = torch.tensor([s.frequency for _, s in counted], device=device).repeat_interleave(sizes)
            presence = torch.tensor([s.presence for _, s in counted], device=device).repeat_interleave(sizes)
            apply_frequency_presence(out, rows, torch.cat([s.output_ids for _, s in counted]),
                                     torch.cat([s.output_counts for _, s in counted]), frequency, presence)


__all__ = ["LogitsProcessors"]
