"""The model runner: owns the paged KV cache tensors and turns one ``SchedulerOutput`` into a
``ModelRunnerOutput`` (sampled tokens, logprobs, phase times).

Per step it runs the scheduled block copies (swap preemption), packs the new tokens of every
scheduled request into one flat batch (no padding), builds the attention metadata (positions,
slot mapping, block tables) and the sampling tensors once, runs the model under
``torch.inference_mode()``, puts only the rows that sample through the LM head, samples, and
brings the results back with a single device-to-host copy.

A request with proposed tokens (speculative decoding) samples at its last known token and at
each proposal, with the randomness of each row keyed by the position it samples, exactly as
if the tokens had come one step at a time; the proposals are kept up to the first one that
differs from what was sampled before it (``accept_proposals``). With a layer-skip draft
(``draft_layers``, the ``self`` proposer, workers/engine/self_proposer.py) or a draft model
(``draft_model``, the ``draft`` proposer, workers/engine/draft_proposer.py, over a second KV cache
with the same block ids) the runner first computes the proposals themselves, after the block
copies and before the verification pass.

With tensor parallelism (``workers/engine/parallel.py``) the runner of each rank holds that rank's shard of
the model and its part of the KV cache. Rank 0's ``execute`` packs the step into a
``StepPlan`` (plain data), sends it to the other ranks, and runs its own part; the other ranks run the same
plan through ``run_plan``. The LM head's vocabulary slices are gathered on rank 0, which alone
samples. Without a group none of this runs.
"""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch

from mqinfer.kernels import native
from mqinfer.kernels.attention import AttentionWorkspace, build_attention_metadata
from mqinfer.kernels.kv_quant import SCALE_DTYPE, LayerKVCache, kv_storage_dtype
from mqinfer.kernels.sampling import SamplingTensors, accept_proposals, compute_logprobs, sample
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import ScheduledRequest, SchedulerOutput
from mqinfer.scheduler.request import EngineRequest
from mqinfer.workers.engine.decode_graphs import DecodeGraphs
from mqinfer.workers.engine.draft_proposer import ModelDraft
from mqinfer.workers.engine.loader import ModelInfo, resolve_dtype
from mqinfer.workers.engine.logits_processors import LogitsProcessors
from mqinfer.workers.engine.models import LlamaForCausalLM
from mqinfer.workers.engine.parallel import Group, StepPlan
from mqinfer.workers.engine.self_proposer import LayerSkipDraft
from mqinfer.workers.engine.structured import StepMasks
from mqinfer.workers.engine.swap import HostKVCache


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top_token_ids": self.top_token_ids,
            "top_logprobs": self.top_logprobs,
        }


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one ``execute()`` produced, aligned with ``SchedulerOutput.scheduled``."""

    # The sampled token per scheduled request; None where the request sampled nothing (a prompt
    # chunk short of the prompt's end). For a request with proposed tokens: the one sampled after
    # its accepted proposals (at the first rejected one, or after the last).
    sampled_token_ids: list[int | None] = field(default_factory=list)
    # Per scheduled request, how many of its proposed tokens are accepted; None as a whole when no
    # request in the step had proposals.
    num_accepted: list[int] | None = None
    # Per scheduled request: where it sampled and asked for them, the logprobs of each token it
    # emits (its accepted proposals, then its sampled token), else None. None as a whole when no
    # request in the step asked.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Seconds in (prepare inputs and block copies, forward incl. LM head, sample); on CUDA the
    # split is only indicative (kernels run asynchronously).
    phase_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # Of the forward seconds, those the draft spent proposing (``self``, ``draft``): one forward
    # per proposal depth, whatever the batch, a cost the speculation policy weighs apart (a draft
    # model's catch-up over tokens it has not run yet is counted in it too).
    draft_seconds: float = 0.0


class ModelRunner:
    # Whether a step's forward pass can stop between layers (a pipeline's stages cannot: the
    # other stages' processes run their layers of the step on their own).
    takes_interrupts = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        info: ModelInfo,
        scheduler_config: SchedulerConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        group: Group | None = None,
        draft_layers: int | None = None,
        draft_model: tuple[LlamaForCausalLM, ModelInfo] | None = None,
    ) -> None:
        """``group``: the tensor-parallel group when ``model`` is one rank's shard; the KV cache
        then holds that rank's KV heads only, and ``execute`` (rank 0) sends each step's plan to
        the other ranks, which call ``run_plan``. ``draft_layers`` (self-speculation) and
        ``draft_model`` (a draft checkpoint and its info) choose the draft that fills in
        placeholder proposals; at most one of them."""
        self.model = model
        self.info = info
        self.config = scheduler_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = scheduler_config.block_size
        self.group = group
        shard = model.shard
        num_heads, num_kv_heads = info.num_heads, info.num_kv_heads
        if shard is not None:
            num_heads, num_kv_heads = shard.q_heads[1] - shard.q_heads[0], shard.kv_heads[1] - shard.kv_heads[0]
            if group is None:
                raise ValueError("a model shard runs only within its tensor-parallel group")
            model.reduce = group.all_reduce
        shape = (scheduler_config.num_kv_blocks, self.block_size, num_kv_heads, info.head_dim)
        self._buffers: list[mmap.mmap] = []
        # K and V in the model's dtype (auto), or 8-bit with a bfloat16 scale per (slot, KV head).
        self.kv_cache_dtype = kv_cache_dtype
        kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.kv_caches = [self._layer_cache(shape, kv_dtype, kv_cache_dtype != "auto") for _ in range(info.num_layers)]
        # Host-memory blocks for swap preemption; pinned on CUDA so the copies are async DMA.
        self.host_cache: HostKVCache | None = None
        if scheduler_config.preemption_mode == "swap":
            self.host_cache = HostKVCache(
                scheduler_config.num_swap_blocks, info.num_layers, shape[1:], kv_dtype,
                pin_memory=self.device.type == "cuda", quantized=kv_cache_dtype != "auto",
            )
        self.workspace = AttentionWorkspace()
        self.num_queries_per_kv = num_heads // num_kv_heads
        # Decode-only steps over static buffers (CUDA graphs), when the engine sets them up
        # (workers/engine/decode_graphs.py); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        model.rotary.extend(scheduler_config.max_model_len)
        # The self proposer's draft: the model's first draft_layers layers over this KV cache.
        # The draft proposer's: a second model over a KV cache of its own, with the same blocks.
        self.draft: LayerSkipDraft | ModelDraft | None = None
        if draft_layers is not None and draft_model is not None:
            raise ValueError("a model runner takes draft_layers or draft_model, not both")
        if draft_layers is not None:
            self.draft = LayerSkipDraft(model, self.kv_caches, draft_layers, self.block_size,
                                        self.num_queries_per_kv, self.device, self.workspace)
        elif draft_model is not None:
            if group is not None:
                raise ValueError("a draft model runs on one rank only (not tensor parallel)")
            dmodel, dinfo = draft_model
            dshape = (scheduler_config.num_kv_blocks, self.block_size, dinfo.num_kv_heads, dinfo.head_dim)
            dcaches = [self._layer_cache(dshape, kv_storage_dtype(kv_cache_dtype, resolve_dtype(dinfo.dtype)),
                                         kv_cache_dtype != "auto") for _ in range(dinfo.num_layers)]
            dmodel.rotary.extend(scheduler_config.max_model_len)
            self.draft = ModelDraft(dmodel, dinfo, dcaches, self.block_size, self.device,
                                    scheduler_config.max_num_batched_tokens)

    def _layer_cache(self, shape: tuple[int, ...], dtype: torch.dtype, quantized: bool) -> LayerKVCache:
        if not quantized:
            return LayerKVCache(self._zeroed(shape, dtype), self._zeroed(shape, dtype))
        return LayerKVCache(self._zeroed(shape, dtype), self._zeroed(shape, dtype),
                            self._zeroed(shape[:3], SCALE_DTYPE), self._zeroed(shape[:3], SCALE_DTYPE))

    def _zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled cache tensor.

        Zeroed, not empty: attention reads padded (masked) slots too, and a NaN there would
        leak through the zero attention weight (0 * NaN = NaN). On CPU the memory comes from
        an anonymous mapping, which the kernel hands out zeroed and commits page by page as
        blocks are first written: start-up does not pay for zeroing gigabytes, and a cache
        sized for the worst case costs only what is used. The same holds for an 8-bit cache's
        scales: a zero scale reads back as zero.
        """
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buffer = mmap.mmap(-1, nbytes)
        self._buffers.append(buffer)  # the tensor borrows this memory; keep it alive
        return torch.frombuffer(buffer, dtype=dtype).view(shape)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache, every layer's K, V and (8-bit) scales (a draft model's
        cache not included: ``draft.kv_cache_bytes``)."""
        return sum(cache.nbytes for cache in self.kv_caches)

    @torch.inference_mode()
    def forward_sequence(self, token_ids: list[int]) -> torch.Tensor:
        """The final hidden states ``[n, hidden]`` of one sequence run as a single prefill into KV
        blocks 0, 1, ... (calibration and quality measurements: only while no request holds
        blocks, for at most ``num_kv_blocks * block_size`` tokens)."""
        if self.group is not None:
            raise ValueError("forward_sequence runs on one rank only (not tensor parallel)")
        n = len(token_ids)
        blocks = list(range(-(-n // self.block_size)))
        if not n or len(blocks) > self.config.num_kv_blocks:
            raise ValueError(f"{n} tokens need 1 to {self.config.num_kv_blocks} KV blocks of {self.block_size}")
        metadata = build_attention_metadata([n], [n], [blocks], self.block_size, self.num_queries_per_kv,
                                            device=self.device, workspace=self.workspace)
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        return self.model(ids, metadata.positions, self.kv_caches, metadata)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, grammar_masks: StepMasks | None = None, *,
                processors: LogitsProcessors | None = None,
                interrupt: Callable[[], bool] | None = None) -> ModelRunnerOutput:
        """Run one step (``_execute``), the kernel switches read once for all of it."""
        with native.switches_held():
            return self._execute(output, grammar_masks, processors=processors, interrupt=interrupt)

    def _execute(self, output: SchedulerOutput, grammar_masks: StepMasks | None = None, *,
                 processors: LogitsProcessors | None = None,
                 interrupt: Callable[[], bool] | None = None) -> ModelRunnerOutput:
        """Run one step: the block copies, then the forward pass and sampling for ``output.scheduled``.

        ``processors``: the penalties, logit biases and ``min_tokens`` of the requests that ask for
        them, applied to their rows first; ``grammar_masks`` (structured output): the token masks of
        the constrained requests, applied to their rows after that. Logprobs stay those of the raw
        distribution.

        ``interrupt``: asked before each decoder layer of an eager forward pass on one rank;
        when it answers true the pass stops and :class:`StepInterrupted` propagates (the block
        copies are done; no token is sampled). Ignored with tensor-parallel ranks, a draft, or a
        step that runs through decode graphs."""
        t0 = time.perf_counter()
        scheduled = output.scheduled
        plan = StepPlan(swap_out=output.swap_out, swap_in=output.swap_in)
        # The draft's forwards count as forward time.
        draft_s = self._propose(plan, scheduled) if self.draft is not None and scheduled else 0.0
        held = processors.request_ids if processors is not None else None
        sample_of, sample_positions, processed_rows, any_spec = self._pack(plan, scheduled, held)
        if self.group is not None:
            self._send_plan(plan)
        if not scheduled:
            self._copy_blocks(plan)
            return ModelRunnerOutput(phase_seconds=(time.perf_counter() - t0, 0.0, 0.0))
        if interrupt is not None and (self.group is not None or self.draft is not None or not self.takes_interrupts):
            interrupt = None
        hidden, t1 = self._forward(plan) if interrupt is None else self._forward(plan, interrupt)
        result = ModelRunnerOutput(sampled_token_ids=[None] * len(scheduled), draft_seconds=draft_s)
        if not plan.sample_rows:
            result.phase_seconds = (t1 - t0 - draft_s, time.perf_counter() - t1 + draft_s, 0.0)
            return result

        logits = self._logits(hidden, plan.sample_rows)
        t2 = time.perf_counter()
        requests = [scheduled[i].request for i in sample_of]
        token_ids = self._sample(logits, requests, sample_of, sample_positions, processed_rows, processors,
                                 grammar_masks)
        tokens = token_ids.tolist()
        if not any_spec:
            sampled = result.sampled_token_ids
            for i, token in zip(sample_of, tokens):
                sampled[i] = token
            want = [j for j, r in enumerate(requests) if r.sampling.logprobs is not None]
        else:
            emits = self._accept(result, scheduled, sample_of, tokens)
            want = [j for j, r in enumerate(requests) if r.sampling.logprobs is not None and emits[j]]
        if want:
            _record_logprobs(result, logits, token_ids, requests, sample_of, want)
        result.phase_seconds = (t1 - t0 - draft_s, t2 - t1 + draft_s, time.perf_counter() - t2)
        return result

    def _propose(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> float:
        """Run the step's block copies, then let the draft fill in the proposals: its seconds.

        The draft writes into KV blocks, so this step's block copies go first (a block swapped out
        may be given to another request in this same step); the plan keeps none for later."""
        self._copy_blocks(plan)
        plan.swap_out, plan.swap_in = [], []
        td = time.perf_counter()
        self.draft.fill(scheduled)
        return time.perf_counter() - td

    @staticmethod
    def _pack(plan: StepPlan, scheduled: list[ScheduledRequest],
              held: Container[str] | None) -> tuple[list[int], list[int], list[int], bool]:
        """Pack the new tokens of every scheduled request into ``plan`` (one flat batch, with its
        query and sequence lengths, block tables and sampling rows).

        The packed rows that sample are the last known token of each sampling request, then each of
        its proposed tokens (speculative decoding). Returns, per sampling row, the index into
        ``scheduled`` of its request and the position of the token it samples; the sampling rows of
        the requests in ``held`` (those whose logits are processed, found in this one pass so that
        the other requests cost nothing more); and whether any request has proposals."""
        input_ids = plan.input_ids
        query_lens = plan.query_lens
        seq_lens = plan.seq_lens
        tables = plan.block_tables
        sample_rows = plan.sample_rows
        sample_of: list[int] = []  # index into `scheduled` of each sampling row
        sample_positions: list[int] = []  # position of the token each row samples
        processed_rows: list[int] = []
        any_spec = False
        row = 0
        for i, sr in enumerate(scheduled):
            request, n = sr.request, sr.num_new_tokens
            c = request.num_computed_tokens
            spec = sr.spec_token_ids
            if spec:
                any_spec = True
                input_ids.extend(request.all_token_ids[c : c + n - len(spec)])
                input_ids.extend(spec)
            elif n == 1:
                input_ids.append(request.all_token_ids[c])
            else:
                input_ids.extend(request.all_token_ids[c : c + n])
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(request.block_ids)
            row += n
            if c + n - len(spec) == request.num_tokens:
                if held is not None and request.request_id in held:
                    processed_rows.extend(range(len(sample_of), len(sample_of) + len(spec) + 1))
                for j in range(len(spec), -1, -1):
                    sample_rows.append(row - 1 - j)
                    sample_of.append(i)
                    sample_positions.append(request.num_tokens + len(spec) - j)
        return sample_of, sample_positions, processed_rows, any_spec

    def _sample(self, logits: torch.Tensor, requests: list[EngineRequest], sample_of: list[int],
                sample_positions: list[int], processed_rows: list[int], processors: LogitsProcessors | None,
                grammar_masks: StepMasks | None) -> torch.Tensor:
        """One token per sampling row (``requests``: each row's request), after the logits
        processors and the grammar masks; ``logits`` itself stays raw where a request wants
        logprobs."""
        params = SamplingTensors.from_lists(
            temperature=[r.sampling.temperature for r in requests],
            top_k=[r.sampling.top_k for r in requests],
            top_p=[r.sampling.top_p for r in requests],
            seeds=[r.sampling_seed for r in requests],
            positions=sample_positions,
            device=self.device,
        )
        processed = logits
        if processed_rows or grammar_masks is not None:
            # Changed in place unless a request wants logprobs, which come from the raw logits.
            keep_raw = any(r.sampling.logprobs is not None for r in requests)
            if processed_rows:
                processed = processors.apply(logits, processed_rows, requests, sample_positions, keep_raw)
            if grammar_masks is not None:
                processed = grammar_masks.apply(processed, sample_of, in_place=processed is not logits or not keep_raw)
        return sample(processed, params)

    @staticmethod
    def _accept(result: ModelRunnerOutput, scheduled: list[ScheduledRequest], sample_of: list[int],
                tokens: list[int]) -> list[bool]:
        """With proposals: keep each request's proposals up to the first that differs from the token
        sampled before it, and the token sampled after them, into ``result``. Returns, per sampling
        row, whether it emits a token (the accepted proposals' rows and the one after)."""
        sampled = result.sampled_token_ids
        emits = [False] * len(sample_of)
        result.num_accepted = [0] * len(scheduled)
        j = 0
        while j < len(sample_of):
            i = sample_of[j]
            spec = scheduled[i].spec_token_ids
            accepted = accept_proposals(spec, tokens[j : j + len(spec) + 1]) if spec else 0
            result.num_accepted[i] = accepted
            sampled[i] = tokens[j + accepted]
            emits[j : j + accepted + 1] = [True] * (accepted + 1)
            j += len(spec) + 1
        return emits

    def _copy_blocks(self, plan: StepPlan) -> None:
        if plan.swap_out or plan.swap_in:
            # Out before in: a block swapped in may be one another request just gave up.
            self.host_cache.swap_out(self.kv_caches, plan.swap_out)
            self.host_cache.swap_in(self.kv_caches, plan.swap_in)

    def _forward(self, plan: StepPlan, interrupt: Callable[[], bool] | None = None) -> tuple[torch.Tensor, float]:
        """The block copies, then the model over the plan's packed tokens: (hidden states, the
        time the inputs were ready); ``interrupt`` as in ``execute`` (eager passes only)."""
        self._copy_blocks(plan)
        graphs = self.decode_graphs
        if graphs is not None and graphs.accepts(plan.query_lens, plan.block_tables):
            return graphs.run(plan.input_ids, plan.seq_lens, plan.block_tables), time.perf_counter()
        metadata = build_attention_metadata(
            plan.query_lens, plan.seq_lens, plan.block_tables, self.block_size, self.num_queries_per_kv,
            device=self.device, workspace=self.workspace,
        )
        ids = torch.tensor(plan.input_ids, dtype=torch.int64).to(self.device)
        t1 = time.perf_counter()
        if interrupt is None:
            return self.model(ids, metadata.positions, self.kv_caches, metadata), t1
        self.model.interrupt = interrupt
        try:
            return self.model(ids, metadata.positions, self.kv_caches, metadata), t1
        finally:
            self.model.interrupt = None

    def _logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor | None:
        """The LM head on the sampling rows: ``[B, vocab]``; tensor parallel, each rank's vocabulary
        slice gathered on rank 0 (None on the other ranks)."""
        rows = torch.tensor(sample_rows, dtype=torch.int64).to(self.device)
        # Logits stay in the model's dtype: greedy rows need only the argmax, and sample() and
        # compute_logprobs() convert what they need to float32 themselves.
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        if self.group is None:
            return logits
        return self.group.gather_logits(logits, self.model.shard, self.info.vocab_size)

    def _send_plan(self, plan: StepPlan) -> None:
        """Rank 0: hand the step to the other ranks (``RankFailure`` when one is gone)."""
        self.group.check_alive()
        self.group.send_plan(plan)

    def run_plan(self, plan: StepPlan) -> None:
        """A rank other than 0: its part of one step (block copies, the forward pass with its
        all-reduces, its logits sent to rank 0)."""
        if not plan.query_lens:
            self._copy_blocks(plan)
            return
        hidden, _ = self._forward(plan)
        if plan.sample_rows:
            self._logits(hidden, plan.sample_rows)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, requests: list[EngineRequest],
              rows: list[int]) -> list[TokenLogprobs]:
    """The sampled token's logprob and each request's own number of top alternatives, for the
    given ``rows`` of ``logits`` (one per request in ``requests``)."""
    k = max(r.sampling.logprobs for r in requests)
    sel = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    picked = token_ids.index_select(0, sel)
    lp = compute_logprobs(logits.index_select(0, sel), picked, k)
    chosen = lp.sampled.tolist()
    top_ids = lp.top_ids.tolist()
    top_lps = lp.top_logprobs.tolist()
    return [
        TokenLogprobs(token_id=token, logprob=chosen[n], top_token_ids=top_ids[n][:kn], top_logprobs=top_lps[n][:kn])
        for n, (token, kn) in enumerate(zip(picked.tolist(), (r.sampling.logprobs for r in requests)))
    ]


def _record_logprobs(result: ModelRunnerOutput, logits: torch.Tensor, token_ids: torch.Tensor,
                     requests: list[EngineRequest], sample_of: list[int], want: list[int]) -> None:
    """Put the logprobs of the sampling rows ``want`` into ``result``, in row order under each
    row's request (``requests`` and ``sample_of``: each row's request and its index in the step)."""
    result.logprobs = [None] * len(result.sampled_token_ids)
    for j, entry in zip(want, _logprobs(logits, token_ids, [requests[j] for j in want], want)):
        entries = result.logprobs[sample_of[j]]
        if entries is None:
            entries = result.logprobs[sample_of[j]] = []
        entries.append(entry)
