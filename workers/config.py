"""The worker's and the engine's settings: plain dataclasses with their defaults, checked when built.

Every default is written here once (the scheduler's limits once in SchedulerConfig, which the
engine's fields take as theirs). A field with ``flag(...)`` metadata is also a command-line flag:
mqinfer/config.py builds the `mqinfer worker` and `mqinfer run` options from these fields, so
``--help`` shows these defaults. No torch here, so the command line can check every flag (and
show every default) before it starts anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mqinfer.scheduler.config import (
    PREEMPTION_MODES, SchedulerConfig, format_tenant_weights, parse_tenant_weights,
)
from mqinfer.scheduler.slo import BULK_MAX_WAIT_S, format_tenant_slos, parse_tenant_slos
from mqinfer.schemas import keys
from mqinfer.schemas.cache_scope import PREFIX_CACHE_SCOPES, check_scope
from mqinfer.schemas.lanes import DEFAULT_LANES, DEFAULT_MAX_LANES, check_max_lanes, parse_lanes
from mqinfer.workers.devices import parse_device, parse_devices
from mqinfer.schemas.stream import MAX_ENTRY_BYTES
from mqinfer.workers.tenant_limits import TenantLimit, format_tenant_limits, parse_tenant_limits

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "w8a8", "w8a16")
# How the KV cache stores K and V (kernels/kv_quant.py, which holds the same tuple, owns what
# each means; this module stays free of torch).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# How KV tiers store the blocks of a cache in the model's dtype (workers/engine/kv_tiers.py): its own
# bytes, compressed, or quantized to int8.
KV_TIER_STORAGES = ("lossless", "int8")
# Speculative decoding's proposers.
SPECULATIVE = ("none", "ngram", "draft", "self")
SPECULATIVE_POLICIES = ("adaptive", "fixed")

# The scheduler's defaults, which the engine passes on to it unchanged.
_SCHEDULER = SchedulerConfig()


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line.

    ``name``: the flag's python name when it is not the field's (``preemption`` for
    ``preemption_mode``); ``parse``: text to value when the field's type does not say it.
    """

    help: str
    name: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None


def flag(help: str, **kwargs: Any) -> dict[str, Flag]:
    """``field(metadata=...)`` of a field that is also a command-line flag."""
    return {"flag": Flag(help, **kwargs)}


def tenant_weights_flag(text: str) -> str | None:
    """``--tenant-weights`` checked and written the one way (``a=2,b=1``); empty: None (no weights).
    ValueError names the bad entry."""
    weights = parse_tenant_weights(text)
    return format_tenant_weights(weights) if weights else None


def tenant_limits_flag(text: str) -> str | None:
    """``--tenant-limits`` checked and written the one way (``a=200:2,b=50``); empty: None (no
    limits). ValueError names the bad entry."""
    limits = parse_tenant_limits(text)
    return format_tenant_limits(limits) if limits else None


def tenant_slos_flag(text: str) -> str | None:
    """``--tenant-slos`` checked and written the one way (``a=500/50,b=2000/100``); empty: None (no
    targets). ValueError names the bad entry."""
    slos = parse_tenant_slos(text)
    return format_tenant_slos(slos) if slos else None


def parse_wait_ms(text: str) -> float | str:
    """Milliseconds, or ``auto`` (the batcher chooses its wait from arrival rate and step time)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected milliseconds or auto, got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="tiny", metadata=flag(
        "`tiny` (built-in smoke-test model), a local Hugging Face checkpoint folder, or a llama.cpp "
        "`.gguf` file (tokenizer and chat template from its metadata).", metavar="M"))
    device: str = field(default="auto", metadata=flag(
        "Where the model runs: auto (CUDA where a device exists, else cpu), cpu, cuda (device 0) or cuda:N. "
        "A device that does not exist is refused, naming those that do.", metavar="auto|cpu|cuda|cuda:N",
        parse=parse_device))
    devices: str | None = field(default=None, metadata=flag(
        "CUDA device indices to use, e.g. 0,1,2,3 (default: every CUDA device). `run` spreads its workers over "
        "them: worker i on device i mod count, or on T consecutive ones with --tensor-parallel-size T; a "
        "worker's tensor-parallel ranks run on them in order.", metavar="I,J,...", parse=parse_devices))
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "Split the model over T devices (T processes of one worker, over torch.distributed: NCCL on CUDA, gloo "
        "on CPU): attention heads, the MLP and the vocabulary are divided between the ranks, and so are the "
        "weights and the KV cache. The way to run a model too big for one device (with "
        "--pipeline-parallel-size, on more devices still). Heads, KV heads (or T over them) and the MLP width "
        "must divide by T.", metavar="T"))
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        "Split the model's layers into P stages, each its own process on its own device (over "
        "torch.distributed: NCCL on CUDA, gloo on CPU); the first stage also holds the embedding, the last "
        "the final norm and the LM head, and each stage the KV cache of its own layers only. Each step's "
        "requests run through the stages in micro-batches, so that stages work at once. With "
        "--tensor-parallel-size T a worker has T x P ranks (and devices): each stage is split over T. The "
        "model needs at least P layers.", metavar="P"))
    dtype: str = field(default="auto", metadata=flag(
        "Weight and activation dtype (auto = the checkpoint's own).", choices=DTYPES))
    quantization: str = field(default="none", metadata=flag(
        "8-bit weights for the decoder layers' projections (the embeddings stay in --dtype; for the LM head "
        "see --quantize-lm-head): "
        "w8a8 = int8 weights and per-token int8 activations with exact int32 sums, the fastest on CPU; "
        "w8a16 = int8 weights with activations in --dtype, a quarter of float32's weight memory; "
        "none = the checkpoint's weights as they are.", choices=QUANTIZATIONS))
    smoothquant_alpha: float = field(default=0.7, metadata=flag(
        "With --quantization w8a8: how much of the activations' outlier range moves into the weights "
        "(SmoothQuant's alpha, 0 to 1), calibrated at load on a short built-in text; 0 = off.", metavar="A"))
    quantize_lm_head: bool = field(default=True, metadata=flag(
        "With --quantization w8a8: the LM head in w8a8 as well (an int8 copy of its weight, one scale per "
        "vocabulary row, its input smoothed like the projections'; tied embeddings keep their table in "
        "--dtype). On small models the head is much of each step's work: on the standard benchmark model "
        "it ran about 2x faster than in bfloat16 on CPU, and it added 0.6% perplexity on "
        "SmolLM2-135M-Instruct (w8a8 +1.15% against bfloat16 instead of +0.55%). --no-quantize-lm-head "
        "keeps it in --dtype; the other --quantization modes always do."))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "KV cache storage: auto (the model's dtype), or int8 / fp8 (float8 e4m3) with a bfloat16 scale per "
        "token and KV head: 3.9x less KV memory than float32 (1.9x less than bfloat16), so more sequences "
        "fit, at a small cost in accuracy.", choices=KV_CACHE_DTYPES))
    block_size: int = field(default=_SCHEDULER.block_size, metadata=flag("Tokens per KV cache block.", metavar="B"))
    num_kv_blocks: int | None = field(default=None, metadata=flag(
        "KV cache blocks (default: sized from the model and memory).", metavar="K"))
    max_num_batched_tokens: int = field(default=_SCHEDULER.max_num_batched_tokens, metadata=flag(
        "Token budget of one engine step (prefill chunks + decodes); at least --max-num-seqs, so every "
        "running request can advance every step.", metavar="T"))
    max_num_seqs: int = field(default=_SCHEDULER.max_num_seqs, metadata=flag(
        "Requests running at once, at most.", metavar="S"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "Context length (default: the model's).", metavar="N"))
    enable_prefix_caching: bool = field(default=_SCHEDULER.enable_prefix_caching, metadata=flag(
        "Prefix caching: requests sharing a prompt prefix share its KV blocks.", name="prefix_cache"))
    prefix_cache_scope: str = field(default=_SCHEDULER.prefix_cache_scope, metadata=flag(
        "Who shares cached prompt KV, on the device and in every KV tier: tenant = only requests of the "
        "same tenant (and cache_salt), so that no tenant can tell from its time to first token or its "
        "cached_prompt_tokens whether another tenant sent the same prompt; global = every request of the "
        "same cache_salt (none: all of them), for a single-tenant fleet or where tenants may share.",
        choices=PREFIX_CACHE_SCOPES))
    # Seeds the sampling seeds drawn for requests that give none.
    seed: int = 0
    num_threads: int | None = field(default=None, metadata=flag(
        "CPU threads for the model (default: OMP_NUM_THREADS, else every core).", metavar="N"))
    enforce_eager: bool = field(default=False, metadata=flag(
        "Run every engine step eagerly. Without it, on a single CUDA device without speculative decoding, "
        "decode-only steps replay CUDA graphs captured at start-up, one per padded batch size (1, 2, 4, 8, "
        "then steps of 8 and 16 up to --max-num-seqs; the start-up log gives the capture time), and steps "
        "with prompt tokens run eagerly; on CPU every step is eager anyway."))
    preemption_mode: str = field(default=_SCHEDULER.preemption_mode, metadata=flag(
        "When KV blocks run out: recompute the preempted request later, or swap its KV to host memory "
        "and back.", name="preemption", choices=PREEMPTION_MODES))
    swap_space_gib: float = field(default=4.0, metadata=flag(
        "Host memory for swapped-out KV blocks (with --preemption swap).", metavar="G"))
    kv_host_cache_gib: float = field(default=0.0, metadata=flag(
        "KV tier in host memory: prompt KV blocks are copied here (stored as --kv-tier-storage says) as they "
        "are computed, and copied back into the KV cache, instead of being computed again, when a later prompt "
        "starts with them after the cache has evicted them; least recently used out first (0 = off).",
        metavar="G"))
    kv_disk_cache: str | None = field(default=None, metadata=flag(
        "KV tier on disk: a directory where prompt KV blocks are kept compressed, looked up after the host "
        "tier, shared by the workers given the same directory and kept across restarts. Created 0700 if "
        "missing; refused if it is a symlink, another user's, or writable by everyone. A block of another "
        "model or settings, or a damaged one, is never used.", metavar="DIR"))
    kv_disk_cache_gib: float = field(default=10.0, metadata=flag(
        "Size of --kv-disk-cache: past it the least recently used blocks are removed.", metavar="G"))
    kv_shared_cache: str | None = field(default=None, metadata=flag(
        "A second directory KV tier, looked up after --kv-disk-cache: storage several machines mount "
        "(off by default).", metavar="DIR"))
    kv_shared_cache_gib: float = field(default=50.0, metadata=flag(
        "Size of --kv-shared-cache.", metavar="G"))
    kv_tier_storage: str = field(default=KV_TIER_STORAGES[0], metadata=flag(
        "How the KV tiers store the blocks of a cache in the model's dtype (--kv-cache-dtype auto): lossless = "
        "the cache's own values, compressed in the disk and shared tiers, so a prefix copied back is bit for bit "
        "what was computed and outputs are those of a run without tiers; int8 = quantized to int8 with a "
        "bfloat16 scale per token and KV head, about a quarter of float32's bytes (half of bfloat16's), and a "
        "prefix copied back carries int8 rounding, so outputs may differ slightly. An int8 or fp8 cache is "
        "kept as its own bytes either way.", choices=KV_TIER_STORAGES))
    # None: strict priority (the flag also takes 0 for it).
    priority_aging_s: float | None = field(default=_SCHEDULER.priority_aging_s, metadata=flag(
        "Waiting this long is worth one priority level, so nothing starves (0 = strict priority).",
        metavar="S"))
    # Text as on the command line (`a=2,b=1`), so that it passes unchanged to child processes.
    tenant_weights: str | None = field(default=None, metadata=flag(
        "Fair share between tenants within a priority level: tenant=weight,tenant=weight (a tenant not "
        "named has weight 1); a tenant with weight 2 gets twice the token service of one with weight 1 "
        "when both have requests waiting.", metavar="T=W,...", parse=tenant_weights_flag))

    speculative: str = field(default="none", metadata=flag(
        "Speculative decoding: propose tokens cheaply and check them all in one step, keeping exactly the "
        "model's outputs (greedy and sampled alike). ngram = prompt lookup: what followed the last earlier "
        "occurrence of the request's latest tokens in its prompt and output; it pays off when outputs copy "
        "spans of their prompts. self = layer-skip self-speculation: the model's own first --draft-layers "
        "layers, its final norm and its head propose greedily (no second checkpoint). draft = a smaller "
        "checkpoint with the same tokenizer (--draft-model) proposes greedily over its own KV cache, which "
        "takes as many blocks as the model's and shares their block ids.", choices=SPECULATIVE))
    num_speculative_tokens: int = field(default=4, metadata=flag(
        "With --speculative: tokens proposed per request and step, at most.", metavar="K"))
    ngram_max: int = field(default=4, metadata=flag(
        "With --speculative ngram: the longest run of latest tokens looked up (tried first).", metavar="N"))
    ngram_min: int = field(default=2, metadata=flag(
        "With --speculative ngram: the shortest run of latest tokens looked up.", metavar="N"))
    draft_layers: int | None = field(default=None, metadata=flag(
        "With --speculative self: how many of the model's first layers the draft runs, between 1 and "
        "the model's layers less one (default: half of them, rounded down). Fewer layers propose "
        "faster and are accepted less often.", metavar="L"))
    draft_model: str | None = field(default=None, metadata=flag(
        "With --speculative draft: the draft checkpoint, in any form --model takes (a "
        "checkpoint folder, a .gguf file, tiny). Its vocabulary must be the model's (the same tokenizer); it "
        "runs unquantized on the model's device in the model's dtype, and its KV cache, in --kv-cache-dtype, "
        "counts against the memory that sizes the KV blocks.", metavar="M"))
    speculative_max_batched_tokens: int = field(default=_SCHEDULER.speculative_max_batched_tokens, metadata=flag(
        "With --speculative: propose only while a step's scheduled tokens (prefill chunks, decodes and "
        "proposals) stay at or below this many, so that a busy worker spends its steps on other requests "
        "instead.", metavar="T"))
    speculative_policy: str = field(default="adaptive", metadata=flag(
        "With --speculative, within that ceiling: adaptive = a request runs only the proposals expected to "
        "pay for themselves, judged from the worker's measured step times (a fixed part and a part per "
        "token) and the request's acceptance rate so far, so speculation fades as the worker fills up "
        "and for requests whose proposals keep failing; fixed = every request that can runs up to K "
        "proposals whatever its acceptance (for measuring a proposer).", choices=SPECULATIVE_POLICIES))

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model (a smaller checkpoint with the model's "
                             "tokenizer)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be at least 1, got {self.draft_layers}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be adaptive or fixed, got {self.speculative_policy!r}")
        if self.speculative_max_batched_tokens < 0:
            raise ValueError(
                f"speculative_max_batched_tokens must be >= 0, got {self.speculative_max_batched_tokens}")
        parse_device(self.device)  # raises ValueError naming the form expected
        if self.devices is not None:
            parse_devices(self.devices)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.speculative in ("self", "draft"):
            raise ValueError(f"--speculative {self.speculative} does not combine with --pipeline-parallel-size "
                             f"{self.pipeline_parallel_size} (the draft runs on one rank); use ngram or none")
        if self.pipeline_parallel_size > 1 and self.quantization != "none":
            raise ValueError(f"--quantization {self.quantization} does not combine with --pipeline-parallel-size "
                             f"{self.pipeline_parallel_size}; use --quantization none")
        if self.tensor_parallel_size > 1 and self.speculative in ("self", "draft"):
            raise ValueError(f"--speculative {self.speculative} does not combine with --tensor-parallel-size "
                             f"{self.tensor_parallel_size} (the draft runs on one rank); use ngram or none")
        if self.tensor_parallel_size > 1 and self.quantization != "none":
            raise ValueError(f"--quantization {self.quantization} does not combine with --tensor-parallel-size "
                             f"{self.tensor_parallel_size}; use --quantization none")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be none, w8a8 or w8a16, got {self.quantization!r}")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError(f"smoothquant_alpha must be between 0 and 1, got {self.smoothquant_alpha}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if not (self.swap_space_gib >= 0 and math.isfinite(self.swap_space_gib)):
            raise ValueError(f"swap_space_gib must be a finite number >= 0, got {self.swap_space_gib}")
        parse_tenant_weights(self.tenant_weights)  # raises ValueError naming a bad entry
        check_scope(self.prefix_cache_scope)
        self._check_kv_tiers()

    def _check_kv_tiers(self) -> None:
        if self.kv_tier_storage not in KV_TIER_STORAGES:
            raise ValueError(f"kv_tier_storage must be one of {', '.join(KV_TIER_STORAGES)}, "
                             f"got {self.kv_tier_storage!r}")
        for name in ("kv_host_cache_gib", "kv_disk_cache_gib", "kv_shared_cache_gib"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.kv_tiers_on and not self.enable_prefix_caching:
            raise ValueError("KV tiers (--kv-host-cache-gib, --kv-disk-cache, --kv-shared-cache) extend the "
                             "prefix cache: they need --prefix-cache")
        if self.kv_tiers_on and self.tensor_parallel_size > 1:
            raise ValueError("KV tiers do not combine with --tensor-parallel-size > 1 (each rank holds part of "
                             "every block)")

    @property
    def kv_tiers_on(self) -> bool:
        """Whether any KV tier below the device cache is configured."""
        return self.kv_host_cache_gib > 0 or bool(self.kv_disk_cache) or bool(self.kv_shared_cache)

    @property
    def tenant_weight_map(self) -> dict[str, float]:
        """``tenant_weights`` parsed: tenant -> weight."""
        return parse_tenant_weights(self.tenant_weights)


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str
    out_dir: Path
    engine: EngineConfig = field(default_factory=EngineConfig)
    stream: str = field(default="requests", metadata=flag(
        "Stream name S: requests go to key mqinfer:{S}.", metavar="S"))
    group: str = field(default=keys.GROUP, metadata=flag("Consumer group name.", metavar="G"))
    lanes: str = field(default=DEFAULT_LANES, metadata=flag(
        "Lanes: requests wait in one stream per tenant (tenant), per bulk job (job), per both (tenant,job), "
        "or all in the plain stream mqinfer:{S} (none). Producers put each request into its lane; workers "
        "read the plain stream and every lane, the lanes that have had the least service (by "
        "--tenant-weights) first, so that one tenant's or job's backlog does not hold the others back. "
        "A worker with none reads only the plain stream.", metavar="MODE", parse=parse_lanes))
    max_lanes: int = field(default=DEFAULT_MAX_LANES, metadata=flag(
        "At most this many lanes: past it, new tenants (or jobs) share a few hashed lanes. A worker reads "
        "at most this many.", metavar="N"))
    consumer: str | None = field(default=None, metadata=flag(
        "Consumer name (default: hostname-pid-random).", metavar="C"))
    max_batch: int = field(default=64, metadata=flag(
        "Dual-threshold batcher: release a batch at this many requests...", metavar="N"))
    # Milliseconds, or "auto": chosen from the arrival rate and step time (scheduler/batcher.py).
    max_wait_ms: float | str = field(default=10.0, metadata=flag(
        "...or this long after the oldest arrival, whichever comes first; `auto` chooses it from the "
        "arrival rate and step time.", metavar="T", parse=parse_wait_ms))
    claim_idle_ms: int = field(default=30_000, metadata=flag(
        "Take over another consumer's entries idle this long (it is presumed dead; live workers keep "
        "their entries fresh).", metavar="MS"))
    max_deliveries: int = field(default=3, metadata=flag(
        "After this many deliveries a request ends with an error row.", metavar="N"))
    idle_exit_s: float | None = field(default=None, metadata=flag(
        "Exit 0 after this many seconds with nothing to do (default: never).", metavar="S"))
    redis_wait_s: float = field(default=60.0, metadata=flag(
        "At start, wait this long for Redis to answer (a server still starting, or not there yet), then "
        "stop with an error.", metavar="S"))
    metrics_port: int | None = field(default=None, metadata=flag(
        "Serve Prometheus metrics, /healthz and /readyz on this port.", metavar="P"))
    metrics_host: str = field(default="127.0.0.1", metadata=flag(
        "Address the metrics endpoint binds to.", metavar="ADDR"))
    price_per_device_hour: float = field(default=1.0, metadata=flag(
        "Price of one device hour in USD, for cost_usd. A CPU machine is one device.", metavar="USD"))
    device_share: float | None = field(default=None, metadata=flag(
        "How much of a priced device this worker bills (its cost rows' device_s is its wall time times F). "
        "Default: on CUDA one device per tensor-parallel rank; on a CPU its threads (all its ranks') over "
        "the usable cores, at most 1. `mqinfer run` gives each of its workers its share of the machine.",
        metavar="F"))
    flush_rows: int = field(default=256, metadata=flag(
        "Write Parquet part files once this many rows are pending...", metavar="N"))
    flush_interval_s: float = field(default=0.5, metadata=flag(
        "...or once the oldest pending row is this old.", metavar="S"))
    drain_timeout_s: float = field(default=30.0, metadata=flag(
        "On SIGTERM, finish running requests for at most this long, then hand the rest back.", metavar="S"))
    reply_maxlen: int = field(default=100_000, metadata=flag(
        "Reply streams keep about this many messages at most.", metavar="N"))
    reply_ttl_s: int = field(default=3600, metadata=flag(
        "Reply streams expire this long after their last message.", metavar="S"))
    redis_cluster: bool = field(default=False, metadata=flag(
        "--redis is a seed node of a Redis Cluster (keys are hash-tagged per stream; rq bulk jobs need a "
        "plain server)."))
    budgets: Path | None = field(default=None, metadata=flag(
        "TOML file of budgets (period, default_usd, thresholds, [tenants], [jobs], [metadata.KEY] tables of "
        "VALUE = USD; docs/costs.md); exports budget, spend and warning-threshold metrics per group.",
        metavar="FILE"))
    enforce_budgets: bool = field(default=False, metadata=flag(
        "Refuse new requests of a tenant, job or metadata group whose budget is spent: they end with "
        "error_code budget_exceeded. Needs --budgets."))
    idempotency_ttl_s: float = field(default=86_400.0, metadata=flag(
        "Remember each request (job_id, id) this long, so that a producer's second copy is computed once, "
        "or refused if its content differs (0 = off).", metavar="S"))
    max_entry_bytes: int = field(default=MAX_ENTRY_BYTES, metadata=flag(
        "Largest stream entry accepted; a larger one ends as an error.", metavar="N"))
    max_tokens_limit: int | None = field(default=None, metadata=flag(
        "Largest max_tokens accepted; a larger request ends as an error (default: bounded only by the "
        "context length).", metavar="N"))
    # Text as on the command line (`a=200:2,b=50`), so that it passes unchanged to child processes.
    tenant_limits: str | None = field(default=None, metadata=flag(
        "Rate limits per tenant, held across every worker of the Redis server: "
        "tenant=tokens_per_s[:requests_per_s],... (a tenant not named is not limited). A request takes its "
        "prompt tokens plus its max_tokens from its tenant's bucket when it is admitted; the bucket holds one "
        "second of the rate. A request over the limit waits (other tenants' requests go past it) and ends "
        "with error_code rate_limited if its deadline passes first.", metavar="T=TOK[:REQ],...",
        parse=tenant_limits_flag))
    # Text as on the command line (`a=500/50`), so that it passes unchanged to child processes.
    tenant_slos: str | None = field(default=None, metadata=flag(
        "Latency targets per tenant, for its requests that set neither slo_ttft_ms nor slo_tpot_ms: "
        "tenant=TTFT_MS/TPOT_MS,... (time to first token from enqueue, and time per output token after it, "
        "in milliseconds; a tenant not named has none). A request with targets is interactive: while one "
        "runs, each step holds only the bulk decodes and prompt tokens that the worker's measured step times "
        "say fit within the tightest target (a bulk sequence still gets a token at least about every "
        f"{BULK_MAX_WAIT_S:g} s), "
        "and its result row's slo_met says whether the targets were met.", metavar="T=TTFT/TPOT,...",
        parse=tenant_slos_flag))
    interrupt_steps: bool = field(default=True, metadata=flag(
        "While a step runs, watch the streams (a blocking read on a second connection) and give the step up "
        "between two layers when a request with latency targets arrives, so that it does not wait for the rest "
        "of a long bulk step or of a planned one; the step's requests compute it again next. A step that moves "
        "interactive requests along is given up only before its middle layer, and at most twice in a row. Costs at most one partial step per such "
        "arrival. Off with --redis-cluster."))

    def __post_init__(self) -> None:
        auto_wait = isinstance(self.max_wait_ms, str) and self.max_wait_ms.strip().lower() == "auto"
        checks = [
            (self.max_batch >= 1, f"--max-batch must be >= 1, got {self.max_batch}"),
            (auto_wait or (not isinstance(self.max_wait_ms, str) and self.max_wait_ms >= 0),
             f"--max-wait-ms must be >= 0 or auto, got {self.max_wait_ms}"),
            (self.reply_maxlen >= 1 and self.reply_ttl_s >= 1, "reply_maxlen and reply_ttl_s must be >= 1"),
            (self.claim_idle_ms >= 100, f"--claim-idle-ms must be >= 100, got {self.claim_idle_ms}"),
            (self.max_deliveries >= 1, f"--max-deliveries must be >= 1, got {self.max_deliveries}"),
            (self.idle_exit_s is None or self.idle_exit_s >= 0, "--idle-exit-s must be >= 0"),
            (self.redis_wait_s > 0 and math.isfinite(self.redis_wait_s),
             f"--redis-wait-s must be a number of seconds > 0, got {self.redis_wait_s}"),
            (self.price_per_device_hour >= 0, "--price-per-device-hour must be >= 0"),
            (self.device_share is None or (self.device_share > 0 and math.isfinite(self.device_share)),
             f"--device-share must be a number > 0 (the devices this worker bills, e.g. 0.5 for half of a "
             f"CPU machine), got {self.device_share}"),
            (self.flush_rows >= 1, "--flush-rows must be >= 1"),
            (self.flush_interval_s >= 0, "--flush-interval-s must be >= 0"),
            (bool(self.stream) and "}" not in self.stream, f"invalid --stream {self.stream!r}"),
            (self.budgets is not None or not self.enforce_budgets, "--enforce-budgets needs --budgets FILE"),
            (self.idempotency_ttl_s >= 0, "--idempotency-ttl-s must be >= 0"),
            (self.max_entry_bytes >= 1024, f"--max-entry-bytes must be >= 1024, got {self.max_entry_bytes}"),
            (self.max_tokens_limit is None or self.max_tokens_limit >= 1, "--max-tokens-limit must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        parse_tenant_limits(self.tenant_limits)  # raises ValueError naming a bad entry
        parse_tenant_slos(self.tenant_slos)
        object.__setattr__(self, "lanes", parse_lanes(self.lanes))
        check_max_lanes(self.max_lanes)

    @property
    def tenant_limit_map(self) -> dict[str, TenantLimit]:
        """``tenant_limits`` parsed: tenant -> its limits."""
        return parse_tenant_limits(self.tenant_limits)

    @property
    def tenant_slo_map(self) -> dict[str, tuple[int, int]]:
        """``tenant_slos`` parsed: tenant -> (TTFT ms, TPOT ms)."""
        return parse_tenant_slos(self.tenant_slos)
