"""Pipeline parallelism: one worker's model split by layers into P stages, each its own process.

Stage ``s`` holds a contiguous range of the decoder layers (``workers/engine/models/stage.py``): the
first stage also the token embedding, the last the final norm and the LM head. Each stage's KV
cache holds its own layers only, under the same block ids on every stage, so the scheduler, the
KV block pool, prefix caching, preemption (recompute and swap: every stage copies its own
layers' blocks) and the 8-bit KV cache work as they do on one rank. Combined with tensor
parallelism a worker has ``T x P`` ranks: rank ``r`` is tensor-parallel rank ``r mod T`` of stage
``r div T`` (``parallel.rank_parts``), each stage's ``T`` ranks all-reduce within their own group.

Rank 0 (stage 0) is the worker process, as with tensor parallelism (``workers/engine/parallel.py``, whose
``Leader`` starts the other ranks, sends every rank each step's plan and watches that they live):
it owns Redis, the scheduler, sampling, the sinks and the acks. Each step's scheduled requests are
cut into micro-batches (contiguous runs of requests with about equal tokens, ``max(2, P)`` of them
where each gets ``MIN_MICRO_BATCH_TOKENS``), and every stage runs them in order: the first stage
embeds the tokens, each stage sends its residual stream to the same tensor-parallel rank of the
next stage (asynchronously, so it starts on the next micro-batch at once), and the last stage
sends the logits of the rows that sample back to rank 0, which samples from the whole vocabulary
as one rank would. So while stage ``s + 1`` runs micro-batch ``m``, stage ``s`` runs ``m + 1``:
with ``P`` stages and ``M`` micro-batches a step takes ``(M + P - 1) / M`` of one stage's share of
the work instead of ``P`` shares. A step of a few decodes runs whole (cut, each micro-batch would
read every weight again): its stages run one after the other. Between steps the stages wait for
rank 0 to sample and schedule the next (the next step's tokens depend on this step's).

Exactness: a stage sends the residual stream itself, and splitting a step into micro-batches only
changes which requests share a matmul, so greedy float32 output is that of one rank.

A stage that dies makes the transfers of its neighbours fail (their sockets close); a stage whose
transfer failed exits, and rank 0's own transfer or liveness check then raises
:class:`~mqinfer.workers.engine.parallel.RankFailure`: the worker stops without acking what it holds.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from mqinfer.kernels.attention import build_attention_metadata
from mqinfer.schemas import faults
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.workers.engine.loader import ModelInfo
from mqinfer.workers.engine.model_runner import ModelRunner
from mqinfer.workers.engine.models.stage import StageModel
from mqinfer.workers.engine.parallel import COLLECTIVE_TIMEOUT_S, Group, StepPlan

if TYPE_CHECKING:
    from mqinfer.workers.engine.ranks import Leader

# Micro-batches per step, at least (at most one per request): two keep two stages busy at once.
MIN_MICRO_BATCHES = 2
# Tokens each micro-batch needs before a step is cut, by device type. Below this a projection's
# time is that of reading its weights, which every micro-batch reads again, so two small
# micro-batches cost about what two whole steps would: a ``[rows, k] x [k, n]`` product does about
# ``rows / 2`` FLOP per float32 weight byte, and one CPU core's compute outruns its memory
# bandwidth from about 10 rows on (measured: a step's 16 decode rows cut in two took about as long
# per half as the whole). A GPU's crossing is in the hundreds of rows (a reckoning, not run on one).
MIN_MICRO_BATCH_TOKENS = {"cpu": 32, "cuda": 256}
# Micro-batches per step, overriding the rule above, for measurements (1 runs the stages one after
# the other). Every rank reads it (the worker's environment passes to its ranks), so they cut alike.
MICRO_BATCHES_ENV = "MQINFER_PIPELINE_MICRO_BATCHES"


class PipelineGroup(Group):
    """This process's view of a pipeline worker's ranks: its stage's tensor-parallel group (the
    collectives of ``Group``, within that stage) and the transfers between stages (the residual
    stream forward to the next stage, the sampling rows' logits from the last stage to rank 0).
    Sends are asynchronous, and waited for before the next step's; receives block."""

    failure = "a pipeline transfer or collective failed"

    def __init__(self, rank: int, tensor: int, pipeline: int, device: str, leader: Leader | None = None,
                 stage_group=None) -> None:
        """Global rank ``rank`` of ``tensor x pipeline``; ``stage_group``: its stage's
        tensor-parallel process group (None with one rank per stage)."""
        stage = rank // tensor
        super().__init__(rank % tensor, tensor, device, leader, process_group=stage_group, root=stage * tensor)
        self.global_rank, self.tensor, self.stage, self.num_stages = rank, tensor, stage, pipeline
        self._sends: list[tuple[object, torch.Tensor]] = []

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """The residual stream of one micro-batch to this rank's counterpart on the next stage."""
        self._isend(hidden, self.global_rank + self.tensor)

    def recv_hidden(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The residual stream of the next micro-batch, from the counterpart on the stage before."""
        return self._recv((rows, width), dtype, self.global_rank - self.tensor)

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage (its tensor-parallel rank 0): a micro-batch's sampling logits to rank 0."""
        self._isend(logits, 0)

    def recv_logits(self, rows: int, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank 0: the next micro-batch's sampling logits ``[rows, vocab]`` from the last stage."""
        return self._recv((rows, vocab_size), dtype, (self.num_stages - 1) * self.tensor)

    def wait_sends(self) -> None:
        """Wait until every send so far has been taken (their tensors may be dropped then)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._lost(exc) from None

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        try:
            work = self.dist.isend(tensor, dst)
        except RuntimeError as exc:
            raise self._lost(exc) from None
        self._sends.append((work, tensor))  # the tensor must live until the send is done

    def _recv(self, shape: tuple[int, int], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            self.dist.recv(out, src)
        except RuntimeError as exc:
            raise self._lost(exc) from None
        return out


def join_pipeline(init_method: str, rank: int, tensor: int, pipeline: int, device: str,
                  leader: Leader | None = None) -> PipelineGroup:
    """Join the ``tensor x pipeline`` ranks and make each stage's tensor-parallel group (every
    rank takes part in making every group, in the same order); returns once all have joined."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tensor * pipeline,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    groups = [None] * pipeline
    if tensor > 1:
        groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) for s in range(pipeline)]
    return PipelineGroup(rank, tensor, pipeline, device, leader, groups[rank // tensor])


# ---------------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatch:
    """A contiguous run of a step's requests: their indices, their packed rows ``[start, stop)``,
    and the rows among them that sample (counted from ``start``)."""

    requests: slice
    rows: tuple[int, int]
    sample_rows: list[int]

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


def split_micro_batches(plan: StepPlan, count: int) -> list[MicroBatch]:
    """The plan's requests cut into at most ``count`` contiguous runs (one per request at most) of
    about equal tokens: a cut falls after the request that brings the tokens so far to the next
    ``k / count`` of the step's, or wherever fewer requests would be left than runs to fill. Every
    rank cuts the same plan the same way."""
    lens = plan.query_lens
    n = len(lens)
    count = max(1, min(count, n))
    total = sum(lens)
    bounds, tokens = [0], 0
    for i in range(n - 1):
        if len(bounds) == count:
            break
        tokens += lens[i]
        if tokens * count >= total * len(bounds) or n - (i + 1) == count - len(bounds):
            bounds.append(i + 1)
    bounds.append(n)
    starts = [0]
    for q in lens:
        starts.append(starts[-1] + q)
    sample_rows = plan.sample_rows
    batches = []
    for first, stop in zip(bounds, bounds[1:]):
        r0, r1 = starts[first], starts[stop]
        lo, hi = bisect.bisect_left(sample_rows, r0), bisect.bisect_left(sample_rows, r1)
        batches.append(MicroBatch(slice(first, stop), (r0, r1), [r - r0 for r in sample_rows[lo:hi]]))
    return batches


def micro_batches(stages: int, num_tokens: int, device_type: str) -> int:
    """Micro-batches for a step of ``num_tokens`` tokens over ``stages`` stages: ``max(2, stages)``
    where each gets ``MIN_MICRO_BATCH_TOKENS`` tokens, fewer where they would not (one for a few
    decodes); ``MICRO_BATCHES_ENV`` when set."""
    text = os.environ.get(MICRO_BATCHES_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{MICRO_BATCHES_ENV} must be a whole number of at least 1, got {text!r}")
        return int(text)
    least = MIN_MICRO_BATCH_TOKENS.get(device_type, MIN_MICRO_BATCH_TOKENS["cuda"])
    return max(1, min(max(MIN_MICRO_BATCHES, stages), num_tokens // least))


# ---------------------------------------------------------------------------------- the runner
class StageRunner(ModelRunner):
    """A pipeline stage's model runner: its layers' KV cache (block copies and all, as the model
    runner's), and each step's micro-batches run through its stage.

    On rank 0 ``execute`` works as on one rank: its forward pass runs stage 0 over the step's
    micro-batches (sending each one on as it is done) and its logits are those the last stage
    sends back, in the order of the sampling rows. The other ranks run each plan with
    ``run_plan``."""

    takes_interrupts = False

    def __init__(self, model: StageModel, info: ModelInfo, scheduler_config: SchedulerConfig,
                 device: torch.device | str, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 group: PipelineGroup | None = None) -> None:
        """``info``: the whole model's (this stage's KV cache is sized from its own layers)."""
        if group is None or not isinstance(model, StageModel):
            raise ValueError("a pipeline stage runs a stage of the model within its pipeline group")
        super().__init__(model, dataclasses.replace(info, num_layers=model.stage.num_layers), scheduler_config,
                         device, dtype, kv_cache_dtype=kv_cache_dtype, group=group)
        self.vocab_size, self.hidden_size = info.vocab_size, info.hidden_size
        # Rank 0: the micro-batches of the step whose logits are still to come.
        self._in_flight: list[MicroBatch] = []
        # Steps run, by how many micro-batches they were cut into.
        self.steps_by_micro_batches: Counter[int] = Counter()

    def _forward(self, plan: StepPlan) -> tuple[None, float]:
        """Rank 0: the block copies, then stage 0 over the step's micro-batches; the hidden states
        stay with the stages (``_logits`` receives the last stage's logits)."""
        self._copy_blocks(plan)
        t1 = time.perf_counter()
        self._in_flight = self._run_stage(plan)
        return None, t1

    def _logits(self, hidden: None, sample_rows: list[int]) -> torch.Tensor:
        """Rank 0: the sampling rows' logits ``[B, vocab]``, from the last stage, micro-batch by
        micro-batch (their sampling rows are the step's, in order)."""
        batches, self._in_flight = self._in_flight, []
        parts = [self.group.recv_logits(len(mb.sample_rows), self.vocab_size, self.dtype)
                 for mb in batches if mb.sample_rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run_plan(self, plan: StepPlan) -> None:
        """A rank other than 0: its stage's part of one step."""
        self._copy_blocks(plan)
        if plan.query_lens:
            self._run_stage(plan)

    def _run_stage(self, plan: StepPlan) -> list[MicroBatch]:
        """This stage over the step's micro-batches, in order: the first stage from the token ids,
        the others from the residual stream the stage before sends; each result sent on (the last
        stage: the sampling rows' logits, to rank 0)."""
        group, stage = self.group, self.model.stage
        group.wait_sends()  # the last step's sends are taken before this step's buffers go out
        count = micro_batches(group.num_stages, sum(plan.query_lens), self.device.type)
        batches = split_micro_batches(plan, count)
        self.steps_by_micro_batches[len(batches)] += 1
        for n, mb in enumerate(batches):
            metadata = build_attention_metadata(
                plan.query_lens[mb.requests], plan.seq_lens[mb.requests], plan.block_tables[mb.requests],
                self.block_size, self.num_queries_per_kv, device=self.device, workspace=self.workspace,
            )
            if stage.first:
                inputs = torch.tensor(plan.input_ids[mb.rows[0]:mb.rows[1]], dtype=torch.int64).to(self.device)
            else:
                inputs = group.recv_hidden(mb.num_rows, self.hidden_size, self.dtype)
            hidden = self.model(inputs, metadata.positions, self.kv_caches, metadata)
            if not stage.last:
                group.send_hidden(hidden)
            elif mb.sample_rows:
                self._send_logits(hidden, mb.sample_rows)
            if n == 0 and group.global_rank != 0:
                faults.hit(f"pp.stage_step.{stage.index}")
        return batches

    def _send_logits(self, hidden: torch.Tensor, rows: list[int]) -> None:
        """The last stage: the LM head on a micro-batch's sampling rows, the vocabulary slices of a
        tensor-parallel stage gathered, sent to rank 0."""
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        if self.model.shard is not None:
            logits = self.group.gather_logits(logits, self.model.shard, self.vocab_size)
        if logits is not None:
            self.group.send_logits(logits)


__all__ = ["MICRO_BATCHES_ENV", "MIN_MICRO_BATCHES", "MicroBatch", "PipelineGroup", "StageRunner", "join_pipeline",
           "micro_batches", "split_micro_batches"]
