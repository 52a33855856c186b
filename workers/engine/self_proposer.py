"""Layer-skip self-speculation, the ``self`` proposer of speculative decoding: the target model's
own first L decoder layers, followed by its final norm and its LM head, serve as the draft.
No second checkpoint is loaded; this is the baseline a trained draft model has to beat.

How a step runs. The scheduler asks ``SelfProposer.propose`` for up to K tokens per request
that speculates, exactly as it asks the ``ngram`` proposer, and gets K placeholders
(``DRAFT_PENDING``) back: a greedy draft always proposes as many tokens as it is asked for, so
the scheduler can allocate the request's KV slots for its known tokens and all K proposals
right away. The model runner then, after the step's swap copies and before the verification
pass, runs ``LayerSkipDraft.fill``: K autoregressive forwards of the first L layers over the
requests that speculate (the first one over each request's known new tokens, each later one
over the previous draft token), each taking the argmax of the draft's logits, and writes the
draft tokens over the placeholders. Verification and acceptance are the same as for every
proposer (model_runner.py, ``accept_proposals``), so the outputs are exactly the target
model's; a greedy draft is also a valid proposal for sampled requests (the acceptance rule
takes a proposed token with its probability under the target).

Why the draft may write into the target's own KV cache. The draft's layer l (l < L) is the
target's layer l, and it needs, for every earlier position, exactly the K/V that the target's
layer l computed there: those are in the target's paged cache already, for every computed
token. For the positions it runs itself, the draft writes its layer-l K/V into the request's
own slots in the target's cache, and nowhere else:

- It writes only positions from ``num_computed_tokens`` on: the step's known new tokens and all
  but the last proposal, all covered by the blocks the scheduler allocated for the step before
  the runner was called (the draft refuses to run past the request's block table).
- The verification pass of the same step runs every one of those positions (the known tokens
  and each proposal) through every layer, and each layer stores its K/V into the slots before
  attention reads them, so every value the draft wrote is overwritten by the target's value
  for the same token before anything other than the draft reads it. Positions before
  ``num_computed_tokens`` are never written.
- Blocks past a request's computed tokens are its own: the prefix cache registers a block only
  once it is full of computed tokens, and only such blocks are shared, so no other request can
  read a slot the draft writes, and no cached block's hash ever covers a proposal.
- Rejected proposals are rolled back as for any proposer: the scheduler lowers the computed
  tokens to the accepted ones and ``KVCacheManager.trim`` gives back the blocks only they
  needed; the slots left behind hold values that the next step overwrites.
- The draft runs after the step's swap copies: a device block given up by a request swapped
  out in this step may be allocated to a speculating request, and must be copied out before
  the draft writes it; a request swapped back in must have its KV copied in before the draft
  reads it.
"""

from __future__ import annotations

import torch

from mqinfer.kernels.attention import AttentionWorkspace, build_attention_metadata
from mqinfer.scheduler.output import ScheduledRequest
from mqinfer.scheduler.request import EngineRequest
from mqinfer.workers.engine.models import LlamaForCausalLM

# Placeholder for a draft token the model runner fills in before the verification pass.
DRAFT_PENDING = -1


def resolve_draft_layers(draft_layers: int | None, num_layers: int, model_name: str) -> int:
    """The draft's layer count L: ``draft_layers``, or half the model's layers when None.

    Raises ValueError unless 1 <= L < ``num_layers`` (a draft as deep as the model would only
    repeat it).
    """
    if num_layers < 2:
        raise ValueError(f"--speculative self needs a model with at least 2 layers; {model_name} has {num_layers}")
    layers = num_layers // 2 if draft_layers is None else draft_layers
    if not 1 <= layers < num_layers:
        raise ValueError(f"--draft-layers must be between 1 and {num_layers - 1} for {model_name} "
                         f"({num_layers} layers), got {layers}")
    return layers


class SelfProposer:
    """``Proposer`` for the scheduler (scheduler/scheduler.py): asks for ``max_tokens`` draft
    tokens, which the model runner's ``LayerSkipDraft`` computes in the same step."""

    name = "self"

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        return [DRAFT_PENDING] * max_tokens

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


class LayerSkipDraft:
    """Runs the first ``num_layers`` layers of ``model`` (its final norm and head after them) as
    a greedy draft over the model runner's KV cache (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list, num_layers: int, block_size: int,
                 num_queries_per_kv: int, device: torch.device, workspace: AttentionWorkspace) -> None:
        self.model = model
        self.num_layers = num_layers
        self.kv_caches = kv_caches[:num_layers]
        self.block_size = block_size
        self.num_queries_per_kv = num_queries_per_kv
        self.device = device
        self.workspace = workspace

    def fill(self, scheduled: list[ScheduledRequest]) -> int:
        """Replace the placeholder proposals of ``scheduled`` with draft tokens; returns how
        many requests were drafted. Call after the step's block copies and before its forward."""
        todo = [sr for sr in scheduled if sr.spec_token_ids]
        if not todo:
            return 0
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        counts: list[int] = []
        for sr in todo:
            request = sr.request
            c, k = request.num_computed_tokens, len(sr.spec_token_ids)
            n = sr.num_new_tokens - k
            if c + n != request.num_tokens or len(request.block_ids) * self.block_size < c + n + k - 1:
                raise ValueError(f"request {request.request_id!r}: proposals need its known tokens to reach "
                                 "the end and its blocks to cover the draft's positions")
            input_ids.extend(request.all_token_ids[c : c + n])
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(request.block_ids)
            counts.append(k)
        device = self.device
        drafted = torch.empty(len(todo), max(counts), dtype=torch.int64, device=device)
        # The first forward: every request's known new tokens; the draft token comes from its last row.
        last_rows = torch.tensor(query_lens, dtype=torch.int64).cumsum(0).sub_(1).to(device)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(device)
        drafted[:, 0] = self._forward(ids, query_lens, seq_lens, tables, last_rows)
        # Each later forward: the previous draft token of every request that wants another one.
        for j in range(1, max(counts)):
            active = [b for b, k in enumerate(counts) if k > j]
            rows = torch.tensor(active, dtype=torch.int64).to(device) if len(active) < len(todo) else None
            previous = drafted[:, j - 1] if rows is None else drafted[:, j - 1].index_select(0, rows)
            tokens = self._forward(previous, [1] * len(active), [seq_lens[b] + j for b in active],
                                   [tables[b] for b in active], None)
            if rows is None:
                drafted[:, j] = tokens
            else:
                drafted[:, j].index_copy_(0, rows, tokens)
        for sr, row, k in zip(todo, drafted.tolist(), counts):
            sr.spec_token_ids[:] = row[:k]
        return len(todo)

    def _forward(self, ids: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]], rows: torch.Tensor | None) -> torch.Tensor:
        """The draft's greedy token after each sequence (``rows``: the packed row of each
        sequence's last token; None when every sequence has one query token)."""
        metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.num_queries_per_kv,
                                            device=self.device, workspace=self.workspace)
        hidden = self.model(ids, metadata.positions, self.kv_caches, metadata, num_layers=self.num_layers)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(hidden).argmax(dim=-1)


__all__ = ["DRAFT_PENDING", "LayerSkipDraft", "SelfProposer", "resolve_draft_layers"]
