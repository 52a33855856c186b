"""The engine the worker drives: requests in, one step at a time, outputs and billable work out.

Owns ``EngineConfig``, ``LLMEngine`` and the records a step returns (``StepResult`` with
``RequestOutput`` per touched request and ``StepWork`` per scheduled request, for cost
attribution). One step is::

    scheduler.schedule() -> runner.execute() -> postprocess: scheduler.update_from_output(),
    detokenize, match stop strings (-> scheduler.finish_requests), one output per touched request

A request with a grammar (``SamplingParams.grammar``, structured output) also has its token
masks filled while the runner computes its logits, and its matcher advanced in postprocess
(workers/structured.py). A request with penalties, a logit bias or ``min_tokens`` has its logits
processed before the masks (workers/logits_processors.py).

A request with ``n`` > 1 choices runs as n sequences: choice 0 under the request's id, choice i
under :func:`choice_id` (``<id>#<i>``). The other choices wait outside the scheduler until choice
0 has computed the prompt (or ended), and then join it: the prompt's full KV blocks are in the
prefix cache by then, so they take them as hits and compute only the prompt's last, partial block
themselves (without prefix caching they do not wait, and each computes the whole prompt). Each choice samples with its own
seed (:func:`~mqinfer.kernels.sampling.choice_seed`), so a choice's tokens do not depend on the
others or on the batch. Outputs carry the request's id and the choice's ``index``; ``StepWork``
carries the sequence's id (what the scheduler and the KV cache know).

Prompt checks that depend on the model (length, vocabulary, stop strings needing a
tokenizer) raise ``EngineInputError`` with a stable code, so the worker can write an error
row instead of failing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable

import torch

from mqinfer.kernels.sampling import choice_seed
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.request import EngineRequest, RequestStatus, SamplingParams
from mqinfer.scheduler.scheduler import Scheduler
from mqinfer.schemas import errors
from mqinfer.workers import devices
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.decode_graphs import decode_graphs_wanted, enable_decode_graphs
from mqinfer.workers.draft_proposer import DraftProposer, check_draft_model
from mqinfer.workers.kv_tiers import attach_engine_tiers
from mqinfer.workers.loader import TINY, ModelInfo, load_model, resolve_dtype
from mqinfer.workers.logits_processors import LogitsProcessors
from mqinfer.workers.model_runner import ModelRunner, ModelRunnerOutput
from mqinfer.workers.ngram_proposer import NgramProposer
from mqinfer.workers.parallel import RankSettings, rank_parts
from mqinfer.workers.ranks import Leader
from mqinfer.workers.prepared import cache_dir as prepared_cache_dir
from mqinfer.workers.prepared import load_prepared, save_prepared
from mqinfer.workers.pipeline import StageRunner
from mqinfer.workers.self_proposer import SelfProposer, resolve_draft_layers
from mqinfer.workers.structured import GrammarError, StructuredOutputs, default_mask_threads
from mqinfer.workers.models.quant import activation_ranges, calibration_token_windows, quantize_model, smooth
from mqinfer.workers.swap import num_swap_blocks_for
from mqinfer.workers.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# Default KV cache size on CPU when num_kv_blocks is not given: enough for max_num_seqs full
# contexts, but at most this share of physical memory and this many bytes.
_CPU_KV_MEMORY_SHARE = 0.25
_CPU_KV_MAX_BYTES = 4 << 30
# On CUDA: this share of the memory free after loading the model, minus room for activations.
_CUDA_KV_MEMORY_SHARE = 0.9
_CUDA_ACTIVATION_RESERVE = 2 << 30
# Separates a request's id from its choice number in the sequence id of choice i > 0.
CHOICE_SEPARATOR = "#"


def choice_id(request_id: str, index: int) -> str:
    """The engine's sequence id of choice ``index`` of a request: the request's own id for choice 0."""
    return request_id if index == 0 else f"{request_id}{CHOICE_SEPARATOR}{index}"


class EngineInputError(Exception):
    """A request the engine cannot run, with a stable ``code`` and a human ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


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
    # workers/structured.py); None for free text and for error endings.
    schema_valid: bool | None = None
    # The choice (0 to n - 1) of a request with n choices; ``request_id`` is the request's.
    index: int = 0
    # Of num_cached_tokens, those copied up from each KV tier below the device cache (tier -> tokens).
    tier_cached_tokens: dict[str, int] | None = None


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
class _Choices:
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
class StepResult:
    outputs: list[RequestOutput]
    work: list[StepWork]
    start: float
    end: float


@dataclass
class _Tracked:
    """Engine-side state of an unfinished sequence (a request, or one choice of it)."""

    request: EngineRequest
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict] | None
    # Highest num_computed_tokens reached: tokens below it that run again are recomputation.
    high_water: int = 0
    first_token_time: float | None = None
    new_token_ids: list[int] = field(default_factory=list)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _max_usable_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The most KV blocks the engine can ever hold at once: ``max_num_seqs`` requests, each at most
    ``max_model_len`` tokens (rounded up to whole blocks). A bigger cache is never used."""
    return -(-max_model_len // config.block_size) * config.max_num_seqs


def _default_num_kv_blocks(info: ModelInfo, device: torch.device, config: EngineConfig,
                           max_model_len: int, draft_block_bytes: int = 0) -> tuple[int, str]:
    """The KV cache size when ``num_kv_blocks`` is not given, and why (for the log).

    As many blocks as can be used (:func:`_max_usable_blocks`), within a share of memory; never
    fewer than one full-length sequence needs (plus one block), so every prompt can run. A draft
    model's cache has a block for every block of the model's (``draft_block_bytes`` each), so
    the memory holds both caches.
    """
    block_bytes = info.kv_bytes_per_token_as(config.kv_cache_dtype) * config.block_size + draft_block_bytes
    usable = _max_usable_blocks(config, max_model_len)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_KV_MEMORY_SHARE) - _CUDA_ACTIVATION_RESERVE
        where = (f"{_CUDA_KV_MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device} less "
                 f"{_CUDA_ACTIVATION_RESERVE / 2**30:.0f} GiB for activations")
    else:
        physical = _physical_memory()
        budget = min(int(physical * _CPU_KV_MEMORY_SHARE), _CPU_KV_MAX_BYTES)
        where = (f"{_CPU_KV_MEMORY_SHARE:.0%} of {physical / 2**30:.1f} GiB of memory, at most "
                 f"{_CPU_KV_MAX_BYTES / 2**30:.0f} GiB")
    affordable = max(0, budget) // block_bytes
    floor = -(-max_model_len // config.block_size) + 1
    usable_why = (f"max_num_seqs {config.max_num_seqs} x {-(-max_model_len // config.block_size)} blocks "
                  f"for max_model_len {max_model_len}")
    budget_why = f"memory budget {max(0, budget) / 2**20:.1f} MiB ({where})"
    if draft_block_bytes:
        budget_why += ", for the model's and the draft's KV caches together"
    if usable <= affordable:
        return max(usable, floor), f"{usable_why}, within the {budget_why}"
    if affordable >= floor:
        return affordable, f"the {budget_why}; {usable_why} would need {usable}"
    return floor, f"one full-length sequence ({max_model_len} tokens) plus a block; the {budget_why} holds fewer"


class _StartupTimer:
    """Seconds per part of start-up, each part timed from the end of the one before."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._last
        self._last = now


def _checked_max_len(config: EngineConfig, info: ModelInfo) -> int:
    """The context limit: the configured one (or the model's), refused past what the model supports."""
    max_len = config.max_model_len or info.max_model_len
    if max_len > info.max_model_len:
        raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings ({info.max_model_len})")
    if info.sliding_window is not None and max_len > info.sliding_window:
        raise ValueError(
            f"{info.name} uses sliding-window attention ({info.sliding_window} tokens), which this engine "
            f"does not implement; set max_model_len <= {info.sliding_window}"
        )
    return max_len


def _scheduler_config(config: EngineConfig, num_blocks: int, num_swap_blocks: int, max_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        enable_prefix_caching=config.enable_prefix_caching,
        prefix_cache_scope=config.prefix_cache_scope,
        preemption_mode=config.preemption_mode,
        num_swap_blocks=num_swap_blocks,
        priority_aging_s=config.priority_aging_s,
        tenant_weights=config.tenant_weight_map,
        num_speculative_tokens=config.num_speculative_tokens if config.speculative != "none" else 0,
        speculative_max_batched_tokens=config.speculative_max_batched_tokens,
        speculative_adaptive=config.speculative_policy == "adaptive",
    )


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
        timer = _StartupTimer()
        self.startup_seconds = timer.seconds
        prepared = self._load(config, shard, stage)
        timer.lap("read prepared model" if prepared else "load model")
        max_len = self.max_model_len = _checked_max_len(config, self.info)
        # The draft proposer's model, loaded before the KV cache is sized (its weights take memory,
        # and its cache has a block for every block of the model's).
        draft: tuple[torch.nn.Module, ModelInfo] | None = None
        draft_block_bytes = 0
        if config.speculative == "draft":
            draft = load_model(config.draft_model, self.device, self.info.dtype)
            check_draft_model(draft[1], self.info, max_len)
            draft_block_bytes = draft[1].kv_bytes_per_token_as(config.kv_cache_dtype) * config.block_size
        num_blocks, num_swap_blocks = self._size_kv(config, stage, max_len, draft_block_bytes)
        self.scheduler_config = _scheduler_config(config, num_blocks, num_swap_blocks, max_len)
        self._make_runner(config, stage, draft)
        timer.lap("runner and KV cache")
        self._make_proposer(config, draft)
        self.spec_stats = SpecStats(config.speculative)
        # When the last step that ran a model ended (perf_counter), while requests were left to run.
        self._last_step_end: float | None = None
        self.scheduler = Scheduler(self.scheduler_config, clock=clock, proposer=self.proposer)
        # KV tiers below the device cache (host memory, disk, a shared directory), if configured.
        self.kv_tiers = attach_engine_tiers(config, self.info, self.model, self.runner, self.scheduler)
        timer.lap("other")
        if not prepared:
            if config.quantization != "none":
                self._quantize(config)
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
        self._log_ready(config, num_blocks, max_len, stage)
        timer.lap("other")
        log.info("engine start-up %.2fs: %s", sum(timer.seconds.values()),
                 ", ".join(f"{part} {seconds:.2f}s" for part, seconds in timer.seconds.items()))

    def _load(self, config: EngineConfig, shard, stage) -> bool:
        """The model, its info and tokenizer: as an earlier start on this machine prepared them
        (dequantized, calibrated, quantized) when kept, else read. Returns whether prepared."""
        prepared = load_prepared(config, self.device) if shard is None and stage is None else None
        tokenizer = None
        if prepared is not None:
            model, info, tokenizer = prepared
            log.info("model %s read as prepared by an earlier start (%s)", info.model_id, prepared_cache_dir())
        else:
            model, info = load_model(config.model, self.device, config.dtype, shard=shard, stage=stage)
        self.model = model
        self.info = info
        self.tokenizer: Tokenizer | None = tokenizer or (
            ByteTokenizer() if config.model == TINY else load_tokenizer(info.path) if info.path else None
        )
        return prepared is not None

    def _size_kv(self, config: EngineConfig, stage, max_len: int, draft_block_bytes: int) -> tuple[int, int]:
        """(device KV blocks, host swap blocks), from the config or sized for this device."""
        info, model = self.info, self.model
        # Real bytes per block: an 8-bit cache's values and scales. Tensor parallel: of this rank's
        # KV heads, as every rank holds as many.
        kv_info = info if model.shard is None else dataclasses.replace(
            info, num_kv_heads=model.shard.kv_heads[1] - model.shard.kv_heads[0])
        if stage is not None:  # a pipeline stage's layers only (stage 0 has the most)
            kv_info = dataclasses.replace(kv_info, num_layers=model.stage.num_layers)
        block_bytes = kv_info.kv_bytes_per_token_as(config.kv_cache_dtype) * config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks, why = _default_num_kv_blocks(kv_info, self.device, config, max_len, draft_block_bytes)
            log.info("KV cache sized automatically: %d blocks x %d tokens (%.1f MiB): %s", num_blocks,
                     config.block_size, num_blocks * (block_bytes + draft_block_bytes) / 2**20, why)
        if config.preemption_mode != "swap":
            return num_blocks, 0
        num_swap_blocks = num_swap_blocks_for(int(config.swap_space_gib * 2**30), block_bytes)
        if num_swap_blocks == 0:
            raise ValueError(
                f"swap_space_gib {config.swap_space_gib} holds no KV block ({block_bytes} bytes for "
                f"{config.block_size} tokens of {info.name}); give more swap space or use recompute"
            )
        # Swapped-out blocks belong to requests the engine holds, and a worker gives it at most
        # max_num_seqs of them: host memory past their full contexts would never be used (were
        # the pool ever full, preemption falls back to recompute).
        usable = _max_usable_blocks(config, max_len)
        if num_swap_blocks > usable:
            log.info("swap space: %d blocks (%.1f MiB) of the %g GiB given: max_num_seqs %d requests of "
                     "max_model_len %d never hold more", usable, usable * block_bytes / 2**20,
                     config.swap_space_gib, config.max_num_seqs, max_len)
            num_swap_blocks = usable
        return num_blocks, num_swap_blocks

    def _make_runner(self, config: EngineConfig, stage, draft) -> None:
        info = self.info
        draft_layers = None
        if config.speculative == "self":
            draft_layers = resolve_draft_layers(config.draft_layers, info.num_layers, info.name)
            log.info("speculative decoding: self, a draft of the model's first %d of %d layers",
                     draft_layers, info.num_layers)
        group = None
        if self.tensor_parallel is not None:
            self.tensor_parallel.ready(self.scheduler_config)
            group = self.tensor_parallel.group
        if stage is not None:
            self.runner = StageRunner(self.model, info, self.scheduler_config, self.device,
                                      resolve_dtype(info.dtype), kv_cache_dtype=config.kv_cache_dtype, group=group)
        else:
            self.runner = ModelRunner(self.model, info, self.scheduler_config, self.device, resolve_dtype(info.dtype),
                                      kv_cache_dtype=config.kv_cache_dtype, group=group,
                                      draft_layers=draft_layers, draft_model=draft)

    def _make_proposer(self, config: EngineConfig, draft) -> None:
        if config.speculative == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        elif config.speculative == "self":
            self.proposer = SelfProposer()
        elif config.speculative == "draft":
            self.proposer = DraftProposer(self.runner.draft)
            dinfo = draft[1]
            log.info("speculative decoding: draft model %s (%s, %d layers, %s params), its KV cache %.1f MiB",
                     dinfo.model_id, dinfo.dtype, dinfo.num_layers, f"{dinfo.num_params:,}",
                     self.runner.draft.kv_cache_bytes / 2**20)
        else:
            self.proposer = None

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
        self._tracked: dict[str, _Tracked] = {}
        # Requests with n > 1 choices, by request id, and each such choice's (request id, index).
        self._choices: dict[str, _Choices] = {}
        self._choice_of: dict[str, tuple[str, int]] = {}
        # Requests ended between steps (cancel): reported by the next step.
        self._ended_outside: list[EngineRequest] = []
        # Seconds spent in each part of step() since start (perf_counter), for profiling:
        # schedule, prepare (inputs and metadata), forward, sample, postprocess.
        self.phase_seconds: dict[str, float] = dict.fromkeys(
            ("schedule", "prepare", "forward", "sample", "postprocess"), 0.0
        )
        self.num_steps = 0

    def _log_ready(self, config: EngineConfig, num_blocks: int, max_len: int, stage) -> None:
        info, tp, pp = self.info, config.tensor_parallel_size, config.pipeline_parallel_size
        log.info(
            "engine ready: %s (%s, %s%s, %s params) on %s, KV cache %d blocks x %d tokens (%.1f MiB, %s), "
            "max_model_len %d%s",
            info.model_id, info.architecture, info.dtype,
            "" if config.quantization == "none" else f" {config.quantization}", f"{info.num_params:,}", self.device,
            num_blocks, config.block_size, self.runner.kv_cache_bytes / 2**20,
            info.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype, max_len,
            f", tensor parallel over {tp} ranks (this rank's share of the KV cache shown)" if tp > 1 else "",
        )
        if pp > 1:
            stage_of = self.model.stage
            log.info("pipeline parallel: %d stages, this rank holds layers %d to %d of %d", pp, stage_of.start,
                     stage_of.stop - 1, info.num_layers)

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

    def _quantize(self, config: EngineConfig) -> None:
        """Swap in the int8 projections; for w8a8 first fold SmoothQuant's factors into the
        model, from the activation ranges of a short calibration text run through it."""
        smoothed = 0
        if config.quantization == "w8a8" and config.smoothquant_alpha > 0:
            window = min(512, self.max_model_len, self.scheduler_config.num_kv_blocks * config.block_size)
            windows = calibration_token_windows(self.tokenizer, window) if self.tokenizer is not None else []
            if windows:
                ranges = activation_ranges(self.model, lambda: [self.runner.forward_sequence(w) for w in windows],
                                           lm_head=config.quantize_lm_head)
                smoothed = smooth(self.model, ranges, config.smoothquant_alpha)
            else:
                log.info("no tokenizer: w8a8 without SmoothQuant calibration")
        swapped = quantize_model(self.model, config.quantization, lm_head=config.quantize_lm_head)
        head = config.quantization == "w8a8" and config.quantize_lm_head
        log.info("quantization %s: %d projections hold int8 weights%s%s", config.quantization, swapped,
                 ", the LM head among them" if head else "",
                 f" ({smoothed} smoothed, alpha {config.smoothquant_alpha:g})" if smoothed else "")

    # -- requests in --------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                      messages: list[dict] | None) -> list[int]:
        """Token ids for exactly one of a text prompt, token ids, or chat messages."""
        given = [name for name, v in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise EngineInputError(
                "invalid_request",
                "exactly one of prompt, prompt_token_ids or messages is required"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            self._check_token_ids(ids)
        else:
            if self.tokenizer is None:
                raise EngineInputError(
                    "invalid_request",
                    f"{given[0]}: model {self.info.name} has no tokenizer (no tokenizer.json); "
                    "send prompt_token_ids instead",
                )
            try:
                ids = self.tokenizer.encode(prompt) if prompt is not None else self.tokenizer.encode_chat(messages)
            except ValueError as exc:
                raise EngineInputError("invalid_request", f"{given[0]}: {exc}") from None
        if not ids:
            raise EngineInputError("invalid_request", f"{given[0]}: the prompt has no tokens")
        self._check_length(len(ids))
        return ids

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.info.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise EngineInputError(
                    "invalid_token_id",
                    f"prompt_token_ids[{i}] = {t!r} is outside the vocabulary (0..{vocab - 1})",
                )

    def _check_length(self, n: int) -> None:
        if n >= self.max_model_len:
            raise EngineInputError(
                "prompt_too_long",
                f"prompt has {n} tokens; the context limit (max_model_len) is {self.max_model_len}, "
                "which leaves no room to generate",
            )

    def _check_logit_bias(self, sampling: SamplingParams) -> None:
        vocab = self.info.vocab_size
        for token, _ in sampling.logit_bias:
            if token >= vocab:
                raise EngineInputError(
                    errors.INVALID_TOKEN_ID,
                    f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1}) of model "
                    f"{self.info.name} - at `{sampling.field_prefix}.logit_bias`",
                )

    def _check_sampling(self, sampling: SamplingParams) -> None:
        """What a request's sampling asks of this model: token ids in its vocabulary, a tokenizer
        for stop strings."""
        self._check_logit_bias(sampling)
        self._check_stop_token_ids(sampling)
        if sampling.stop and self.tokenizer is None:
            raise EngineInputError(
                "invalid_request",
                f"stop: stop strings need a tokenizer and model {self.info.name} has none; use stop_token_ids",
            )

    def _check_stop_token_ids(self, sampling: SamplingParams) -> None:
        vocab = self.info.vocab_size
        for i, token in enumerate(sampling.stop_token_ids):
            if not 0 <= token < vocab:
                raise EngineInputError(
                    errors.INVALID_TOKEN_ID,
                    f"stop_token_ids: token id {token} is outside the vocabulary (0..{vocab - 1}) of model "
                    f"{self.info.name} - at `{sampling.field_prefix}.stop_token_ids[{i}]`",
                )

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
            if (rid in self._tracked or rid in self._choices or rid in self._choice_of
                    or self.scheduler.get_request(rid) is not None):
                raise ValueError(f"request {rid!r} is already in the engine")
        ids = list(prompt_token_ids)
        if not ids:
            raise EngineInputError("invalid_request", "prompt_token_ids: the prompt has no tokens")
        self._check_length(len(ids))
        self._check_token_ids(ids)
        self._check_sampling(sampling)
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
        choices = []
        for i, rid in enumerate(seq_ids):
            seed = choice_seed(sampling.seed, i) if sampling.seed is not None else self._rng.getrandbits(63)
            choices.append(EngineRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=sampling,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                deadline=deadline,
                max_model_len=self.max_model_len,
                tenant=tenant,
                share_group=share_group,
                speculative=speculative, cache_salt=cache_salt, slo_ttft_ms=slo_ttft_ms,
                slo_tpot_ms=slo_tpot_ms,
                sampling_seed=seed,
            ))
        if sampling.grammar is not None:
            try:
                for request in choices:
                    self.structured.add(request)
            except GrammarError as exc:
                for request in choices:
                    self.structured.forget(request.request_id)
                raise EngineInputError("invalid_response_format", exc.message) from None
        for request in choices:
            self.processors.add(request)
            detok = (
                IncrementalDetokenizer(self.tokenizer, sampling.stop, ids) if self.tokenizer is not None else None
            )
            self._tracked[request.request_id] = _Tracked(request, detok,
                                                         [] if sampling.logprobs is not None else None)
        self.scheduler.add_request(choices[0])
        if n > 1:
            # Without a prefix cache there is nothing to wait for: every choice computes the prompt.
            sharing = self.scheduler_config.enable_prefix_caching
            self._choices[request_id] = _Choices(choices[0], choices[1:] if sharing else [], seq_ids, n)
            for i, rid in enumerate(seq_ids[1:], start=1):
                self._choice_of[rid] = (request_id, i)
            if not sharing:
                for request in choices[1:]:
                    self.scheduler.add_request(request)

    def cancel(self, request_id: str) -> None:
        """End a request (all its choices) as cancelled (their blocks are freed now; the next step
        reports them)."""
        group = self._choices.get(request_id)
        if group is None:
            self._ended_outside.extend(
                self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_CANCELLED)
            )
            return
        self._ended_outside.extend(self.scheduler.finish_requests(group.ids, RequestStatus.FINISHED_CANCELLED))
        for request in group.held:
            request.status = RequestStatus.FINISHED_CANCELLED
            self._ended_outside.append(request)
        group.held = []

    def withdraw(self, request_ids: list[str]) -> None:
        """End requests (all their choices) without reporting them in any step (for work handed back
        to the stream, whose row another worker will write)."""
        seq_ids: list[str] = []
        for rid in request_ids:
            group = self._choices.pop(rid, None)
            if group is None:
                seq_ids.append(rid)
                continue
            seq_ids.extend(group.ids)
            for request in group.held:
                self._forget(request.request_id)
            for sid in group.ids[1:]:
                self._choice_of.pop(sid, None)
        for request in self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_CANCELLED):
            self._forget(request.request_id)

    def _forget(self, seq_id: str) -> None:
        self._tracked.pop(seq_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq_id)
        if self.structured is not None:
            self.structured.forget(seq_id)
        self.processors.forget(seq_id)

    def holds(self, request_id: str) -> bool:
        """Whether any choice of the request is still in the engine (waiting, running, or held back
        until the first has computed the prompt)."""
        group = self._choices.get(request_id)
        if group is None:
            return self.scheduler.get_request(request_id) is not None
        return bool(group.held) or any(self.scheduler.get_request(sid) is not None for sid in group.ids)

    def unstarted_request_ids(self) -> list[str]:
        """Requests none of whose choices has run yet (the scheduler's unstarted requests, less the
        choices of requests whose first choice has run)."""
        return [rid for rid in self.scheduler.unstarted_request_ids() if rid not in self._choice_of]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._ended_outside) or bool(self._choices)

    def free_capacity(self) -> int:
        s = self.scheduler
        held = sum(len(group.held) for group in self._choices.values()) if self._choices else 0
        return max(0, self.scheduler_config.max_num_seqs - s.num_running - s.num_waiting - held)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run the model, postprocess; each part's time is added to ``phase_seconds``."""
        start = self.clock()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        work = self._work(scheduler_output)
        t1 = time.perf_counter()
        # Constrained requests' token masks, filled in the background while the model runs.
        masks = self.structured.begin_step(scheduler_output.scheduled) if self.structured is not None else None
        processors = self.processors if len(self.processors) else None
        try:
            # A step may hold only block copies (swap preemption); they must still happen now.
            if scheduler_output.is_empty:
                ran = None
            elif masks is None and processors is None:
                ran = self.runner.execute(scheduler_output)
            else:
                ran = self.runner.execute(scheduler_output, masks, processors=processors)
        finally:
            if masks is not None:
                masks.wait()  # the matchers must not move while a mask is being filled
        t2 = time.perf_counter()
        if ran is not None and self.proposer is not None and scheduler_output.num_batched_tokens:
            # The speculation policy's measurements (only a speculating engine has a policy to feed).
            depth = 0
            if ran.draft_seconds > 0.0:
                depth = max(len(sr.spec_token_ids) for sr in scheduler_output.scheduled)
            self.scheduler.record_step_time(scheduler_output.num_batched_tokens, t2 - t1, ran.draft_seconds, depth)
        outputs = self._postprocess(scheduler_output, ran)
        if ran is not None:
            # The whole step, schedule to results, and the worker's time since the step before
            # (when it had work to step): what a running request waits for between its tokens.
            end = time.perf_counter()
            last = self._last_step_end
            self.scheduler.record_step(end - t0, t0 - last if last is not None else None)
            self._last_step_end = end if self.scheduler.has_unfinished_requests() else None
        self._account(t0, t1, t2, ran)
        return StepResult(outputs=outputs, work=work, start=start, end=self.clock())

    def _work(self, scheduler_output: SchedulerOutput) -> list[StepWork]:
        """Each scheduled request's share of the step, read before the model advances it."""
        work = []
        for sr in scheduler_output.scheduled:
            r, n = sr.request, sr.num_new_tokens
            s = len(sr.spec_token_ids)
            c = r.num_computed_tokens
            tracked = self._tracked[r.request_id]
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

    def _postprocess(self, scheduler_output: SchedulerOutput,
                     ran: ModelRunnerOutput | None) -> list[RequestOutput]:
        """Apply the sampled tokens; one output per request that got a token or ended."""
        ended = (*self._ended_outside, *scheduler_output.finished)
        touched = {request.request_id: request for request in ended}
        self._ended_outside = []
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
                tracked = self._tracked[request.request_id]
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
        if self._choices:
            self._release_choices()
        return outputs

    def _release_choices(self) -> None:
        """Give the scheduler the held-back choices of requests whose first choice has computed the
        prompt (its full blocks are in the prefix cache now) or has ended."""
        for group in self._choices.values():
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
            tracked = self._tracked.get(rid)
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

    def _account(self, t0: float, t1: float, t2: float, ran: ModelRunnerOutput | None) -> None:
        """Add this step's phase times: schedule [t0, t1], runner [t1, t2] (split by the runner's
        own marks), postprocess [t2, now]; the bookkeeping between them counts as schedule."""
        phases = self.phase_seconds
        runner = ran.phase_seconds if ran is not None else (0.0, 0.0, 0.0)
        phases["schedule"] += t1 - t0
        phases["prepare"] += runner[0]
        phases["forward"] += runner[1]
        phases["sample"] += runner[2]
        phases["postprocess"] += time.perf_counter() - t2 + max(0.0, (t2 - t1) - sum(runner))
        self.num_steps += 1

    def _output(self, request: EngineRequest) -> RequestOutput:
        """The sequence's output for this step: the new tokens handed over, the cumulative lists
        shared (see ``RequestOutput``), so the cost follows the new tokens, not the total."""
        rid = request.request_id
        parent, index = self._choice_of.get(rid, (rid, 0))
        tracked = self._tracked.get(rid)
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
        self._tracked.pop(rid, None)
        if self.proposer is not None:
            self.proposer.forget(rid)
        schema_valid = None
        if self.structured is not None:
            schema_valid = self.structured.finish(rid, status.finish_reason, text_cut)
        self.processors.forget(rid)
        group = self._choices.get(parent)
        if group is not None:
            group.unfinished -= 1
            if group.unfinished <= 0:
                del self._choices[parent]
                for sid in group.ids[1:]:
                    self._choice_of.pop(sid, None)
        return schema_valid

    @staticmethod
    def _is_stop_token(request: EngineRequest, token: int) -> bool:
        sampling = request.sampling
        return token in sampling.stop_token_ids or (token in request.eos_token_ids and not sampling.ignore_eos)


__all__ = ["EngineConfig", "EngineInputError", "LLMEngine", "RequestOutput", "StepResult", "StepWork"]
