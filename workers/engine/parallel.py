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
It starts ranks ``1..T-1`` as child processes (``python -m mqinfer.workers.engine.tp_rank``; the processes'
side is ``workers/engine/ranks.py``) that die
with it, meets them in a process group (NCCL on CUDA, gloo on CPU) through a file store in a
temporary folder, and sends them its engine settings; each loads only its slices of the weights
(``safe_open`` + ``get_slice``). Every step rank 0 sends the step's plan (block copies, token ids,
query and context lengths, block tables, the rows that sample) as plain data, msgpack over each
rank's standard input, where a rank waits without a timeout however long the worker is idle; the
other ranks run the model on it and send back only their logits. They never touch Redis.

A rank that dies or fails makes rank 0's next collective fail (or its liveness check notice):
:class:`RankFailure` stops the worker, which exits without acking what it holds.

With pipeline parallelism (``workers/engine/pipeline.py``) the same ``Leader`` starts ``T x P`` ranks: rank
``r`` is tensor-parallel rank ``r mod T`` of stage ``r div T`` (:func:`rank_parts`), the collectives
run within each stage's group, and every rank gets every step's plan.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import msgspec
import torch

from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError

if TYPE_CHECKING:
    from mqinfer.workers.engine.ranks import Leader

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
PLAN_DECODER = msgspec.msgpack.Decoder(StepPlan)
_FRAME = struct.Struct("<I")


def write_frame(stream, message: msgspec.Struct | None) -> None:
    """One message on a pipe: its length, then its msgpack bytes (length 0: stop)."""
    data = b"" if message is None else _ENCODER.encode(message)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def read_frame(stream) -> bytes | None:
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


def init_group(init_method: str, rank: int, size: int, device: str, leader: "Leader | None" = None) -> Group:
    """Join the group: returns once every rank has joined."""
    import torch.distributed as dist

    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Group(rank, size, device, leader)


def use_device(device: str) -> None:
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


def rank_parts(rank: int, size: int, pipeline: int = 1) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """What rank ``rank`` of ``size`` loads, as ``load_model`` takes it: its (tensor-parallel rank,
    size) shard and its (stage, stages) pipeline stage, None for what the worker does not split.
    Rank ``r`` is tensor-parallel rank ``r mod T`` of stage ``r div T``."""
    tensor = size // pipeline
    return ((rank % tensor, tensor) if tensor > 1 else None), ((rank // tensor, pipeline) if pipeline > 1 else None)


__all__ = ["COLLECTIVE_TIMEOUT_S", "Group", "PLAN_DECODER", "RankFailure", "RankSettings", "Shard", "StepPlan",
           "init_group", "num_params", "rank_parts", "read_frame", "read_safetensors_shard", "use_device", "write_frame"]
