"""The step-cost model of `mqinfer plan`: how long one engine step takes, from the shape of its batch.

One step's seconds are a linear function of five features::

    step_s = step_s_fixed                       # per step: scheduling, launching, sampling set-up
           + token_s        * tokens            # every token the step runs (linear layers)
           + seq_s          * seqs              # every request scheduled (metadata, a sampled row)
           + pair_s         * pairs             # attention of prompt chunks: causal (query, key) pairs
           + decode_ctx_s   * decode_context    # attention of decode tokens: their context lengths

``pairs`` sums, over the prompt chunks of the step (more than one token), the pairs of a chunk of
``n`` tokens ending at context length ``ctx``: ``n * ctx - n * (n - 1) / 2``, the same count the
cost meter splits a step by (workers/queue/costs.py); a prompt of ``L`` tokens has about ``L * L / 2``.
``decode_context`` sums the context lengths of the decode tokens (one-token chunks). The two are
apart because they cost differently per pair: a prompt's attention is a dense matrix product, a
decode token's reads its whole context from paged KV blocks for one query.

The coefficients are fitted by non-negative least squares on *relative* errors, so that a
2 ms decode step weighs as much as a 300 ms prefill step: TPOT is made of the small steps and
TTFT of the large ones, and the plan needs both. Measured steps whose residual is far from the
rest (a step that another process on the machine slowed down) are dropped and the fit is
repeated once.

Around the engine, :class:`WorkerLoop` is the worker loop as measured on the real pipeline: the
gaps between steps, the flushes of result rows, the wake-up on an arrival, the spread of step
times and a fresh worker's slow first steps, each kept as measured samples to draw from.

A fitted model is stored as JSON under the cache folder (``plan/<model-hash>-<machine>.json``,
see :func:`fit_path`), with what it was measured on, so that later plans reuse it. No torch here.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = ("step", "tokens", "seqs", "pairs", "decode_context")
# StepCostModel's coefficients, one per feature.
COEFFICIENTS = ("step_s_fixed", "token_s", "seq_s", "pair_s", "decode_ctx_s")
# Stored fits of another format version are not read (the user is told to calibrate again).
FIT_VERSION = 8
# Measured samples kept in a stored fit, at most (evenly spaced order statistics of the measured).
MAX_SAMPLES = 200


def chunk_pairs(num_tokens: int, context_len: int) -> float:
    """Causal (query, key) pairs of a chunk of ``num_tokens`` tokens that ends at ``context_len``."""
    return num_tokens * context_len - num_tokens * (num_tokens - 1) / 2


@dataclass(frozen=True)
class StepShape:
    """What one step's time depends on: its batched tokens, its requests, the attention pairs of its
    prompt chunks and the context lengths of its decode tokens."""

    tokens: int
    seqs: int
    pairs: float
    decode_context: int = 0

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> "StepShape":
        """The shape of a step that runs each ``(num_tokens, context_len)`` chunk (one per request)."""
        tokens = seqs = decode_context = 0
        pairs = 0.0
        for n, ctx in chunks:
            tokens += n
            seqs += 1
            if n == 1:
                decode_context += ctx
            else:
                pairs += chunk_pairs(n, ctx)
        return cls(tokens, seqs, pairs, decode_context)

    def features(self) -> tuple[float, float, float, float, float]:
        return (1.0, float(self.tokens), float(self.seqs), float(self.pairs), float(self.decode_context))


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per step as a linear function of :class:`StepShape` (coefficients >= 0)."""

    step_s_fixed: float
    token_s: float
    seq_s: float
    pair_s: float
    decode_ctx_s: float = 0.0

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"step cost coefficient {name} must be a finite number >= 0, got {value!r}")

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.step_s_fixed, self.token_s, self.seq_s, self.pair_s, self.decode_ctx_s)

    def scaled(self, factor: float) -> "StepCostModel":
        """This model with every step ``factor`` times as long (a machine running slower or faster)."""
        return StepCostModel(*(getattr(self, name) * factor for name in COEFFICIENTS))

    def step_seconds(self, shape: StepShape) -> float:
        return (self.step_s_fixed + self.token_s * shape.tokens + self.seq_s * shape.seqs
                + self.pair_s * shape.pairs + self.decode_ctx_s * shape.decode_context)


@dataclass(frozen=True)
class StepSample:
    """One measured step: its shape and its wall seconds."""

    shape: StepShape
    seconds: float


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0`` (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        for _ in range(max_iter):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back to the boundary: the passive variable that hits zero first leaves.
            shrink = passive & (z <= 0)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass(frozen=True)
class FitQuality:
    """How well the model explains the steps it was fitted on (relative errors)."""

    num_steps: int
    num_dropped: int  # outliers left out of the final fit
    median_abs_rel_error: float
    p90_abs_rel_error: float


def fit_step_costs(samples: Sequence[StepSample], outlier_factor: float = 4.0) -> tuple[StepCostModel, FitQuality]:
    """The non-negative coefficients that minimise the steps' squared relative errors.

    Steps whose relative residual is more than ``outlier_factor`` median absolute deviations
    from the median are dropped, and the fit repeated once on the rest.
    """
    usable = [s for s in samples if s.seconds > 0]
    if len(usable) < len(FEATURES):
        raise ValueError(f"a step-cost fit needs at least {len(FEATURES)} measured steps, got {len(usable)}")
    x = np.array([s.shape.features() for s in usable], dtype=float)
    t = np.array([s.seconds for s in usable], dtype=float)
    # Columns scaled to comparable sizes (pairs run to millions) so that the solver's tolerance holds.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)

    def solve(keep: np.ndarray) -> np.ndarray:
        a = (x[keep] / scale) / t[keep, None]
        return nnls(a, np.ones(int(keep.sum()))) / scale

    keep = np.ones(len(t), dtype=bool)
    coef = solve(keep)
    rel = (x @ coef - t) / t
    center = np.median(rel)
    spread = np.median(np.abs(rel - center)) or 1e-12
    keep = np.abs(rel - center) <= outlier_factor * spread
    if keep.sum() >= len(FEATURES) and not keep.all():
        coef = solve(keep)
    rel = np.abs((x[keep] @ coef - t[keep]) / t[keep])
    quality = FitQuality(int(keep.sum()), int((~keep).sum()), float(np.median(rel)), float(np.percentile(rel, 90)))
    return StepCostModel(*(float(max(0.0, c)) for c in coef)), quality


# -- the worker loop around the engine -----------------------------------------------------------
@dataclass(frozen=True)
class WorkerLoop:
    """The worker loop around the engine, as measured on the real pipeline: what the simulation
    adds to the modelled engine steps. Each sample list is a measured distribution, one value drawn
    per use; an empty list draws 0 (1 for the noise factor). The default is no loop at all: steps
    back to back, flushes free, wake-ups instant."""

    # Added to every step's gap: what the measured gaps leave out (may be negative, down to the
    # smallest gap, when the worker's steps ran faster than the fit).
    step_overhead_s: float = 0.0
    gap_samples_s: Sequence[float] = ()  # between two steps of a busy worker, flushes apart
    wake_samples_s: Sequence[float] = ()  # a worker blocked on the stream acting on an arrival
    flush_samples_s: Sequence[float] = ()  # one flush of buffered rows, acks included
    step_noise: Sequence[float] = ()  # measured / modelled seconds of repeated engine steps
    first_step_s: float = 0.0  # extra seconds on a fresh worker's first step
    # How much slower an engine step runs while other workers on the same machine are in a step
    # of their own (they share the cores, caches and memory bandwidth): entry k-1 for k others;
    # past the last entry, the last. Empty: workers do not slow each other down.
    contention: Sequence[float] = ()
    # A worker's own steps, measured over modelled seconds, by the step's modelled size: bin i
    # holds the steps modelled below step_noise_bounds_s[i] (and at or above the bound before it);
    # the last bin, the rest. When given, they replace step_noise: how much slower a step runs in a
    # worker than back to back on an engine alone depends on its size.
    step_noise_bounds_s: Sequence[float] = ()
    step_noise_by_size: Sequence[Sequence[float]] = ()
    # How slow a worker's steps ran, in the order they ran: each step's rank within its size bin,
    # 0 the fastest, 1 the slowest. Slow steps can come in runs (the machine slows down for a
    # while), which independent draws do not reproduce; the simulation walks this series in
    # stretches of step_noise_block_steps steps, each from a random point of it, and takes each
    # step's factor from its bin at the walked rank.
    step_noise_series: Sequence[float] = ()
    step_noise_block_steps: int = 0
    # The median modelled seconds of the largest bin's steps. What makes a worker's step slower
    # than the engine alone's (the loop's reads, writes and acks between steps leave the caches
    # colder) costs about the same time whatever the step's size: a step modelled longer than this
    # takes the extra seconds a step of this size took, not the same share (the offline job's
    # large steps ran at the engine-alone speed). 0: every step takes its factor as drawn.
    step_noise_top_s: float = 0.0
    # What the gap before a step adds for each request that finished in the step before it (its
    # rows and cost built, its reply sent) and for each request the step starts (its entry read,
    # decoded, checked and admitted); gap_samples_s then hold the rest of each gap. A loop at a
    # higher request rate than the calibration's spends more of its time between steps.
    gap_per_finished_s: float = 0.0
    gap_per_started_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gap_samples_s", "wake_samples_s", "flush_samples_s", "step_noise", "contention",
                     "step_noise_bounds_s"):
            values = tuple(float(v) for v in getattr(self, name))
            if any(not v >= 0 for v in values):
                raise ValueError(f"WorkerLoop.{name} must hold numbers >= 0")
            object.__setattr__(self, name, values)
        bins = tuple(tuple(float(v) for v in samples) for samples in self.step_noise_by_size)
        if any(not v >= 0 for samples in bins for v in samples):
            raise ValueError("WorkerLoop.step_noise_by_size must hold numbers >= 0")
        if bins and len(bins) != len(self.step_noise_bounds_s) + 1:
            raise ValueError("WorkerLoop.step_noise_by_size needs one bin more than step_noise_bounds_s")
        object.__setattr__(self, "step_noise_by_size", bins)
        series = tuple(float(u) for u in self.step_noise_series)
        if any(not 0.0 <= u <= 1.0 for u in series):
            raise ValueError("WorkerLoop.step_noise_series must hold ranks in [0, 1]")
        if series and not (bins and self.step_noise_block_steps >= 1):
            raise ValueError("WorkerLoop.step_noise_series needs step_noise_by_size and a step_noise_block_steps >= 1")
        object.__setattr__(self, "step_noise_series", series)
        for name in ("step_noise_top_s", "gap_per_finished_s", "gap_per_started_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.first_step_s >= 0:
            raise ValueError(f"first_step_s must be >= 0, got {self.first_step_s!r}")

    def scaled_noise(self, factor: float, modelled_s: float) -> float:
        """A drawn factor for a step modelled at ``modelled_s``, as its extra seconds at the
        largest bin's size (step_noise_top_s) when the step is larger."""
        top = self.step_noise_top_s
        if top <= 0 or modelled_s <= top:
            return factor
        return 1.0 + (factor - 1.0) * top / modelled_s

    def noise_for(self, modelled_s: float) -> Sequence[float]:
        """The measured/modelled ratios to draw a step's factor from, for a step modelled at
        ``modelled_s`` seconds."""
        if not self.step_noise_by_size:
            return self.step_noise
        return self.step_noise_by_size[bisect.bisect_right(self.step_noise_bounds_s, modelled_s)]

    def contention_factor(self, others_busy: int) -> float:
        """The slowdown of a step that starts while ``others_busy`` other workers of its machine
        are in a step."""
        if others_busy <= 0 or not self.contention:
            return 1.0
        return self.contention[min(others_busy, len(self.contention)) - 1]

    @property
    def mean_gap_s(self) -> float:
        gaps = self.gap_samples_s
        return self.step_overhead_s + (sum(gaps) / len(gaps) if gaps else 0.0)

    @property
    def mean_wake_s(self) -> float:
        wakes = self.wake_samples_s
        return sum(wakes) / len(wakes) if wakes else 0.0


def quantile_samples(values: Iterable[float], limit: int = MAX_SAMPLES) -> list[float]:
    """``values`` sorted, thinned to at most ``limit`` evenly spaced order statistics (the smallest
    and largest kept): a distribution to draw from, small enough to store."""
    ordered = sorted(float(v) for v in values)
    if len(ordered) <= limit:
        return ordered
    last = len(ordered) - 1
    return [ordered[round(i * last / (limit - 1))] for i in range(limit)]


# -- the stored fit ------------------------------------------------------------------------------
@dataclass
class Calibration:
    """A fitted step-cost model with what it was measured on and what else the plan needs."""

    model: StepCostModel
    quality: FitQuality
    # Seconds from a worker process's start to its being ready to read (imports, model load, KV cache).
    startup_s: float
    # The engine's own sizes as calibrated: KV blocks (as the worker would size them), block size,
    # context limit, and the step limits the KV sizing assumed.
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    # What the fit is valid for.
    model_id: str
    device: str
    num_threads: int | None
    machine: dict[str, Any] = field(default_factory=dict)
    measured_at: str = ""
    calibration_s: float = 0.0
    # The worker loop around the engine, measured on a short run of the real pipeline (see
    # WorkerLoop; seconds, samples sorted): the steady gap between two steps, flushes apart; the
    # seconds added to every step that the gaps leave out (metering; negative when the worker's
    # steps ran faster than the fit); a blocked worker's wake-up on an arrival, beyond the batcher's
    # wait; one flush of rows; measured over modelled seconds of repeated engine steps (and of a
    # worker's own steps by their size, step_noise_by_size); and a fresh worker's extra seconds in
    # its first steps.
    gap_samples_s: list[float] = field(default_factory=list)
    step_overhead_s: float = 0.0
    wake_samples_s: list[float] = field(default_factory=list)
    flush_samples_s: list[float] = field(default_factory=list)
    step_noise: list[float] = field(default_factory=list)
    first_step_s: float = 0.0
    # Where startup_s came from: "worker" (the startup cost row of a real worker) or "engine" (a
    # process that only builds the engine, when the pipeline run was left out).
    startup_source: str = "engine"
    # A step's slowdown while 1, 2, ... other workers of this machine run steps too (WorkerLoop);
    # measured only where several workers of this layout share a machine's cores.
    contention: list[float] = field(default_factory=list)
    step_noise_bounds_s: list[float] = field(default_factory=list)
    step_noise_by_size: list[list[float]] = field(default_factory=list)
    step_noise_series: list[float] = field(default_factory=list)  # WorkerLoop's
    step_noise_block_steps: int = 0
    step_noise_top_s: float = 0.0
    gap_per_finished_s: float = 0.0  # WorkerLoop's
    gap_per_started_s: float = 0.0
    version: int = FIT_VERSION

    @property
    def loop(self) -> WorkerLoop:
        """The worker loop the simulation runs around the engine."""
        return WorkerLoop(self.step_overhead_s, self.gap_samples_s, self.wake_samples_s, self.flush_samples_s,
                          self.step_noise, self.first_step_s, self.contention, self.step_noise_bounds_s,
                          self.step_noise_by_size, self.step_noise_series, self.step_noise_block_steps,
                          self.step_noise_top_s, self.gap_per_finished_s, self.gap_per_started_s)

    def to_json(self) -> str:
        out = asdict(self)
        out["model"] = asdict(self.model)
        out["quality"] = asdict(self.quality)
        return json.dumps(out, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        if data.get("version") != FIT_VERSION:
            raise ValueError(f"calibration format {data.get('version')!r}, expected {FIT_VERSION}")
        data["model"] = StepCostModel(**data["model"])
        data["quality"] = FitQuality(**data["quality"])
        return cls(**data)


def cache_dir() -> Path:
    """``$MQINFER_CACHE_DIR`` or ``$XDG_CACHE_HOME/mqinfer`` or ``~/.cache/mqinfer`` (as the bench's)."""
    from mqinfer.loadgen.checkpoint import default_cache_dir

    return default_cache_dir()


def model_fingerprint(model: str) -> str:
    """A short hash that changes when the model does: ``tiny`` itself, else the checkpoint's config
    and weight files' names and sizes (a GGUF file: its path, size and modification time)."""
    h = hashlib.sha256()
    if model == "tiny":
        h.update(b"tiny")
    else:
        path = Path(model).expanduser().resolve()
        h.update(str(path).encode())
        if path.is_file():
            st = path.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        elif path.is_dir():
            config = path / "config.json"
            if config.exists():
                h.update(config.read_bytes())
            for f in sorted(path.glob("*.safetensors")):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
        else:
            raise FileNotFoundError(f"--model {model}: no such checkpoint folder or file")
    return h.hexdigest()[:12]


def processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return os.uname().machine


def machine_key(device: str, num_threads: int | None, cores: int, accelerator: str | None = None) -> str:
    """A file-name-safe name for this machine and worker layout: the processor (or accelerator),
    the usable cores, the device and the threads per worker."""
    name = accelerator or processor_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    return f"{slug}-{cores}c-{device}-t{num_threads or 'default'}"


def fit_path(model: str, engine_key: str, machine: str) -> Path:
    """Where the fit for ``model`` (with ``engine_key``: dtype, quantization, KV cache dtype) on
    ``machine`` is stored."""
    digest = hashlib.sha256(f"{model_fingerprint(model)}|{engine_key}".encode()).hexdigest()[:12]
    return cache_dir() / "plan" / f"{digest}-{machine}.json"


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Written to a temporary file and renamed: a plan never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(calibration.to_json())
    os.replace(tmp, path)


def load_calibration(path: Path) -> Calibration | None:
    """The stored fit at ``path``; None when there is none or it cannot be read."""
    try:
        return Calibration.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def now_text() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


# At most this many busy engines beside the timed one; the factors in between are interpolated.
_MAX_CONTENTION_PROBES = 7


def contention_probes(config) -> int:
    """How many other engines to run beside the timed one: the other workers of this layout that
    one machine holds (CPU only; on a GPU each worker has a device of its own)."""
    from mqinfer.workers.devices import usable_cores

    if not str(config.device or "cpu").startswith("cpu"):
        return 0
    per_worker = (config.num_threads or 1) * (config.tensor_parallel_size or 1) * (config.pipeline_parallel_size or 1)
    return min(usable_cores() // per_worker - 1, _MAX_CONTENTION_PROBES)
