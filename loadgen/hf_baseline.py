"""The peers we measure against: Hugging Face transformers on the same checkpoint and requests.

Owns two baselines, both greedy, bf16 by default, counting only the tokens each request asked for:

- ``run_static``: what most people do with ``model.generate``. Requests go in fixed-size
  batches in the given order, left-padded to the longest prompt; every batch runs until its
  longest request is done (``max_new_tokens = min_new_tokens =`` the batch's largest
  ``max_tokens``, so EOS never ends a row early, as ``ignore_eos`` asks). Each request is
  finished when its batch returns; its first token is stamped by a logits processor at the
  first decoding step. ``best_static`` runs several batch sizes and keeps the fastest.
- ``run_continuous``: transformers' own continuous batching (``ContinuousBatchingManager``,
  behind ``generate_batch``), each request added with its own ``max_new_tokens`` and EOS off.
  ``generate_batch`` itself takes one ``max_new_tokens`` for all requests, so we drive its
  manager directly, as ``generate_batch`` does internally.

Both return a ``BaselineResult`` whose per-request timings go through ``loadgen.metrics``, the
same arithmetic as our engine's results.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mqinfer.loadgen.metrics import RequestTiming, RunSummary, summarize

Progress = Callable[[str], None]


@dataclass
class BaselineResult:
    system: str  # "hf-static" | "hf-continuous"
    batch_size: int | None
    requested_tokens: int
    computed_tokens: int  # tokens the system generated, padding rows and overshoot included
    wall_s: float  # whole call, setup included
    summary: RunSummary
    timings: list[RequestTiming] = field(repr=False, default_factory=list)
    # Generated token ids per request id, cut to what each asked for (for agreement checks).
    outputs: dict[str, list[int]] = field(repr=False, default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.summary.throughput

    @property
    def label(self) -> str:
        return f"{self.system}@{self.batch_size}" if self.batch_size else self.system

    def to_dict(self, with_requests: bool = False) -> dict[str, Any]:
        out = {"system": self.system, "batch_size": self.batch_size, "requested_tokens": self.requested_tokens,
               "computed_tokens": self.computed_tokens, "wall_s": self.wall_s, "throughput": self.throughput,
               "summary": self.summary.to_dict()}
        if with_requests:
            out["requests"] = [t.__dict__ for t in self.timings]
        return out


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_hf_model(folder: str | os.PathLike, *, dtype: str = "bfloat16", device: str = "cpu"):
    """The checkpoint as a transformers model, in ``dtype`` on ``device``, in eval mode."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    # The weight-loading progress bar and notes are noise on a benchmark's stderr.
    previous = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype)
    finally:
        transformers.logging.set_verbosity(previous)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model.to(device).eval()


def _pad_token_id(model) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


class _FirstStepClock:
    """A logits processor that only notes when the first decoding step's logits are ready."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.time()
        return scores


def run_static(model, requests: Sequence[dict[str, Any]], batch_size: int, *,
               progress: Progress | None = _stderr) -> BaselineResult:
    """``model.generate`` over fixed batches of ``batch_size`` requests, in the given order."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not requests:
        raise ValueError("no requests")
    device = model.device
    pad = _pad_token_id(model)
    timings: list[RequestTiming] = []
    outputs: dict[str, list[int]] = {}
    computed = 0
    t_call = time.time()
    num_batches = (len(requests) + batch_size - 1) // batch_size
    with torch.inference_mode():
        for b, start in enumerate(range(0, len(requests), batch_size)):
            batch = requests[start:start + batch_size]
            longest = max(len(r["prompt_token_ids"]) for r in batch)
            steps = max(int(r["max_tokens"]) for r in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for i, r in enumerate(batch):
                p = r["prompt_token_ids"]
                ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[i, longest - len(p):] = 1
            config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                                      pad_token_id=pad, eos_token_id=getattr(model.config, "eos_token_id", None),
                                      use_cache=True)
            clock = _FirstStepClock()
            t0 = time.time()
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                 logits_processor=LogitsProcessorList([clock]))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.time()
            produced = out.shape[1] - longest
            if produced != steps:
                raise RuntimeError(f"generate produced {produced} tokens per row, expected {steps}")
            computed += len(batch) * steps
            generated = out[:, longest:].tolist()
            for r, row in zip(batch, generated):
                outputs[r["id"]] = row[:int(r["max_tokens"])]
                timings.append(RequestTiming(
                    id=r["id"], prompt_tokens=len(r["prompt_token_ids"]), requested_tokens=int(r["max_tokens"]),
                    output_tokens=steps, enqueued_at=t_call, started_at=t0, first_token_at=clock.first,
                    finished_at=t1))
            if progress:
                progress(f"hf static batch {batch_size}: {b + 1}/{num_batches} batches, "
                         f"{len(batch)}x{steps} tokens in {t1 - t0:.1f}s")
    summary = summarize(timings)
    return BaselineResult("hf-static", batch_size, summary.requested_tokens, computed, time.time() - t_call, summary,
                          timings, outputs)


def warm_up(model, requests: Sequence[dict[str, Any]]) -> None:
    """One small generate call, so first-call costs (allocations, kernel selection) are not timed."""
    sample = [dict(r, max_tokens=min(4, int(r["max_tokens"]))) for r in requests[:2]]
    run_static(model, sample, len(sample), progress=None)


def best_static(model, requests: Sequence[dict[str, Any]], batch_sizes: Sequence[int] = (16, 64, 256), *,
                progress: Progress | None = _stderr) -> tuple[BaselineResult, list[BaselineResult]]:
    """Static batching at each batch size; returns (the fastest, all of them)."""
    if not batch_sizes:
        raise ValueError("no batch sizes")
    warm_up(model, requests)
    results = [run_static(model, requests, bs, progress=progress) for bs in batch_sizes]
    return max(results, key=lambda r: r.throughput), results


class _DropMessages(logging.Filter):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def continuous_batching_available(model) -> str | None:
    """None when this transformers has continuous batching for the model, else why not."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError as exc:
        return f"this transformers has no continuous batching ({exc})"
    if not hasattr(model, "init_continuous_batching"):
        return "the model class has no init_continuous_batching (transformers too old?)"
    return None


@dataclass(frozen=True)
class _SubmitClock:
    """One submit instant read on both clocks. transformers stamps requests with perf_counter;
    they are placed on the wall clock by their distance from this instant, so the order of the
    stamps holds even when the wall clock is slewed while the job runs."""
    wall: float
    perf: float

    def to_wall(self, perf_stamp: float) -> float:
        return self.wall + (perf_stamp - self.perf)


def run_continuous(model, requests: Sequence[dict[str, Any]], *, max_batch_tokens: int | None = None,
                   num_blocks: int | None = None, progress: Progress | None = _stderr,
                   timeout_s: float = 3600.0) -> BaselineResult:
    """transformers' continuous batching manager, each request with its own ``max_new_tokens``.

    ``max_batch_tokens`` (tokens per step) defaults to transformers' own choice. ``num_blocks``
    defaults to what holds every request at once: without psutil, transformers sizes a CPU cache
    from the machine's whole memory, and a cache that large also makes its masked attention
    slower; sized to the workload it never has to evict, which can only help it.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    reason = continuous_batching_available(model)
    if reason:
        raise RuntimeError(reason)
    if not requests:
        raise ValueError("no requests")
    by_id = {r["id"]: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique")
    longest_out = max(int(r["max_tokens"]) for r in requests)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=longest_out, eos_token_id=-1,
                                  pad_token_id=_pad_token_id(model))
    cb_config = _size_cache(ContinuousBatchingConfig(), requests, max_batch_tokens, num_blocks)
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in requests),
                          max_generated_length=longest_out, num_requests=len(requests))
    with _quiet_continuous_batching_log():
        t_call = time.time()
        with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config,
            block=True, timeout=30, workload_hints=hints,
        ) as manager:
            clock = _submit_all(manager, requests)
            received, arrived = _await_results(manager, by_id, timeout_s, progress)
    timings, outputs, computed = _continuous_timings(by_id, received, arrived, clock)
    summary = summarize(timings)
    return BaselineResult("hf-continuous", None, summary.requested_tokens, computed, time.time() - t_call, summary,
                          timings, outputs)


def _size_cache(cb_config, requests: Sequence[dict[str, Any]], max_batch_tokens: int | None,
                num_blocks: int | None):
    """``cb_config`` with its cache sized to hold every request at once (unless ``num_blocks`` is
    given) and, when given, ``max_batch_tokens``."""
    if num_blocks is None:
        page = cb_config.page_size
        num_blocks = sum(-(-(len(r["prompt_token_ids"]) + int(r["max_tokens"])) // page) for r in requests)
    cb_config.num_blocks = num_blocks
    if max_batch_tokens is not None:
        cb_config.max_batch_tokens = max_batch_tokens
    return cb_config


@contextlib.contextmanager
def _quiet_continuous_batching_log() -> Iterator[None]:
    # Its per-step info lines would swamp our progress lines, and its complaint that psutil is
    # missing does not apply once num_blocks is given.
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level = cb_logger.level
    cb_logger.setLevel(logging.WARNING)
    no_psutil = _DropMessages("psutil")
    cb_logger.addFilter(no_psutil)
    try:
        yield
    finally:
        cb_logger.setLevel(level)
        cb_logger.removeFilter(no_psutil)


def _submit_all(manager, requests: Sequence[dict[str, Any]]) -> _SubmitClock:
    """Every request added to the manager with its own ``max_new_tokens``; the submit instant."""
    clock = _SubmitClock(time.time(), time.perf_counter())
    for r in requests:
        added = manager.add_request(list(r["prompt_token_ids"]), request_id=r["id"],
                                    max_new_tokens=int(r["max_tokens"]), eos_token_id=-1,
                                    record_timestamps=True)
        if added is None:
            raise RuntimeError(f"the continuous batching manager refused request {r['id']!r}")
    return clock


def _await_results(manager, by_id: dict[str, dict[str, Any]], timeout_s: float, progress: Progress | None
                   ) -> tuple[dict[str, Any], dict[str, float]]:
    """Each request's finished result and the wall-clock time it arrived, by request id."""
    received: dict[str, Any] = {}
    arrived: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    last_note = time.monotonic()
    while len(received) < len(by_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching finished {len(received)}/{len(by_id)} "
                               f"requests in {timeout_s:.0f}s")
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped with "
                                   f"{len(by_id) - len(received)} requests unfinished")
            continue
        if result.is_finished() and result.request_id in by_id and result.request_id not in received:
            received[result.request_id] = result
            arrived[result.request_id] = time.time()
            if progress and time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                progress(f"hf continuous: {len(received)}/{len(by_id)} requests")
    return received, arrived


def _continuous_timings(by_id: dict[str, dict[str, Any]], received: dict[str, Any], arrived: dict[str, float],
                        clock: _SubmitClock) -> tuple[list[RequestTiming], dict[str, list[int]], int]:
    """Each request's timing on the wall clock, its output cut to what it asked for, and the
    tokens generated in all."""
    timings = []
    outputs: dict[str, list[int]] = {}
    computed = 0
    for rid, r in by_id.items():
        res = received[rid]
        if res.error is not None:
            raise RuntimeError(f"transformers' continuous batching failed request {rid!r}: {res.error}")
        produced = len(res.generated_tokens)
        computed += produced
        outputs[rid] = list(res.generated_tokens[:int(r["max_tokens"])])
        start, end = res.lifespan
        stamps = res.timestamps or []
        timings.append(RequestTiming(
            id=rid, prompt_tokens=len(r["prompt_token_ids"]), requested_tokens=int(r["max_tokens"]),
            output_tokens=produced, enqueued_at=clock.wall,
            started_at=clock.to_wall(start) if start > 0 else clock.wall,
            first_token_at=clock.to_wall(stamps[0]) if stamps else None,
            finished_at=clock.to_wall(end) if end > 0 else arrived[rid]))
    return timings, outputs, computed
