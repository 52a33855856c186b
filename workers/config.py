"""The worker's and the engine's settings: plain dataclasses with their defaults, checked when built.

No torch here, so the command line can check every flag (and show every default) before it
starts anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mqinfer.schemas import keys
from mqinfer.schemas.stream import MAX_ENTRY_BYTES


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    # None: sized from memory (see _default_num_kv_blocks).
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Seeds the sampling seeds drawn for requests that give none.
    seed: int = 0
    # CPU threads for torch; None: OMP_NUM_THREADS when set, else every core this process may use.
    num_threads: int | None = None
    # "recompute" or "swap" (KV of preempted requests goes to swap_space_gib of host memory).
    preemption_mode: str = "recompute"
    swap_space_gib: float = 4.0
    # Seconds of waiting worth one priority level (see Scheduler); None: strict priority.
    priority_aging_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if not (self.swap_space_gib >= 0 and math.isfinite(self.swap_space_gib)):
            raise ValueError(f"swap_space_gib must be a finite number >= 0, got {self.swap_space_gib}")


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str
    out_dir: Path
    engine: EngineConfig = field(default_factory=EngineConfig)
    stream: str = "requests"
    group: str = keys.GROUP
    consumer: str | None = None
    max_batch: int = 64
    # Milliseconds, or "auto": chosen from the arrival rate and step time (scheduler/batcher.py).
    max_wait_ms: float | str = 10.0
    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    idle_exit_s: float | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    price_per_device_hour: float = 1.0
    flush_rows: int = 256
    flush_interval_s: float = 0.5
    drain_timeout_s: float = 30.0
    # Reply streams: about this many messages at most, expiring this long after the last one.
    reply_maxlen: int = 100_000
    reply_ttl_s: int = 3600
    # --redis is a seed node of a Redis Cluster.
    redis_cluster: bool = False
    # Per-tenant budgets (ops/budgets.py); with enforce_budgets a spent tenant's requests are refused.
    budgets: Path | None = None
    enforce_budgets: bool = False
    # 0: no idempotency records (a producer's duplicate is computed again).
    idempotency_ttl_s: float = 86_400.0
    max_entry_bytes: int = MAX_ENTRY_BYTES
    # None: max_tokens is bounded only by the context length.
    max_tokens_limit: int | None = None

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
            (self.price_per_device_hour >= 0, "--price-per-device-hour must be >= 0"),
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
