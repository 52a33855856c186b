"""One pipeline stage of a Llama-family model: a contiguous range of its decoder layers.

Stage ``s`` of ``P`` holds layers ``[start, stop)``: the layers split as evenly as they go, the
earlier stages taking one more where they do not divide (``Stage.of``). The first stage alone holds
the token embedding; the last alone holds the final norm and the LM head (with tied embeddings,
the embedding's rows serve as its head, so the last stage reads them as its head). Combined with
tensor parallelism each stage's layers and head are one rank's shard (``workers/engine/parallel.py``).

``StageModel.forward(inputs, positions, kv_caches, metadata)`` takes token ids on the first stage,
and on the others the residual stream the stage before sent; it returns the residual stream after
its last layer, or on the last stage the final normalised hidden states, whose rows that sample
go through ``compute_logits`` as the whole model's do. Between stages goes the residual stream
itself (each residual add is the same float add as in the whole model's fused add-and-norm), so P
stages compute what one model computes, bit for bit. ``kv_caches`` holds this stage's layers only.

Checkpoint tensors keep their Hugging Face names (``model.layers.<i>`` with the model's own
layer numbers); ``Stage.holds`` says which names a stage reads, so a loader reads only those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from mqinfer.kernels.attention import AttentionMetadata
from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError
from mqinfer.workers.engine.models.layers import Embedding, KVCaches, LMHead, RMSNorm
from mqinfer.workers.engine.models.llama import DecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from mqinfer.workers.engine.parallel import Shard

_LAYERS = "model.layers."
_EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``count``: decoder layers ``[start, stop)`` of the model."""

    index: int
    count: int
    start: int
    stop: int

    @classmethod
    def of(cls, num_layers: int, index: int, count: int) -> "Stage":
        """The layers of stage ``index`` of ``count``; ``ModelLoadError`` when there are fewer
        layers than stages."""
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"stage {index} of {count} does not exist")
        if count > num_layers:
            raise ModelLoadError(f"pipeline parallel size {count} exceeds the model's {num_layers} layers "
                                 "(each stage needs at least one)")
        base, extra = divmod(num_layers, count)
        start = index * base + min(index, extra)
        return cls(index=index, count=count, start=start, stop=start + base + (index < extra))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    def holds(self, name: str, tie_word_embeddings: bool = False) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this stage (names of no known part: yes,
        so that loading names what it cannot place)."""
        if name.startswith(_LAYERS):
            index = name[len(_LAYERS):].partition(".")[0]
            return not index.isdigit() or self.start <= int(index) < self.stop
        if name == _EMBED:
            return self.first or (self.last and tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.last
        return True

    def local_name(self, name: str) -> str:
        """``name`` as this stage's model spells it: its layers numbered from 0."""
        return self._renumber(name, -self.start)

    def global_name(self, name: str) -> str:
        """The checkpoint's name of this stage's parameter ``name``."""
        return self._renumber(name, self.start)

    @staticmethod
    def _renumber(name: str, offset: int) -> str:
        if not name.startswith(_LAYERS):
            return name
        index, _, rest = name[len(_LAYERS):].partition(".")
        return f"{_LAYERS}{int(index) + offset}.{rest}" if index.isdigit() else name


class _StageBackbone(nn.Module):
    """The backbone's parts a stage holds, under the whole backbone's names."""

    def __init__(self, config: ModelConfig, stage: Stage, dtype, device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device) if stage.first else None
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(stage.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device) if stage.last else None


class StageModel(LlamaForCausalLM):
    """A Llama-family causal LM's stage ``stage``: its layers (and embedding, or norm and head)."""

    def __init__(self, config: ModelConfig, stage: Stage, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_len: int | None = None,
                 shard: "Shard | None" = None) -> None:
        """``config``: the whole model's; ``shard``: this rank's tensor-parallel part of the stage."""
        nn.Module.__init__(self)
        device = torch.device(device)
        self.config, self.dtype, self.shard, self.stage = config, dtype, shard, stage
        local = shard.local_config(config) if shard is not None else config
        self.model = _StageBackbone(local, stage, dtype, device)
        self.lm_head = None
        if stage.last:
            rows = shard.vocab if shard is not None else (0, config.vocab_size)
            head = nn.Parameter(torch.empty(rows[1] - rows[0], config.hidden_size, dtype=dtype, device=device),
                                requires_grad=False)
            self.lm_head = LMHead(head)
        self._init_running(config, local, device, max_len)

    @property
    def _tied_head(self) -> bool:
        """Whether this stage's head is read from the embedding (tied, and the head not on the first stage)."""
        return self.config.tie_word_embeddings and self.stage.last and not self.stage.first

    # ------------------------------------------------------------------ running
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``inputs``: token ids ``[T]`` (first stage) or the residual stream ``[T, hidden]`` the
        stage before sent (updated in place); returns the residual stream after this stage's last
        layer (a tensor of its own: the buffers are reused by the next micro-batch while this one
        is sent), or on the last stage the final normalised hidden states."""
        h = self.embed(inputs) if self.stage.first else inputs
        return self.run_layers(h, positions, kv_caches, attn_metadata, final_norm=self.stage.last)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError(f"stage {self.stage.index} of {self.stage.count} has no LM head (the last stage has)")
        return self.lm_head(hidden, out)

    # ------------------------------------------------------------------ loading
    def checkpoint_weight_names(self) -> set[str]:
        names = {self.stage.global_name(name) for name in super().checkpoint_weight_names()}
        if self._tied_head:
            names.discard("lm_head.weight")
            names.add(_EMBED)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy this stage's checkpoint tensors (HF names, the model's layer numbers) into its
        parameters, passing over other stages' tensors; returns the names used."""
        loaded: set[str] = set()
        names: dict[str, str] = {}
        tie = self.config.tie_word_embeddings

        def ours():
            for name, tensor in weights:
                if not self.stage.holds(name, tie):
                    continue
                if name == _EMBED and self._tied_head:
                    self._load_tied_head(tensor)
                    loaded.add(name)
                    continue
                local = self.stage.local_name(name)
                names[local] = name
                yield local, tensor

        used = super().load_weights(ours())
        return loaded | {names[name] for name in used}

    def _load_tied_head(self, embedding: torch.Tensor) -> None:
        """The head's rows (this rank's vocabulary slice) out of the embedding table."""
        head = self.lm_head.weight
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(embedding.shape) != expected:
            raise ModelLoadError(f"checkpoint tensor {_EMBED!r} has shape {tuple(embedding.shape)}, "
                                 f"the model expects {expected}")
        start = self.shard.vocab[0] if self.shard is not None else 0
        self.lm_head.packed = None
        head.data.copy_(embedding.narrow(0, start, head.shape[0]))


__all__ = ["Stage", "StageModel"]
