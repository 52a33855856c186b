"""What ``loadgen/memory.py`` reads from the KV cache at every step of a run: ``StepSample`` (the
slots allocated, the tokens held, the least slots that could hold them, the running sequences),
``observe_step`` (one step's sample, from the scheduler's public state) and ``StepRecorder`` (a
run's samples). The module docstring of ``loadgen/memory.py`` says when and how they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from mqinfer.scheduler.output import SchedulerOutput
from mqinfer.scheduler.scheduler import Scheduler

@dataclass(frozen=True, slots=True)
class StepSample:
    """One step's KV figures (see the module docstring for when and how they are read)."""

    allocated_slots: int
    held_tokens: int
    # The least slots that hold these tokens in blocks of this size: held tokens plus the empty
    # tail of each sequence's last partial block (a partial block is never shared).
    min_slots: int
    num_running: int
    saturated: bool
    # Tokens of the running sequences, each counting its own: more than held_tokens only when
    # prefix-cache blocks are shared.
    sequence_tokens: int

    @property
    def waste(self) -> float:
        return 1.0 - self.held_tokens / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def unavoidable_waste(self) -> float:
        return 1.0 - self.held_tokens / self.min_slots if self.min_slots else 0.0


def observe_step(scheduler: Scheduler, out: SchedulerOutput) -> StepSample:
    """The cache as this step's forward pass sees it, from public state only. Call after ``schedule()``."""
    kv = scheduler.kv_cache_manager
    bs = kv.block_size
    config = scheduler.config
    scheduled = out.scheduled
    if len(scheduled) != scheduler.num_running:
        raise RuntimeError(f"{len(scheduled)} requests scheduled but {scheduler.num_running} running: "
                           "every running request should get tokens every step")
    tail = 0  # empty slots in the sequences' last partial blocks
    seq_tokens = 0
    if kv.enable_prefix_caching:
        # Shared blocks count once. Only full blocks are ever shared, so every owner of a block
        # agrees on how many tokens it holds.
        fill: dict[int, int] = {}
        for sr in scheduled:
            request = sr.request
            n = request.num_computed_tokens + sr.num_new_tokens
            seq_tokens += n
            tail += -n % bs
            for i, block_id in enumerate(request.block_ids):
                fill[block_id] = min(bs, max(0, n - i * bs))
        allocated = len(fill) * bs
        held = sum(fill.values())
    else:
        allocated = 0
        for sr in scheduled:
            request = sr.request
            n = request.num_computed_tokens + sr.num_new_tokens
            seq_tokens += n
            tail += -n % bs
            allocated += len(request.block_ids) * bs
        held = seq_tokens
    used = (kv.num_blocks - kv.num_free_blocks) * bs
    if allocated != used:
        raise RuntimeError(f"running requests hold {allocated} slots but the block pool has {used} in use")
    saturated = (
        scheduler.num_waiting > 0
        and scheduler.num_running < config.max_num_seqs
        and out.num_batched_tokens < config.max_num_batched_tokens
    )
    return StepSample(allocated, held, held + tail, len(scheduled), saturated, seq_tokens)


class StepRecorder:
    """Wraps one scheduler's ``schedule`` (on the instance) so that every step is observed.

    The same recorder serves the simulated run and the real engine, so both are measured by the
    same code at the same point of the step.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.samples: list[StepSample] = []
        inner = scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = inner()
            self.samples.append(observe_step(scheduler, out))
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]


__all__ = ["StepRecorder", "StepSample", "observe_step"]
