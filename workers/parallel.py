"""Tensor parallelism: one worker's model split over T ranks, each its own process.

The split (Megatron style, one all-reduce per attention block and one per MLP block):

* Attention: rank ``r`` holds query heads ``[r*H/T, (r+1)*H/T)`` and the KV heads they read,
  so its q/k/v projection is the matching rows (column-parallel), its paged KV cache holds only
  those KV heads, and its output projection is the matching columns (row-parallel); the partial
  outputs are summed by an all-reduce. With fewer KV heads than ranks (``Hkv < T``, ``T`` a
  multiple of ``Hkv``), each rank holds the one KV head its query heads read: every KV head is
  replicated on ``T / Hkv`` ranks, so a rank's KV cache is ``1/Hkv`` of the whole rather than
  ``1/T``. Otherwise ``Hkv`` must divide by ``T`` and each rank's KV cache is ``1/T``.
* MLP: gate and up are split by rows of the intermediate dimension (column-parallel), down by
  the same columns (row-parallel), then one all-reduce. Biases of the row-parallel projections
  are loaded on rank 0 only (zeros elsewhere), so the sum adds them once.
* Output head: rank ``r`` holds vocabulary rows ``[r*C, (r+1)*C)`` with ``C = ceil(V/T)``; the
  logits of the sampling rows are gathered on rank 0, which samples from the whole vocabulary
  exactly as one rank would (same seed, same tokens).
* Embedding and norms are replicated (every rank reads them in full).

Rank 0 is the worker process: it owns Redis, the batcher, the scheduler, the sinks and the acks.
It starts ranks ``1..T-1`` as child processes (``python -m mqinfer.workers.tp_rank``) that die
with it, meets them in a process group (NCCL on CUDA, gloo on CPU) through a file store in a
temporary folder, and sends them its engine settings; each loads only its slices of the weights
(``safe_open`` + ``get_slice``). Every step rank 0 sends the step's plan (block copies, token ids,
query and context lengths, block tables, the rows that sample) as plain data, msgpack over each
rank's standard input, where a rank waits without a timeout however long the worker is idle; the
other ranks run the model on it and send back only their logits. They never touch Redis.

A rank that dies or fails makes rank 0's next collective fail (or its liveness check notice):
:class:`RankFailure` stops the worker, which exits without acking what it holds.

With pipeline parallelism (``workers/pipeline.py``) the same ``Leader`` starts ``T x P`` ranks: rank
``r`` is tensor-parallel rank ``r mod T`` of stage ``r div T`` (:func:`rank_parts`), the collectives
run within each stage's group, and every rank gets every step's plan.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import msgspec
import torch

from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.heap import freeze_startup_heap
from mqinfer.workers.models.config import ModelConfig, ModelLoadError

log = logging.getLogger("mqinfer.parallel")

# How long a collective (inside a step, or joining the group) waits for the other ranks before it
# fails; a dead rank usually fails it at once (its sockets close).
COLLECTIVE_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the worker cannot go on."""


# ---------------------------------------------------------------------------------- the split
@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: the ranges of heads, KV heads, MLP width and vocabulary it holds."""

    rank: int
    size: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    # Vocabulary rows per rank before clipping to the vocabulary (the gathered logits' width per rank).
    vocab_chunk: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> "Shard":
        """The split for ``config`` over ``size`` ranks; ``ModelLoadError`` when it does not divide."""
        hq, hkv, t = config.num_heads, config.num_kv_heads, size
        if hq % t:
            raise ModelLoadError(f"tensor parallel size {t} must divide the {hq} attention heads")
        if hkv >= t:
            if hkv % t:
                raise ModelLoadError(f"tensor parallel size {t} must divide the {hkv} KV heads "
                                     "(or be a multiple of them)")
            kv = (rank * hkv // t, (rank + 1) * hkv // t)
        else:
            if t % hkv:
                raise ModelLoadError(f"tensor parallel size {t} must be a multiple of the {hkv} KV heads "
                                     "(or divide them)")
            first = rank * hkv // t  # the one KV head this rank's query heads read
            kv = (first, first + 1)
        if config.intermediate_size % t:
            raise ModelLoadError(f"tensor parallel size {t} must divide the MLP width {config.intermediate_size}")
        if config.vocab_size < t:
            raise ModelLoadError(f"tensor parallel size {t} exceeds the vocabulary ({config.vocab_size})")
        inter = config.intermediate_size // t
        chunk = -(-config.vocab_size // t)
        return cls(rank=rank, size=t, head_dim=config.head_dim,
                   q_heads=(rank * hq // t, (rank + 1) * hq // t), kv_heads=kv,
                   intermediate=(rank * inter, (rank + 1) * inter),
                   vocab=(min(rank * chunk, config.vocab_size), min((rank + 1) * chunk, config.vocab_size)),
                   vocab_chunk=chunk)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` as this rank's layers see it: its heads, KV heads and MLP width (the
        vocabulary stays whole: the embedding is replicated, the LM head sliced apart)."""
        return replace(config, num_heads=self.q_heads[1] - self.q_heads[0],
                       num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.intermediate[1] - self.intermediate[0])

    def slice_for(self, name: str) -> tuple[int, int, int] | str | None:
        """How this rank reads checkpoint tensor ``name``: ``(dim, start, stop)`` for a slice,
        ``"first"`` for a bias that rank 0 reads whole and the others hold as zeros, None for
        the whole tensor."""
        module, _, leaf = name.rpartition(".")
        proj = module.rpartition(".")[2]
        d = self.head_dim
        if proj == "q_proj":
            return 0, self.q_heads[0] * d, self.q_heads[1] * d
        if proj in ("k_proj", "v_proj"):
            return 0, self.kv_heads[0] * d, self.kv_heads[1] * d
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if proj in ("o_proj", "down_proj"):
            if leaf == "bias":
                return "first"
            cols = (self.q_heads[0] * d, self.q_heads[1] * d) if proj == "o_proj" else self.intermediate
            return (1, *cols)
        if name == "lm_head.weight":
            return (0, *self.vocab)
        return None

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor already in memory (the tiny model, GGUF files)."""
        how = self.slice_for(name)
        if how is None:
            return tensor
        if how == "first":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        dim, start, stop = how
        return tensor.narrow(dim, start, stop - start)


def read_safetensors_shard(path: str, shard: Shard, keep: Callable[[str], bool] | None = None):
    """(name, tensor) of one safetensors file, reading only ``shard``'s slices of the split
    tensors (``get_slice``: the other ranks' bytes are never read), and with ``keep`` only the
    tensors it keeps (a pipeline stage's)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as fh:
        for name in fh.keys():
            if keep is not None and not keep(name):
                continue
            how = shard.slice_for(name)
            if how is None:
                yield name, fh.get_tensor(name)
                continue
            part = fh.get_slice(name)
            if how == "first":
                if shard.rank == 0:
                    yield name, part[:]
                else:
                    yield name, torch.zeros(part.get_shape(), dtype=_SAFETENSORS_DTYPES[part.get_dtype()])
                continue
            dim, start, stop = how
            yield name, part[start:stop] if dim == 0 else part[:, start:stop]


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def num_params(config: ModelConfig) -> int:
    """Parameters of the whole (unsplit) model, as one rank would hold them."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    layer += (q + 2 * kv) * config.qkv_bias + h * config.o_bias + (2 * inter + h) * config.mlp_bias
    layer += 2 * d * config.qk_norm
    embed = config.vocab_size * h
    return embed * (1 if config.tie_word_embeddings else 2) + config.num_layers * layer + h


# ---------------------------------------------------------------------------------- the messages
class StepPlan(msgspec.Struct, array_like=True):
    """One step as plain data: everything a rank needs to run the model on it (positions and
    slot mapping follow from the lengths and block tables). Sent as msgpack."""

    swap_out: list[tuple[int, int]] = msgspec.field(default_factory=list)
    swap_in: list[tuple[int, int]] = msgspec.field(default_factory=list)
    input_ids: list[int] = msgspec.field(default_factory=list)
    query_lens: list[int] = msgspec.field(default_factory=list)
    seq_lens: list[int] = msgspec.field(default_factory=list)
    block_tables: list[list[int]] = msgspec.field(default_factory=list)
    # Packed row of the last token of each request that samples.
    sample_rows: list[int] = msgspec.field(default_factory=list)


class RankSettings(msgspec.Struct):
    """What rank 0 sends the other ranks at start: the engine's settings and threads per rank."""

    engine: EngineConfig
    num_threads: int


_ENCODER = msgspec.msgpack.Encoder()
_PLAN_DECODER = msgspec.msgpack.Decoder(StepPlan)
_FRAME = struct.Struct("<I")


def _write_frame(stream, message: msgspec.Struct | None) -> None:
    """One message on a pipe: its length, then its msgpack bytes (length 0: stop)."""
    data = b"" if message is None else _ENCODER.encode(message)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    """The next message's bytes; None for a stop or the end of the pipe (rank 0 is gone)."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    if not size:
        return None
    data = stream.read(size)
    return data if len(data) == size else None


# ---------------------------------------------------------------------------------- the group
def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class Group:
    """This process's view of the tensor-parallel group: the collectives the model and runner use
    (all-reduce, the logits' gather), which run only inside a step, when every rank is in it.
    Rank 0 also sends each step's plan to the other ranks, over their standard input: a rank
    waits there without any timeout however long the worker stays idle. A collective that fails
    (a rank died, or stopped answering for ``COLLECTIVE_TIMEOUT_S``) raises :class:`RankFailure`."""

    # How a failed collective is reported when no rank is seen to have exited.
    failure = "a tensor-parallel collective failed"

    def __init__(self, rank: int, size: int, device: str, leader: "Leader | None" = None,
                 process_group=None, root: int = 0) -> None:
        """``rank`` of ``size`` within the tensor-parallel group; ``process_group``: that group
        when it is not the whole world (a pipeline stage's), whose rank 0 is global rank ``root``."""
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.leader = leader
        self.process_group, self.root = process_group, root

    def check_alive(self) -> None:
        if self.leader is not None:
            self.leader.check_alive()

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0: the step's plan to every other rank."""
        self.leader.send(plan)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            self.dist.all_reduce(tensor, group=self.process_group)
        except RuntimeError as exc:
            raise self._lost(exc) from None

    def gather_logits(self, local: torch.Tensor, shard: Shard, vocab_size: int) -> torch.Tensor | None:
        """Each rank's ``[B, its vocabulary]`` logits; rank 0 gets the whole ``[B, vocab]``."""
        rows, width = local.shape[0], shard.vocab_chunk
        if local.shape[1] != width:  # the last rank's slice may be short: pad it to the common width
            padded = local.new_zeros(rows, width)
            padded[:, : local.shape[1]] = local
            local = padded
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            self.dist.gather(local, parts, dst=self.root, group=self.process_group)
        except RuntimeError as exc:
            raise self._lost(exc) from None
        return torch.cat(parts, dim=1)[:, :vocab_size] if self.rank == 0 else None

    def close(self) -> None:
        try:
            self.dist.destroy_process_group()
        except Exception:  # already torn down, or a peer is gone
            pass

    def _lost(self, exc: BaseException) -> RankFailure:
        """The failure of a collective, named by the rank that exited where rank 0 can tell."""
        for _ in range(20 if self.leader is not None else 0):  # a rank whose sockets closed is gone a moment later
            try:
                self.check_alive()
            except RankFailure as exited:
                return exited
            time.sleep(0.05)
        text = str(exc).splitlines()[0] if str(exc) else repr(exc)
        return RankFailure(f"{self.failure}: {text}")


def _init(init_method: str, rank: int, size: int, device: str, leader: "Leader | None" = None) -> Group:
    """Join the group: returns once every rank has joined."""
    import torch.distributed as dist

    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Group(rank, size, device, leader)


def _join(init_method: str, rank: int, size: int, pipeline: int, device: str,
          leader: "Leader | None" = None) -> Group:
    """Join the group of ``size`` ranks: one tensor-parallel group, or ``pipeline`` stages of them."""
    if pipeline == 1:
        return _init(init_method, rank, size, device, leader)
    from mqinfer.workers.pipeline import join_pipeline

    return join_pipeline(init_method, rank, size // pipeline, pipeline, device, leader)


def _use_device(device: str) -> None:
    """Take ``device`` for this process; ValueError when it cannot run here (checked before the
    rank joins the group, where a failure would keep the others waiting)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_backend_available(_backend(device)):
        raise ValueError(f"this PyTorch build has no {_backend(device)} backend for {device}")
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device {device} does not exist here")
        torch.cuda.set_device(index)


class Leader:
    """Rank 0: starts the other ranks, joins the group with them, sends them their messages (over
    their standard input) and hears from them when they are ready (over their standard output),
    and watches that they live. A rank that dies closes its pipes, so rank 0 never waits on it."""

    def __init__(self, devices: list[str], pipeline: int = 1) -> None:
        """``devices``: each rank's, in rank order; ``pipeline``: the pipeline stages they make
        (``workers/pipeline.py``), each of ``len(devices) / pipeline`` tensor-parallel ranks."""
        from mqinfer.procs import die_with_parent

        self.size = len(devices)
        self.pipeline, self.tensor = pipeline, len(devices) // pipeline
        if pipeline < 1 or self.tensor * pipeline != self.size:
            raise ValueError(f"{self.size} ranks do not make {pipeline} pipeline stages")
        self._dir = tempfile.mkdtemp(prefix="mqinfer-tp-")
        init = "file://" + os.path.join(self._dir, "rendezvous")
        self.procs: list[subprocess.Popen] = []
        self.group: Group | None = None
        try:
            _use_device(devices[0])
            for rank in range(1, self.size):
                argv = [sys.executable, "-P", "-m", "mqinfer.workers.tp_rank", "--init", init, "--rank", str(rank),
                        "--size", str(self.size), "--device", devices[rank], "--pipeline", str(pipeline)]
                # SIGKILL: a rank must not outlive its worker, whatever the worker was doing.
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   preexec_fn=die_with_parent(9)))
            self._hear("started")  # every rank has its device and is about to join
            self.group = _join(init, 0, self.size, pipeline, devices[0], self)
        except BaseException:
            self.close()
            raise

    def _hear(self, word: str) -> None:
        """Wait for a line ``word`` from every other rank, failing at once if one exits instead."""
        waiting = {proc.stdout.fileno(): rank for rank, proc in enumerate(self.procs, start=1)}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], 1.0)
            for fd in ready:
                rank = waiting.pop(fd)
                line = self.procs[rank - 1].stdout.readline().decode(errors="replace").strip()
                if line != word:
                    self.procs[rank - 1].wait(timeout=30)
                    self.check_alive()
                    raise RankFailure(f"{self.name(rank)} said {line!r} instead of {word!r}")
            if waiting:
                self.check_alive()

    def name(self, rank: int) -> str:
        """How messages name a rank: by its stage too when the worker is a pipeline."""
        if self.pipeline == 1:
            return f"tensor-parallel rank {rank}"
        return f"pipeline rank {rank} (stage {rank // self.tensor} of {self.pipeline})"

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"{self.name(rank)} exited with code {code}")

    def send(self, message: msgspec.Struct | None) -> None:
        """One message to every other rank (None: stop)."""
        for rank, proc in enumerate(self.procs, start=1):
            try:
                _write_frame(proc.stdin, message)
            except (BrokenPipeError, OSError) as exc:
                self.check_alive()
                raise RankFailure(f"{self.name(rank)} is gone ({exc})") from None

    def load(self, settings: RankSettings) -> None:
        """Send the other ranks the engine settings, so that they load their shards while this
        rank loads its own."""
        self.check_alive()
        self.send(settings)

    def ready(self, scheduler_config: SchedulerConfig) -> None:
        """Send the KV cache's size (the scheduler's settings) and wait until every rank has built
        its cache. ``RankFailure`` when one failed on the way (its log is above)."""
        self.send(scheduler_config)
        self._hear("ready")

    def close(self) -> None:
        """Tell the other ranks to stop, wait a little, then end those that remain."""
        group, self.group = self.group, None
        for proc in self.procs:
            try:
                _write_frame(proc.stdin, None)
                proc.stdin.close()
            except OSError:  # a rank is gone: nothing to tell it
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if group is not None:
            group.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def rank_parts(rank: int, size: int, pipeline: int = 1) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """What rank ``rank`` of ``size`` loads, as ``load_model`` takes it: its (tensor-parallel rank,
    size) shard and its (stage, stages) pipeline stage, None for what the worker does not split.
    Rank ``r`` is tensor-parallel rank ``r mod T`` of stage ``r div T``."""
    tensor = size // pipeline
    return ((rank % tensor, tensor) if tensor > 1 else None), ((rank // tensor, pipeline) if pipeline > 1 else None)


def follower_main(argv: list[str] | None = None) -> int:
    """A rank other than 0: join the group, load this rank's shard, then run every plan rank 0
    sends on standard input until it sends a stop or goes away."""
    import argparse

    from mqinfer.schemas import faults
    from mqinfer.workers.loader import load_model, resolve_dtype
    from mqinfer.workers.model_runner import ModelRunner

    parser = argparse.ArgumentParser(prog="mqinfer tensor-parallel rank")
    parser.add_argument("--init", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--pipeline", type=int, default=1)
    args = parser.parse_args(argv)
    # Rank 0 decides when this rank stops (it sends a stop, or goes away and takes this process
    # with it): a Ctrl-C reaching the whole process group must not end it before rank 0 has drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("MQINFER_LOG_LEVEL", "warning").upper(),
                        format=f"%(asctime)s rank {args.rank} %(levelname)s %(name)s: %(message)s")
    # Standard output is this rank's line to rank 0: keep it for that alone, and send whatever else
    # would print there (Python or native code) to standard error, the worker's log.
    inbox, outbox = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _use_device(args.device)
    outbox.write(b"started\n")
    outbox.flush()
    group = _join(args.init, args.rank, args.size, args.pipeline, args.device)
    data = _read_frame(inbox)
    if data is None:
        return 0
    settings = msgspec.msgpack.decode(data, type=RankSettings)
    config = settings.engine
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(settings.num_threads)
    shard, stage = rank_parts(args.rank, args.size, args.pipeline)
    model, info = load_model(config.model, device, config.dtype, shard=shard, stage=stage)
    data = _read_frame(inbox)
    if data is None:  # rank 0 failed while starting
        return 0
    scheduler_config = msgspec.msgpack.decode(data, type=SchedulerConfig)
    runner_class = ModelRunner
    if stage is not None:
        from mqinfer.workers.pipeline import StageRunner as runner_class
    runner = runner_class(model, info, scheduler_config, device, resolve_dtype(info.dtype),
                          kv_cache_dtype=config.kv_cache_dtype, group=group)
    freeze_startup_heap()
    outbox.write(b"ready\n")
    outbox.flush()
    with torch.inference_mode():
        while (data := _read_frame(inbox)) is not None:
            faults.hit("tp.rank_step")
            runner.run_plan(_PLAN_DECODER.decode(data))
    group.close()
    return 0


__all__ = ["Group", "Leader", "RankFailure", "RankSettings", "Shard", "StepPlan", "follower_main", "num_params",
           "rank_parts", "read_safetensors_shard"]
