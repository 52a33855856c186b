"""The engine the worker drives: requests in, one step at a time, outputs and billable work out.

Owns ``LLMEngine`` and the records a step returns (``StepResult`` with a ``RequestOutput`` per
touched request and a ``StepWork`` per scheduled sequence, for cost attribution). One step is::

    scheduler.schedule() -> runner.execute() -> postprocess (outputs.py):
    scheduler.update_from_output(), detokenize, match stop strings, one output per touched request

A step may be *interrupted*: ``step(interrupt=...)`` passes a callable that the model asks before
each decoder layer, and when it answers true the step is given up and reported with
``StepResult.interrupted``. The worker does this when a request with latency targets arrives while
a long bulk step runs (workers/queue/arrivals.py), so that the request does not wait for the whole
step. Giving up is cheap to make correct: the scheduler advances a request only when a step's
tokens come back (``update_from_output``) and puts a block into the prefix cache only once the
tokens that fill it were computed by an earlier step, so an interrupted step leaves each request
where it was, its new blocks held for the next step, which computes the same tokens again. Steps
with speculative proposals or grammar masks are not interruptible, and one that moves an
interactive request along is given up only in the first half of its layers and not after two in a
row were (``_interruptible``).

Its parts live beside it in ``workers/engine/``: building it (model, KV cache size, runner,
proposer, 8-bit weights) in ``startup.py``; the checks a request passes before it is queued
(``EngineInputError``) in ``inputs.py``; output processing, stop strings and the ``n`` choices of
a request in ``outputs.py``.

A request with a grammar (``SamplingParams.grammar``, structured output) also has its token
masks filled while the runner computes its logits, and its matcher advanced in postprocess
(``structured.py``). A request with penalties, a logit bias or ``min_tokens`` has its logits
processed before the masks (``logits_processors.py``). Each choice of a request with ``n`` > 1
samples with its own seed (:func:`~mqinfer.kernels.sampling.choice_seed`), so a choice's tokens do
not depend on the others or on the batch.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mqinfer.kernels.sampling import choice_seed
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.workers import devices
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine import startup
from mqinfer.workers.engine.decode_graphs import decode_graphs_wanted, enable_decode_graphs
from mqinfer.workers.engine.draft_proposer import check_draft_model
from mqinfer.workers.engine.inputs import EngineInputError, InputChecks
from mqinfer.workers.engine.outputs import OutputProcessor, RequestOutput, SpecStats, choice_id
from mqinfer.workers.engine.kv_tiers import attach_engine_tiers
from mqinfer.workers.engine.loader import ModelInfo, load_model
from mqinfer.workers.engine.logits_processors import LogitsProcessors
from mqinfer.workers.engine.model_runner import ModelRunnerOutput
from mqinfer.workers.engine.models.layers import StepInterrupted
from mqinfer.workers.engine.parallel import RankSettings, rank_parts
from mqinfer.workers.engine.prepared import save_prepared
from mqinfer.workers.engine.ranks import Leader
from mqinfer.workers.engine.structured import GrammarError, StructuredOutputs, default_mask_threads

log = logging.getLogger(__name__)

# How many steps that move interactive requests along may be given up in a row (``_interruptible``).
MAX_GIVE_UPS_IN_A_ROW = 2


@dataclass
class StepWork:
    """One scheduled sequence's share of a step, for cost attribution (``request_id`` is the
    sequence's: :func:`choice_id` of its request and choice)."""

    request_id: str
    num_tokens: int
    # Context length after this step's tokens.
    context_len: int
    # Prompt (or recomputed) tokens rather than a single decode token.
    is_prefill: bool
    # Tokens in this chunk whose KV had been computed before and was lost to a preemption.
    num_recomputed_tokens: int
    # Whether the request sampled a token this step (the LM head ran for it).
    sampled: bool = False
    # Proposed tokens among num_tokens (speculative decoding); the LM head ran for each of them too.
    num_spec_tokens: int = 0
    # Seconds this step (or a refused admission before it) spent copying the request's prefix up
    # from the KV tiers: billed to it alone.
    tier_load_s: float = 0.0



@dataclass
class StepResult:
    outputs: list[RequestOutput]
    work: list[StepWork]
    start: float
    end: float
    # Given up before its end (``LLMEngine.step``'s ``interrupt``): no token was computed; ``work``
    # says whose step it was, and they compute the same tokens again in a later step.
    interrupted: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        # One device per tensor-parallel rank; ValueError for one that does not exist.
        self.rank_devices = rank_devices = devices.engine_rank_devices(config)
        self.device = torch.device(rank_devices[0])
        tp = config.tensor_parallel_size
        ranks = tp * config.pipeline_parallel_size
        self.num_threads = threads = devices.cpu_threads(config.num_threads, ranks)
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
        # Tensor (and pipeline) parallel: the other ranks' processes, started now so that they load
        # their shards while this one loads its own. Closed if anything below fails.
        self.tensor_parallel: Leader | None = (
            Leader(rank_devices, pipeline=config.pipeline_parallel_size) if ranks > 1 else None)
        try:
            if self.tensor_parallel is not None:
                self.tensor_parallel.load(RankSettings(engine=config, num_threads=threads))
            self._start(config, clock)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        """Build the engine in named steps, timing each part of start-up (logged at the end)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        shard, stage = rank_parts(0, tp * pp, pp)
        timer = startup.StartupTimer()
        self.startup_seconds = timer.seconds
        self.model, self.info, self.tokenizer, prepared = startup.load(config, self.device, shard, stage)
        timer.lap("read prepared model" if prepared else "load model")
        max_len = self.max_model_len = startup.checked_max_len(config, self.info)
        # The draft proposer's model, loaded before the KV cache is sized (its weights take memory,
        # and its cache has a block for every block of the model's).
        draft: tuple[torch.nn.Module, ModelInfo] | None = None
        draft_block_bytes = 0
        if config.speculative == "draft":
            draft = load_model(config.draft_model, self.device, self.info.dtype)
            check_draft_model(draft[1], self.info, max_len)
            draft_block_bytes = draft[1].kv_bytes_per_token_as(config.kv_cache_dtype) * config.block_size
        num_blocks, num_swap_blocks = startup.size_kv(config, self.info, self.model, self.device, stage,
                                                             max_len, draft_block_bytes)
        self.scheduler_config = startup.scheduler_config_for(config, num_blocks, num_swap_blocks, max_len)
        group = None
        if self.tensor_parallel is not None:
            self.tensor_parallel.ready(self.scheduler_config)
            group = self.tensor_parallel.group
        self.runner = startup.make_runner(config, self.info, self.model, self.device, self.scheduler_config,
                                                 stage, draft, group)
        timer.lap("runner and KV cache")
        self.proposer = startup.make_proposer(config, self.runner, draft)
        self.spec_stats = SpecStats(config.speculative)
        # When the last step that ran a model ended (perf_counter), while requests were left to run.
        self._last_step_end: float | None = None
        self.scheduler = Scheduler(self.scheduler_config, clock=clock, proposer=self.proposer)
        # KV tiers below the device cache (host memory, disk, a shared directory), if configured.
        self.kv_tiers = attach_engine_tiers(config, self.info, self.model, self.runner, self.scheduler)
        timer.lap("other")
        if not prepared:
            if config.quantization != "none":
                calibration_len = min(512, max_len, num_blocks * config.block_size)
                startup.quantize(config, self.model, self.tokenizer, self.runner, calibration_len)
                timer.lap("quantize")
            if shard is None and stage is None and save_prepared(config, self.device, self.model, self.info,
                                                                 self.tokenizer):
                timer.lap("keep prepared model")
        if self.device.type == "cpu" and hasattr(self.model, "pack_weights") and self.model.pack_weights():
            timer.lap("pack weights")
        if decode_graphs_wanted(config, self.device) is None:
            enable_decode_graphs(self)
            timer.lap("decode graphs")
        self._init_requests(config)
        startup.log_ready(config, self.info, self.model, self.device, self.runner, num_blocks, max_len)
        timer.lap("other")
        log.info("engine start-up %.2fs: %s", sum(timer.seconds.values()),
                 ", ".join(f"{part} {seconds:.2f}s" for part, seconds in timer.seconds.items()))

    def _init_requests(self, config: EngineConfig) -> None:
        """Stop tokens, structured output, logits processors and the per-request bookkeeping."""
        info = self.info
        self.eos_token_ids = frozenset(info.eos_token_ids) or (
            frozenset([self.tokenizer.eos_token_id])
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else frozenset()
        )
        # Constrained requests' matchers and token masks (structured output); a model without a
        # tokenizer cannot take grammars.
        self.structured: StructuredOutputs | None = None
        if self.tokenizer is not None:
            self.structured = StructuredOutputs(self.tokenizer, info.vocab_size, self.eos_token_ids,
                                                mask_threads=default_mask_threads(self.device))
        # Requests whose logits are processed before sampling (penalties, logit_bias, min_tokens).
        self.processors = LogitsProcessors(info.vocab_size, self.device)
        self._rng = random.Random(config.seed)
        self.inputs = InputChecks(info, self.tokenizer, self.max_model_len)
        # Unfinished sequences, choice groups, and what each step's tokens do to them.
        self.outputs = OutputProcessor(self.scheduler, self.structured, self.processors, self.proposer,
                                       self.spec_stats, self.tokenizer, self.clock)
        # Seconds spent in each part of step() since start (perf_counter), for profiling:
        # schedule, prepare (inputs and metadata), forward, sample, postprocess.
        self.phase_seconds: dict[str, float] = dict.fromkeys(
            ("schedule", "prepare", "forward", "sample", "postprocess"), 0.0
        )
        self.num_steps = 0
        # Steps given up for an arriving interactive request (``step``'s ``interrupt``).
        self.num_interrupted = 0
        # Steps given up since the last one that ran: a step that moves an interactive request
        # along is given up at most MAX_GIVE_UPS_IN_A_ROW times in a row.
        self._given_up_in_a_row = 0

    @property
    def device_share(self) -> float:
        """Priced devices the engine's steps occupy: on CUDA one per rank (T x P of them with tensor
        and pipeline parallelism); on a CPU (the machine is one device) its ranks' threads over the
        usable cores, at most 1."""
        ranks = self.config.tensor_parallel_size * self.config.pipeline_parallel_size
        if self.device.type == "cuda":
            return float(ranks)
        return devices.cpu_device_share(self.num_threads, ranks)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for one rank) and the mask thread."""
        structured = getattr(self, "structured", None)
        if structured is not None:
            structured.close()
        leader, self.tensor_parallel = getattr(self, "tensor_parallel", None), None
        if leader is not None:
            leader.close()
        tiers, self.kv_tiers = getattr(self, "kv_tiers", None), None
        if tiers is not None:
            tiers.close()

    # -- requests in --------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                      messages: list[dict] | None) -> list[int]:
        """Token ids for exactly one of a text prompt, token ids, or chat messages
        (``EngineInputError`` for a prompt this model cannot take)."""
        return self.inputs.encode_prompt(prompt, prompt_token_ids, messages)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    deadline: float | None = None, tenant: str = "default", share_group: str | None = None,
                    speculative: bool = True, cache_salt: str | None = None, slo_ttft_ms: int | None = None,
                    slo_tpot_ms: int | None = None) -> None:
        """Queue a request (with ``sampling.n`` choices); ``speculative`` False keeps it out of
        speculative decoding, as do a grammar (``sampling.grammar``), which must compile (else
        ``invalid_response_format``), and a presence, frequency or repetition penalty.
        ``share_group`` is the scheduler's fair-share group (None: the tenant's); the tenant and
        ``cache_salt`` choose the prefix-cache partition (``--prefix-cache-scope``); ``slo_*_ms``
        are its latency targets (scheduler/slo.py)."""
        n = sampling.n
        seq_ids = [choice_id(request_id, i) for i in range(n)]
        for rid in seq_ids:
            if self.outputs.knows(rid) or self.scheduler.get_request(rid) is not None:
                raise ValueError(f"request {rid!r} is already in the engine")
        ids = list(prompt_token_ids)
        self.inputs.check_prompt(ids)
        self.inputs.check_sampling(sampling)
        if sampling.grammar is not None:
            if self.structured is None:
                raise EngineInputError(
                    "invalid_response_format",
                    f"response_format: model {self.info.name} has no tokenizer to build token masks from"
                    f" - at `{sampling.grammar.path}`",
                )
            speculative = False  # proposals would each need a mask of their own
        if sampling.penalised:
            speculative = False  # a proposal's row would need the counts with the proposals before it
        arrival = self.clock() if arrival_time is None else arrival_time
        choices = [
            EngineRequest(
                request_id=rid, prompt_token_ids=ids, sampling=sampling, eos_token_ids=self.eos_token_ids,
                arrival_time=arrival, priority=priority, deadline=deadline, max_model_len=self.max_model_len,
                tenant=tenant, share_group=share_group, speculative=speculative, cache_salt=cache_salt,
                slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                sampling_seed=choice_seed(sampling.seed, i) if sampling.seed is not None else self._rng.getrandbits(63),
            )
            for i, rid in enumerate(seq_ids)
        ]
        if sampling.grammar is not None:
            try:
                for request in choices:
                    self.structured.add(request)
            except GrammarError as exc:
                for request in choices:
                    self.structured.forget(request.request_id)
                raise EngineInputError("invalid_response_format", exc.message) from None
        # Without a prefix cache there is nothing to wait for: every choice computes the prompt.
        self.outputs.add(request_id, choices, share_prompt=self.scheduler_config.enable_prefix_caching)

    def cancel(self, request_id: str) -> None:
        """End a request (all its choices) as cancelled (their blocks are freed now; the next step
        reports them)."""
        self.outputs.cancel(request_id)

    def withdraw(self, request_ids: list[str]) -> None:
        """End requests (all their choices) without reporting them in any step (for work handed back
        to the stream, whose row another worker will write)."""
        self.outputs.withdraw(request_ids)

    def holds(self, request_id: str) -> bool:
        """Whether any choice of the request is still in the engine (waiting, running, or held back
        until the first has computed the prompt)."""
        return self.outputs.holds(request_id)

    def unstarted_request_ids(self) -> list[str]:
        """Requests none of whose choices has run yet (the scheduler's unstarted requests, less the
        choices of requests whose first choice has run)."""
        return [rid for rid in self.scheduler.unstarted_request_ids() if rid not in self.outputs.choice_of]

    def has_unfinished(self) -> bool:
        outputs = self.outputs
        return self.scheduler.has_unfinished_requests() or bool(outputs.ended_outside) or bool(outputs.choices)

    def free_capacity(self) -> int:
        s = self.scheduler
        return max(0, self.scheduler_config.max_num_seqs - s.num_running - s.num_waiting - self.outputs.num_held())

    # -- what the queue side reads (the scheduler's figures, without reaching into it) ----------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the scheduler (none while it has room for them)."""
        return self.scheduler.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv_usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.prefix_cache_hits

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    def owned_blocks(self, request_id: str) -> list:
        """The KV blocks a running request holds (its share of the cache, for billing)."""
        return self.scheduler.owned_blocks(request_id)

    # -- one step -----------------------------------------------------------------------------
    def step(self, interrupt: Callable[[], bool] | None = None) -> StepResult:
        """Schedule, run the model, postprocess; each part's time is added to ``phase_seconds``.

        ``interrupt``: asked before each decoder layer when the step is interruptible (module
        docstring); when it answers true the step is given up and its result says so."""
        start = self.clock()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        work = self._work(scheduler_output)
        t1 = time.perf_counter()
        # Constrained requests' token masks, filled in the background while the model runs.
        masks = self.structured.begin_step(scheduler_output.scheduled) if self.structured is not None else None
        processors = self.processors if len(self.processors) else None
        if interrupt is not None:
            interrupt = self._interruptible(scheduler_output, masks, self._given_up_in_a_row, interrupt,
                                            self.info.num_layers)
        try:
            # A step may hold only block copies (swap preemption); they must still happen now.
            if scheduler_output.is_empty:
                ran = None
            elif interrupt is not None:
                ran = self.runner.execute(scheduler_output, processors=processors, interrupt=interrupt)
            elif masks is None and processors is None:
                ran = self.runner.execute(scheduler_output)
            else:
                ran = self.runner.execute(scheduler_output, masks, processors=processors)
        except StepInterrupted:
            return self._interrupted(scheduler_output, work, start, t0, t1)
        finally:
            if masks is not None:
                masks.wait()  # the matchers must not move while a mask is being filled
        self._given_up_in_a_row = 0
        t2 = time.perf_counter()
        if ran is not None and self.proposer is not None and scheduler_output.num_batched_tokens:
            # The speculation policy's measurements (only a speculating engine has a policy to feed).
            depth = 0
            if ran.draft_seconds > 0.0:
                depth = max(len(sr.spec_token_ids) for sr in scheduler_output.scheduled)
            self.scheduler.record_step_time(scheduler_output.num_batched_tokens, t2 - t1, ran.draft_seconds, depth)
        outputs = self.outputs.postprocess(scheduler_output, ran)
        if ran is not None:
            # The whole step, schedule to results, and the worker's time since the step before
            # (when it had work to step): what a running request waits for between its tokens.
            end = time.perf_counter()
            last = self._last_step_end
            self.scheduler.record_step(end - t0, t0 - last if last is not None else None)
            self._last_step_end = end if self.scheduler.has_unfinished_requests() else None
        self._account(t0, t1, t2, ran)
        return StepResult(outputs=outputs, work=work, start=start, end=self.clock())

    @staticmethod
    def _interruptible(scheduler_output: SchedulerOutput, masks, given_up_in_a_row: int,
                       interrupt: Callable[[], bool], num_layers: int) -> Callable[[], bool] | None:
        """The interrupt to ask during a step, or None when the step may not be given up: one with
        speculative proposals (their drafts already advanced) or grammar masks (filled in the
        background) runs to its end. A step that moves no interactive request along may be given
        up before any layer. One that does may be given up only before the second half of its
        layers, and not after MAX_GIVE_UPS_IN_A_ROW steps given up in a row.

        Giving up a step that holds interactive requests costs each of them the part of the step
        that ran, and saves the arriving request the rest of it: it waits for the next step either
        way, and both ride in it together. In the first half the arrival gains more than the
        running requests lose; later, waiting for the rest costs everyone less. Their TPOT target
        is a mean over their tokens (32 tokens: 20 ms of a step adds about 0.6 ms to it). Two in a
        row serve two requests that arrive close together (the second one's arrival gives up the
        step that carries the first one's prompt); no more, so that requests already running get
        a token at least every third step however fast interactive requests arrive."""
        if masks is not None:
            return None
        interactive = False
        for sr in scheduler_output.scheduled:
            if sr.spec_token_ids:
                return None
            interactive = interactive or sr.request.interactive
        if not interactive:
            return interrupt
        if given_up_in_a_row >= MAX_GIVE_UPS_IN_A_ROW:
            return None
        # Asked before each layer: the first answer is before layer 0.
        last_asked = max(num_layers // 2, 1)
        asked = 0

        def in_first_half() -> bool:
            nonlocal asked
            asked += 1
            return asked <= last_asked and interrupt()
        return in_first_half

    def _interrupted(self, scheduler_output: SchedulerOutput, work: list[StepWork], start: float,
                     t0: float, t1: float) -> StepResult:
        """Report a step given up in its forward pass: the requests it ended before running (an
        expired deadline, a rejection) still get their outputs; the scheduled ones stay as they
        were, and the step's time does not teach the step-time model."""
        self.scheduler.step_interrupted()
        self._given_up_in_a_row += 1
        t2 = time.perf_counter()
        outputs = self.outputs.postprocess(scheduler_output, None)
        self._last_step_end = time.perf_counter() if self.scheduler.has_unfinished_requests() else None
        self._account(t0, t1, t2, None, forward_s=t2 - t1)
        self.num_interrupted += 1
        return StepResult(outputs=outputs, work=work, start=start, end=self.clock(), interrupted=True)

    def _work(self, scheduler_output: SchedulerOutput) -> list[StepWork]:
        """Each scheduled request's share of the step, read before the model advances it."""
        work = []
        for sr in scheduler_output.scheduled:
            r, n = sr.request, sr.num_new_tokens
            s = len(sr.spec_token_ids)
            c = r.num_computed_tokens
            tracked = self.outputs.tracked[r.request_id]
            work.append(StepWork(
                request_id=r.request_id, num_tokens=n, context_len=c + n,
                is_prefill=not (n - s == 1 and c >= r.num_prompt_tokens),
                num_recomputed_tokens=max(0, min(c + n - s, tracked.high_water) - c),
                sampled=sr.needs_sample, num_spec_tokens=s, tier_load_s=r.tier_load_s,
            ))
            r.tier_load_s = 0.0
            # Only known tokens count as computed before: proposals are new each time.
            tracked.high_water = max(tracked.high_water, c + n - s)
        return work


    def _account(self, t0: float, t1: float, t2: float, ran: ModelRunnerOutput | None,
                 forward_s: float = 0.0) -> None:
        """Add this step's phase times: schedule [t0, t1], runner [t1, t2] (split by the runner's
        own marks; ``forward_s`` when the runner gave none, an interrupted step's), postprocess
        [t2, now]; the bookkeeping between them counts as schedule."""
        phases = self.phase_seconds
        runner = ran.phase_seconds if ran is not None else (0.0, forward_s, 0.0)
        phases["schedule"] += t1 - t0
        phases["prepare"] += runner[0]
        phases["forward"] += runner[1]
        phases["sample"] += runner[2]
        phases["postprocess"] += time.perf_counter() - t2 + max(0.0, (t2 - t1) - sum(runner))
        self.num_steps += 1


__all__ = ["LLMEngine", "StepResult", "StepWork"]
