"""Building an engine: its model, its KV cache's size, its runner and proposer, 8-bit weights.

Start-up, in the order :class:`~mqinfer.workers.engine.core.LLMEngine` runs it: read the model (or the
copy an earlier start on this machine prepared, ``workers/engine/prepared.py``) and its tokenizer; check
the context limit against the model (:func:`checked_max_len`); size the device's KV cache
(:func:`default_num_kv_blocks`, unless ``num_kv_blocks`` is given) and the host's swap space;
build the model runner (one rank's, or a pipeline stage's) and the speculative proposer; fold
SmoothQuant's factors in and swap in int8 projections (:func:`quantize`). Each part is timed by a
:class:`StartupTimer`, and :func:`log_ready` says what was built.

The KV cache's default size is as many blocks as the engine can ever use (``max_num_seqs`` full
contexts), within a share of the device's memory, and never fewer than one full-length sequence
needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.draft_proposer import DraftProposer
from mqinfer.workers.engine.loader import TINY, ModelInfo, load_model, resolve_dtype
from mqinfer.workers.engine.model_runner import ModelRunner
from mqinfer.workers.engine.models.quant import activation_ranges, calibration_token_windows, quantize_model, smooth
from mqinfer.workers.engine.ngram_proposer import NgramProposer
from mqinfer.workers.engine.pipeline import StageRunner
from mqinfer.workers.engine.prepared import cache_dir as prepared_cache_dir
from mqinfer.workers.engine.prepared import load_prepared
from mqinfer.workers.engine.self_proposer import SelfProposer, resolve_draft_layers
from mqinfer.workers.engine.swap import num_swap_blocks_for
from mqinfer.workers.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# Default KV cache size on CPU when num_kv_blocks is not given: enough for max_num_seqs full
# contexts, but at most this share of physical memory and this many bytes.
_CPU_KV_MEMORY_SHARE = 0.25
_CPU_KV_MAX_BYTES = 4 << 30
# On CUDA: this share of the memory free after loading the model, minus room for activations.
_CUDA_KV_MEMORY_SHARE = 0.9
_CUDA_ACTIVATION_RESERVE = 2 << 30


def physical_memory() -> int:
    """Bytes of memory on this machine (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def max_usable_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The most KV blocks the engine can ever hold at once: ``max_num_seqs`` requests, each at most
    ``max_model_len`` tokens (rounded up to whole blocks). A bigger cache is never used."""
    return -(-max_model_len // config.block_size) * config.max_num_seqs


def default_num_kv_blocks(info: ModelInfo, device: torch.device, config: EngineConfig,
                           max_model_len: int, draft_block_bytes: int = 0) -> tuple[int, str]:
    """The KV cache size when ``num_kv_blocks`` is not given, and why (for the log).

    As many blocks as can be used (:func:`max_usable_blocks`), within a share of memory; never
    fewer than one full-length sequence needs (plus one block), so every prompt can run. A draft
    model's cache has a block for every block of the model's (``draft_block_bytes`` each), so
    the memory holds both caches.
    """
    block_bytes = info.kv_bytes_per_token_as(config.kv_cache_dtype) * config.block_size + draft_block_bytes
    usable = max_usable_blocks(config, max_model_len)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_KV_MEMORY_SHARE) - _CUDA_ACTIVATION_RESERVE
        where = (f"{_CUDA_KV_MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device} less "
                 f"{_CUDA_ACTIVATION_RESERVE / 2**30:.0f} GiB for activations")
    else:
        physical = physical_memory()
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


class StartupTimer:
    """Seconds per part of start-up, each part timed from the end of the one before."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._last
        self._last = now


def checked_max_len(config: EngineConfig, info: ModelInfo) -> int:
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


def scheduler_config_for(config: EngineConfig, num_blocks: int, num_swap_blocks: int, max_len: int) -> SchedulerConfig:
    """The scheduler's settings: the engine's, with the KV cache as sized here."""
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




def load(config: EngineConfig, device: torch.device, shard,
         stage) -> tuple[torch.nn.Module, ModelInfo, Tokenizer | None, bool]:
    """(model, info, tokenizer, prepared): as an earlier start on this machine prepared them
    (dequantized, calibrated, quantized) when kept, else read; ``prepared`` says which."""
    prepared = load_prepared(config, device) if shard is None and stage is None else None
    tokenizer = None
    if prepared is not None:
        model, info, tokenizer = prepared
        log.info("model %s read as prepared by an earlier start (%s)", info.model_id, prepared_cache_dir())
    else:
        model, info = load_model(config.model, device, config.dtype, shard=shard, stage=stage)
    tokenizer = tokenizer or (
        ByteTokenizer() if config.model == TINY else load_tokenizer(info.path) if info.path else None
    )
    return model, info, tokenizer, prepared is not None


def size_kv(config: EngineConfig, info: ModelInfo, model: torch.nn.Module, device: torch.device, stage,
            max_len: int, draft_block_bytes: int) -> tuple[int, int]:
    """(device KV blocks, host swap blocks), from the config or sized for this device."""
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
        num_blocks, why = default_num_kv_blocks(kv_info, device, config, max_len, draft_block_bytes)
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
    usable = max_usable_blocks(config, max_len)
    if num_swap_blocks > usable:
        log.info("swap space: %d blocks (%.1f MiB) of the %g GiB given: max_num_seqs %d requests of "
                 "max_model_len %d never hold more", usable, usable * block_bytes / 2**20,
                 config.swap_space_gib, config.max_num_seqs, max_len)
        num_swap_blocks = usable
    return num_blocks, num_swap_blocks


def make_runner(config: EngineConfig, info: ModelInfo, model: torch.nn.Module, device: torch.device,
                scheduler_config: SchedulerConfig, stage, draft, group) -> ModelRunner | StageRunner:
    """The model runner: a pipeline stage's, or one rank's (with a self-draft's layers or a draft
    model when speculating so). ``group``: the tensor-parallel process group, if any."""
    draft_layers = None
    if config.speculative == "self":
        draft_layers = resolve_draft_layers(config.draft_layers, info.num_layers, info.name)
        log.info("speculative decoding: self, a draft of the model's first %d of %d layers",
                 draft_layers, info.num_layers)
    if stage is not None:
        return StageRunner(model, info, scheduler_config, device, resolve_dtype(info.dtype),
                           kv_cache_dtype=config.kv_cache_dtype, group=group)
    return ModelRunner(model, info, scheduler_config, device, resolve_dtype(info.dtype),
                       kv_cache_dtype=config.kv_cache_dtype, group=group,
                       draft_layers=draft_layers, draft_model=draft)


def make_proposer(config: EngineConfig, runner, draft):
    """The speculative proposer ``config.speculative`` names (None for ``none``)."""
    if config.speculative == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative == "self":
        return SelfProposer()
    if config.speculative == "draft":
        dinfo = draft[1]
        log.info("speculative decoding: draft model %s (%s, %d layers, %s params), its KV cache %.1f MiB",
                 dinfo.model_id, dinfo.dtype, dinfo.num_layers, f"{dinfo.num_params:,}",
                 runner.draft.kv_cache_bytes / 2**20)
        return DraftProposer(runner.draft)
    return None


def quantize(config: EngineConfig, model: torch.nn.Module, tokenizer: Tokenizer | None, runner,
             calibration_len: int) -> None:
    """Swap in the int8 projections; for w8a8 first fold SmoothQuant's factors into the model,
    from the activation ranges of a short calibration text (windows of ``calibration_len``
    tokens) run through it."""
    smoothed = 0
    if config.quantization == "w8a8" and config.smoothquant_alpha > 0:
        windows = calibration_token_windows(tokenizer, calibration_len) if tokenizer is not None else []
        if windows:
            ranges = activation_ranges(model, lambda: [runner.forward_sequence(w) for w in windows],
                                       lm_head=config.quantize_lm_head)
            smoothed = smooth(model, ranges, config.smoothquant_alpha)
        else:
            log.info("no tokenizer: w8a8 without SmoothQuant calibration")
    swapped = quantize_model(model, config.quantization, lm_head=config.quantize_lm_head)
    head = config.quantization == "w8a8" and config.quantize_lm_head
    log.info("quantization %s: %d projections hold int8 weights%s%s", config.quantization, swapped,
             ", the LM head among them" if head else "",
             f" ({smoothed} smoothed, alpha {config.smoothquant_alpha:g})" if smoothed else "")


def log_ready(config: EngineConfig, info: ModelInfo, model: torch.nn.Module, device: torch.device, runner,
              num_blocks: int, max_len: int) -> None:
    """One line for the engine as built (and one for this rank's pipeline stage)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    log.info(
        "engine ready: %s (%s, %s%s, %s params) on %s, KV cache %d blocks x %d tokens (%.1f MiB, %s), "
        "max_model_len %d%s",
        info.model_id, info.architecture, info.dtype,
        "" if config.quantization == "none" else f" {config.quantization}", f"{info.num_params:,}", device,
        num_blocks, config.block_size, runner.kv_cache_bytes / 2**20,
        info.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype, max_len,
        f", tensor parallel over {tp} ranks (this rank's share of the KV cache shown)" if tp > 1 else "",
    )
    if pp > 1:
        stage_of = model.stage
        log.info("pipeline parallel: %d stages, this rank holds layers %d to %d of %d", pp, stage_of.start,
                 stage_of.stop - 1, info.num_layers)
