"""Engine-side request state: sampling parameters, status, token lists, KV block ownership.

This is the contract between the scheduler (which moves requests through their states), the
KV cache manager (the only code that mutates ``block_ids``, and the one that knows whether a
preempted request's KV waits in host memory) and the model runner (which reads tokens,
``num_computed_tokens`` and ``block_ids`` to build a step's batch).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from mqinfer.schemas.response_format import GrammarSpec


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_EXPIRED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_EXPIRED: "expired",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops. Checks itself when built."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # The grammar the output must follow (structured output), None for free text. The engine
    # masks the logits of such a request so that only tokens the grammar allows can be sampled
    # (EOS only where the grammar accepts), and ends it with "stop" when the grammar is complete.
    grammar: GrammarSpec | None = None
    # Choices of the same prompt: the engine runs them as n sequences that share the prompt's KV.
    n: int = 1
    # Logits processing before sampling (kernels/penalties.py): OpenAI's presence and frequency
    # penalties over the output so far, the repetition penalty over prompt and output (1 = off),
    # and (token id, bias) pairs added to the logits, sorted by token id.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Where these fields sat in what the producer sent ("$" for a native request, "$.body" for an
    # OpenAI Batch line), so that an error the engine finds names the field as the producer wrote it.
    field_prefix: str = "$"

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be between 1 and 128, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be between -2 and 2, got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > 300:
            raise ValueError(f"logit_bias may hold at most 300 tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias: token {token} must be >= 0 and its bias between -100 and 100, got {bias}")

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (they read the tokens so far)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling: a penalty, a bias, or
        stop tokens held back until ``min_tokens``."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One generation request as the engine sees it.

    ``request_id`` is the engine-wide key (the worker builds it from job_id and id).
    Tokens ``all_token_ids[:num_computed_tokens]`` have their KV in the cache (in host memory
    while the request is swapped out); the scheduler
    advances ``num_computed_tokens`` in ``update_from_output`` after the model ran.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0
    deadline: float | None = None
    # The model's context limit; generation ends with "length" when reached.
    max_model_len: int = 2048
    # Who the request is for: the scheduler shares service fairly between tenants within a
    # priority level (scheduler/fair.py).
    tenant: str = "default"
    # The fair-share group the request is counted in (the worker's lane: a tenant, or a tenant's
    # job); None counts it in its tenant's. A group has its tenant's weight.
    share_group: str | None = None
    # Whether proposed tokens may be checked for this request (speculative decoding).
    speculative: bool = True
    # With the tenant (under the cache manager's scope), the prefix-cache partition the request
    # shares cached blocks within (schemas/cache_scope.py).
    cache_salt: str | None = None
    # Latency targets in milliseconds (time to first token from arrival, time per output token
    # after it); a request with either is interactive, and the scheduler sizes steps to them
    # (scheduler/slo.py). None: no target.
    slo_ttft_ms: int | None = None
    slo_tpot_ms: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at the first admission.
    num_cached_tokens: int = -1
    # Of those, the ones copied up from each KV tier below the device cache (tier name -> tokens);
    # None when none came from a tier.
    tier_cached_tokens: dict[str, int] | None = None
    # Seconds spent reading its blocks from those tiers and copying them up, not yet billed (the
    # engine hands them to the meter with the request's next step).
    tier_load_s: float = 0.0
    # KV blocks held, in position order. Only the KV cache manager mutates this list.
    block_ids: list[int] = field(default_factory=list)
    # Preemptions of either kind; ``num_swaps`` of them kept the KV in host memory.
    num_preemptions: int = 0
    num_swaps: int = 0
    # Tokens whose KV was computed, dropped by a recompute preemption, and must be computed again.
    num_recompute_tokens: int = 0
    # Proposed tokens computed and then discarded (speculative decoding's wasted work), and
    # those accepted: together, every proposal checked for this request.
    num_rejected_tokens: int = 0
    num_accepted_tokens: int = 0
    # Sampling seed fixed at creation (drawn at random when the request gave none), so that
    # seeded randomness is keyed by (seed, position) and independent of the batch.
    sampling_seed: int = 0
    # Set when the request ends with FINISHED_ERROR: a stable code and a human message.
    error_code: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must have at least one token")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer of milliseconds or None, got {value!r}")
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def fair_key(self) -> str:
        """The fair-share group: ``share_group``, or the tenant when it has none."""
        return self.tenant if self.share_group is None else self.share_group

    @property
    def interactive(self) -> bool:
        """Whether the request has a latency target (else it is bulk)."""
        return self.slo_ttft_ms is not None or self.slo_tpot_ms is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (a stop string matched inside a
        run of tokens from one step). Computed tokens are capped at what is left, so a block that
        is cached when the request ends holds only kept tokens."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop:]
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.all_token_ids))
