"""A draft model, the ``draft`` proposer of speculative decoding: a second, smaller checkpoint
with the model's tokenizer proposes K tokens greedily, each from its own forward, and the model
checks all of them in one step.

How a step runs. As for the ``self`` proposer (workers/engine/self_proposer.py), the scheduler asks
``DraftProposer.propose`` for up to K tokens per speculating request and gets K placeholders
(``DRAFT_PENDING``); it allocates the request's KV slots for its known tokens and the K
proposals. The model runner then, after the step's swap copies and before the verification
pass, calls ``ModelDraft.fill``, which writes the draft's greedy tokens over the placeholders:

1. Catch-up: every speculating request's tokens that the draft has not run yet (its prompt,
   the tokens it emitted in steps where it did not speculate, its last sampled token), packed
   into flat batches of at most ``max_tokens_per_forward`` tokens; a request whose catch-up is
   longer goes on in the next batch. The draft's logits after each request's last known token
   give its first proposal.
2. K - 1 single-token forwards, each over the previous proposal of every request that wants
   another one.

Verification and acceptance are the same as for every proposer (model_runner.py,
``accept_proposals``): the outputs are exactly the model's, greedy or sampled.

The draft's own KV cache. The draft has its own paged cache (``draft_kv_caches``: its layers,
KV heads and head size), with as many blocks as the model's, of the same block size, and a
request's draft block table is its block table: block j of the request holds the model's K/V
in the model's cache and the draft's K/V in the draft's cache. So the scheduler's block
accounting covers both (the engine sizes the automatic block count for the two caches
together), and no second allocator exists. The draft never reads or writes the model's cache,
so nothing it computes can change an output: the draft's cache only steers which tokens are
proposed.

Which draft K/V can be trusted. ``fill`` keeps, per request, how many leading tokens the draft
has run (``_Progress.num_computed``) and the proposals it ran after them (``pending``: the
first K - 1 of its last proposals, whose K/V it wrote). At the next ``fill`` the draft resumes
after its run tokens and those pending proposals that turned out to be the request's tokens
(accepted); the first rejected proposal, and everything after it, is run again with the
request's real tokens. Confirming by the tokens themselves rather than by acceptance counts
keeps this right whatever happened in between (steps without speculation, stop rules). The
slots the draft resumes from are the request's own, unchanged since it wrote them:

- A request's blocks change only by growing (new blocks past its tokens), by trimming blocks
  past its tokens (the draft's trusted positions are all below the request's token count), and
  by preemption, after which the block ids may differ (recompute: new blocks or cached ones;
  swap: other blocks, and the draft's cache is not swapped). Every preemption raises
  ``EngineRequest.num_preemptions``, and a request whose count moved since the draft last ran
  starts again from its first token.
- A request the draft has not seen (new, or admitted with prefix-cache hits) starts from its
  first token. The blocks of its hits were written by the model for another request, and the
  draft's cache at those block ids may hold nothing of use (that request may never have
  speculated, or the block may have been reused since), so the draft recomputes them. Its
  writes go into the shared blocks, at positions that hold the same tokens in every request
  sharing them (a cached block's hash covers its tokens and their whole prefix): they are the
  same K/V the other requests' drafts wrote there, up to floating-point rounding between batch
  shapes, and a difference in rounding can only change a proposal, never an output.
- Every other slot the draft writes lies past the request's computed tokens, in blocks only
  that request holds (the prefix cache shares only full blocks of computed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mqinfer.kernels.attention import AttentionWorkspace, build_attention_metadata
from mqinfer.scheduler.output import ScheduledRequest
from mqinfer.scheduler.request import EngineRequest
from mqinfer.workers.engine.loader import ModelInfo
from mqinfer.workers.engine.models import LlamaForCausalLM
from mqinfer.workers.engine.self_proposer import DRAFT_PENDING

# Forget every request's progress when this many are held: a safety net for callers that never
# call forget() (a forgotten request only runs its catch-up again).
_MAX_PROGRESS = 4096


def check_draft_model(draft: ModelInfo, target: ModelInfo, max_model_len: int) -> None:
    """Raise ValueError unless ``draft`` can propose for ``target``: the same vocabulary size, and
    full attention over ``max_model_len`` tokens (no sliding window shorter than that)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"--draft-model {draft.name} has a vocabulary of {draft.vocab_size} tokens but the model "
                         f"{target.name} has {target.vocab_size}; the draft needs the model's tokenizer")
    if draft.sliding_window is not None and max_model_len > draft.sliding_window:
        raise ValueError(f"--draft-model {draft.name} uses sliding-window attention ({draft.sliding_window} "
                         f"tokens), which this engine does not implement; set max_model_len <= "
                         f"{draft.sliding_window}")


class DraftProposer:
    """``Proposer`` for the scheduler (scheduler/scheduler.py): asks for ``max_tokens`` draft
    tokens, which the model runner's ``ModelDraft`` computes in the same step."""

    name = "draft"

    def __init__(self, draft: ModelDraft) -> None:
        self.draft = draft

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        return [DRAFT_PENDING] * max_tokens

    def forget(self, request_id: str) -> None:
        """Drop what the draft keeps for a request that ended."""
        self.draft.forget(request_id)


@dataclass(slots=True)
class _Progress:
    """What the draft's cache holds for one request (see the module docstring)."""

    request: EngineRequest
    # EngineRequest.num_preemptions when the draft last ran: a preemption since voids everything.
    num_preemptions: int
    # Leading tokens of the request whose draft K/V is written.
    num_computed: int
    # The proposals run right after them, at the next positions; trusted as far as they match
    # the request's tokens there.
    pending: list[int]


class ModelDraft:
    """Runs ``model`` (the draft checkpoint) as a greedy draft over its own paged KV cache,
    ``kv_caches``, indexed by the model runner's block ids (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, info: ModelInfo, kv_caches: list, block_size: int,
                 device: torch.device, max_tokens_per_forward: int) -> None:
        if len(kv_caches) != info.num_layers:
            raise ValueError(f"the draft has {info.num_layers} layers, got {len(kv_caches)} KV caches")
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be at least 1, got {max_tokens_per_forward}")
        self.model = model
        self.info = info
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_queries_per_kv = info.num_heads // info.num_kv_heads
        self.device = device
        self.max_tokens_per_forward = max_tokens_per_forward
        self.workspace = AttentionWorkspace()
        self._progress: dict[str, _Progress] = {}
        # Tokens the draft ran in its catch-up forwards (what it recomputed included), for tests
        # and measurements.
        self.num_catch_up_tokens = 0

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the draft's KV cache, every layer's K, V and (8-bit) scales."""
        return sum(cache.nbytes for cache in self.kv_caches)

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def num_computed(self, request: EngineRequest) -> int:
        """How many of ``request``'s leading tokens have their draft K/V in the draft's cache."""
        entry = self._progress.get(request.request_id)
        if entry is None or entry.request is not request or entry.num_preemptions != request.num_preemptions:
            return 0
        tokens = request.all_token_ids
        n = min(entry.num_computed, len(tokens))
        for token in entry.pending:
            if n >= len(tokens) or tokens[n] != token:
                break
            n += 1
        return n

    def fill(self, scheduled: list[ScheduledRequest]) -> int:
        """Replace the placeholder proposals of ``scheduled`` with draft tokens; returns how
        many requests were drafted. Call before the step's forward."""
        todo = [sr for sr in scheduled if sr.spec_token_ids]
        if not todo:
            return 0
        starts: list[int] = []
        known: list[int] = []
        counts: list[int] = []
        for sr in todo:
            request = sr.request
            k = len(sr.spec_token_ids)
            n = request.num_tokens
            if (request.num_computed_tokens + sr.num_new_tokens - k != n
                    or len(request.block_ids) * self.block_size < n + k - 1):
                raise ValueError(f"request {request.request_id!r}: proposals need its known tokens to reach "
                                 "the end and its blocks to cover the draft's positions")
            # At least the last known token runs: its logits give the first proposal.
            starts.append(min(self.num_computed(request), n - 1))
            known.append(n)
            counts.append(k)
        device = self.device
        drafted = torch.empty(len(todo), max(counts), dtype=torch.int64, device=device)
        self._catch_up(todo, starts, known, drafted)
        # Each later forward: the previous draft token of every request that wants another one.
        for j in range(1, max(counts)):
            active = [b for b, k in enumerate(counts) if k > j]
            rows = torch.tensor(active, dtype=torch.int64).to(device) if len(active) < len(todo) else None
            previous = drafted[:, j - 1] if rows is None else drafted[:, j - 1].index_select(0, rows)
            tokens = self._forward(previous, [1] * len(active), [known[b] + j for b in active],
                                   [todo[b].request.block_ids for b in active], None)
            if rows is None:
                drafted[:, j] = tokens
            else:
                drafted[:, j].index_copy_(0, rows, tokens)
        if len(self._progress) + len(todo) > _MAX_PROGRESS:
            self._progress.clear()
        for sr, row, n, k in zip(todo, drafted.tolist(), known, counts):
            request = sr.request
            sr.spec_token_ids[:] = row[:k]
            # The last proposal was not run: its K/V is not written.
            self._progress[request.request_id] = _Progress(request, request.num_preemptions, n, row[: k - 1])
        return len(todo)

    def _catch_up(self, todo: list[ScheduledRequest], starts: list[int], known: list[int],
                  drafted: torch.Tensor) -> None:
        """Run every request's tokens from ``starts[b]`` to ``known[b]`` through the draft, in
        flat batches of at most ``max_tokens_per_forward`` tokens, and put its greedy token after
        the last one in ``drafted[b, 0]``."""
        device = self.device
        position = list(starts)
        while True:
            batch: list[int] = []
            input_ids: list[int] = []
            query_lens: list[int] = []
            budget = self.max_tokens_per_forward
            for b, sr in enumerate(todo):
                if position[b] >= known[b] or budget <= 0:
                    continue
                n = min(known[b] - position[b], budget)
                input_ids.extend(sr.request.all_token_ids[position[b] : position[b] + n])
                query_lens.append(n)
                batch.append(b)
                budget -= n
                position[b] += n
            if not batch:
                return
            self.num_catch_up_tokens += len(input_ids)
            last_rows = torch.tensor(query_lens, dtype=torch.int64).cumsum(0).sub_(1).to(device)
            ids = torch.tensor(input_ids, dtype=torch.int64).to(device)
            tokens = self._forward(ids, query_lens, [position[b] for b in batch],
                                   [todo[b].request.block_ids for b in batch], last_rows)
            done = [i for i, b in enumerate(batch) if position[b] == known[b]]
            if len(done) == len(todo):
                drafted[:, 0] = tokens
            elif done:
                drafted[:, 0].index_copy_(0, torch.tensor([batch[i] for i in done], dtype=torch.int64).to(device),
                                          tokens.index_select(0, torch.tensor(done, dtype=torch.int64).to(device)))

    def _forward(self, ids: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]], rows: torch.Tensor | None) -> torch.Tensor:
        """The draft's greedy token after each sequence (``rows``: the packed row of each
        sequence's last token; None when every sequence has one query token)."""
        metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.num_queries_per_kv,
                                            device=self.device, workspace=self.workspace)
        hidden = self.model(ids, metadata.positions, self.kv_caches, metadata)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(hidden).argmax(dim=-1)


__all__ = ["DraftProposer", "ModelDraft", "check_draft_model"]
