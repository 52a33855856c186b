"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the packed flat batch.

Owns the network: grouped-query attention over the paged KV cache, the SwiGLU MLP, the decoder
layer and the model, and the mapping from Hugging Face checkpoint tensor names onto our fused
layout (q/k/v in one projection, gate/up in one), which halves the number of matmuls per layer.
Its building blocks (projections, LM head, embedding, RMSNorm, activation buffers) are in
``layers.py``; rotary embeddings (default, linear and Llama-3 frequency scaling) in ``rotary.py``.

``forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]`` runs
every scheduled token of every sequence at once (no padding); ``compute_logits`` then runs
the LM head on only the rows that sample. Its decoder layers run in ``run_layers``, which runs
any range of them over a residual stream: a pipeline stage (``stage.py``) runs its own range there.
With ``interrupt`` set (a callable), ``run_layers`` asks it before each layer and raises
:class:`StepInterrupted` when it answers true: the engine's way to give up a long bulk step when an
interactive request arrives (workers/engine/core.py).

Numerics follow the reference implementation where it matters for exact agreement: RMSNorm
in float32 then cast back before the weight, rotary tables in float32 cast to the activation
dtype, residual adds in the activation dtype.

On CPU the elementwise steps run as fused native kernels (``kernels/cpu_ops.py``): each
residual add inside the RMSNorm that follows it, SiLU * up in one pass, and rotary written
straight into the KV cache. They round exactly where the PyTorch ops do, so the results are
the same bit for bit (``MQINFER_CPU_OPS=torch`` runs the PyTorch ops instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from mqinfer.kernels import cpu_ops
from mqinfer.kernels.attention import AttentionMetadata, paged_attention, store_kv
from mqinfer.kernels.kv_quant import LayerKVCache
from mqinfer.workers.engine.models.config import ModelConfig, ModelLoadError
from mqinfer.workers.engine.models.decoder_chain import DecoderChain
from mqinfer.workers.engine.models.layers import (Activations, Embedding, KVCaches, Linear, LMHead, RMSNorm,
                                           StepInterrupted, activation_buffer, amx_swiglu_weight, amx_weight,
                                           empty_param, onednn_weight)
from mqinfer.workers.engine.models.rotary import RotaryEmbedding, RotaryInputs, rotate_half

if TYPE_CHECKING:
    from mqinfer.workers.engine.parallel import Shard


def _attention_kernels(device) -> tuple:
    """(store_kv, paged_attention) for a device: the Triton kernels on a CUDA device when
    triton imports, else the PyTorch path (same arguments, same results)."""
    if torch.device(device).type == "cuda":
        try:
            from mqinfer.kernels import triton_attention
        except ImportError:  # no triton for this platform: the PyTorch path also runs on CUDA
            pass
        else:
            return triton_attention.store_kv, triton_attention.paged_attention
    return store_kv, paged_attention


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.store_kv, self.paged_attention = _attention_kernels(device)
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.qkv_bias, dtype, device)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_bias, dtype, device)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryInputs,
        kv: LayerKVCache,
        metadata: AttentionMetadata,
        buffers: Activations | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, activation_buffer(buffers, "qkv", num_tokens, self.qkv_proj.out_features, x))
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
        qk = qk.view(num_tokens, hq + hkv, d)
        v = v.view(num_tokens, hkv, d)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        k_cache, v_cache, k_scale, v_scale = kv
        if self.store_kv is store_kv and (
            cpu_ops.native_for(qk, k_cache) or (kv.quantized and cpu_ops.native_for(qk) and k_cache.device.type == "cpu")
        ):
            # CPU: one native pass rotates q in place and writes the rotated k and v straight
            # into their cache slots, quantizing them on the way into an 8-bit cache (the
            # PyTorch fallback inside does what the lines below do).
            q = cpu_ops.rotary_store_kv(
                qk, v, hq, rope.rotary.cos, rope.rotary.sin, rope.positions, k_cache, v_cache,
                metadata.slot_mapping, trusted=True, k_scale=k_scale, v_scale=v_scale,
            )
        else:
            cos, sin = rope.cos_sin
            # q and k rotate together: one elementwise pass instead of two.
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            if kv.quantized:
                self.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
            else:
                self.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if kv.quantized:
            out = self.paged_attention(q, k_cache, v_cache, metadata, self.scale, k_scale=k_scale, v_scale=v_scale)
        else:
            out = self.paged_attention(q, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, hq * d),
                           activation_buffer(buffers, "o_proj", num_tokens, self.o_proj.out_features, x))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype, device
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, buffers: Activations | None = None) -> torch.Tensor:
        rows = x.shape[0]
        act_buffer = activation_buffer(buffers, "silu_mul", rows, self.intermediate_size, x) if x.device.type == "cpu" else None
        act = None
        if cpu_ops.cpu_ops_available():
            act = self.gate_up_proj.swiglu(x, cpu_ops.silu_vector_chunk(x.dtype), act_buffer)
        if act is None:
            gate_up = self.gate_up_proj(x, activation_buffer(buffers, "gate_up", rows, 2 * self.intermediate_size, x))
            act = cpu_ops.silu_mul(gate_up, act_buffer)
        return self.down_proj(act, activation_buffer(buffers, "down_proj", rows, self.down_proj.out_features, x))



class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, h, rope, kv: LayerKVCache, metadata) -> torch.Tensor:
        """The layer on its own (reference order); the model's forward runs the same
        arithmetic with each residual add fused into the following RMSNorm."""
        h = h + self.self_attn(self.input_layernorm(h), rope, LayerKVCache(*kv), metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


# Checkpoint projection name -> (our fused parameter's module name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose parameters are allocated but not initialised."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_len: int | None = None,
        shard: "Shard | None" = None,
    ) -> None:
        """``shard``: this rank's part of a tensor-parallel model (``workers/engine/parallel.py``): its
        heads, KV heads, MLP width and LM head rows only; the caller sets ``reduce``."""
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.shard = shard
        local = shard.local_config(config) if shard is not None else config
        self.model = _Backbone(local, dtype, device)
        if shard is None:
            head = (self.model.embed_tokens.weight if config.tie_word_embeddings
                    else empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        elif config.tie_word_embeddings:  # this rank's rows of the (replicated) embedding
            head = nn.Parameter(self.model.embed_tokens.weight.data[shard.vocab[0]:shard.vocab[1]],
                                requires_grad=False)
        else:
            head = empty_param(shard.vocab[1] - shard.vocab[0], config.hidden_size, dtype=dtype, device=device)
        self.lm_head = LMHead(head)
        self._init_running(config, local, device, max_len)

    def _init_running(self, config: ModelConfig, local: ModelConfig, device: torch.device,
                      max_len: int | None) -> None:
        """What the forward pass and the loader use beside the weights (the whole model and a
        pipeline stage alike); ``local``: this rank's shard of ``config``."""
        # Tensor parallel: sums each attention and MLP block's partial output over the ranks, in place.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        # Asked before each decoder layer; true stops the pass with StepInterrupted (set by the
        # model runner for one interruptible step at a time).
        self.interrupt: Callable[[], bool] | None = None
        self.activations = Activations()
        # The whole layer loop in one native call where the step allows it (decoder_chain.py).
        self.chain = DecoderChain(self)
        # Tables for long-context models are large; start small, the runner extends them to
        # its max_model_len.
        self.rotary = RotaryEmbedding(config, max_len or min(config.max_position_embeddings, 4096), device)
        q_size = local.num_heads * local.head_dim
        kv_size = local.num_kv_heads * local.head_dim
        inter = local.intermediate_size
        self._shard_offsets = {
            "qkv_proj": (0, q_size, q_size + kv_size, q_size + 2 * kv_size),
            "gate_up_proj": (0, inter, 2 * inter),
        }

    # ------------------------------------------------------------------ running
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_metadata: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final (normalised) hidden states ``[T, hidden]`` of the packed tokens.

        With ``num_layers`` L, only the first L decoder layers run, followed by the final norm:
        the layer-skip draft of self-speculation (workers/engine/self_proposer.py), whose logits come
        from ``compute_logits`` as the full model's do. ``kv_caches`` then holds the first L
        layers' caches.
        """
        if num_layers is not None and not 1 <= num_layers <= len(self.model.layers):
            raise ValueError(f"num_layers must be between 1 and {len(self.model.layers)}, got {num_layers}")
        return self.run_layers(self.embed(input_ids), positions, kv_caches, attn_metadata, stop=num_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[T, hidden]`` of ``input_ids [T]``: the start of the residual
        stream, in its activation buffer."""
        weight = self.model.embed_tokens.weight
        out = self.activations.get("residual", input_ids.shape[0], weight.shape[1], weight)
        return torch.index_select(weight, 0, input_ids, out=out)

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_metadata: AttentionMetadata,
        start: int = 0,
        stop: int | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor:
        """Decoder layers ``[start, stop)`` (by default all) over the residual stream ``h [T, hidden]``,
        which they update in place; ``kv_caches`` holds those layers' caches, in order.

        Returns with ``final_norm`` the final norm's output, else the residual stream after the
        last layer (what the next pipeline stage takes as its ``h``); either in a tensor of its
        own, never one of the activation buffers, which the next call reuses.
        """
        layers = self.model.layers
        if start or (stop is not None and stop != len(layers)):
            layers = layers[start:stop]
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV cache pairs, got {len(kv_caches)}")
        buffers = self.activations
        num_tokens, hidden = h.shape
        rope = RotaryInputs(self.rotary, positions, h.dtype)
        if h.device.type == "cpu" and positions.numel():
            self._check_step_indices(positions, attn_metadata.slot_mapping, kv_caches[0][0] if kv_caches else None)
        if not len(layers):
            return self._add_norm(h, None, self.model.norm)[1] if final_norm else h.clone()
        if final_norm and len(layers) == len(self.model.layers) and self.chain.takes(h, kv_caches):
            out = self.chain.run(h, positions, kv_caches, attn_metadata, self.interrupt)
            if out is not None:
                return out
        # Each residual add runs inside the RMSNorm that follows it (one pass over the rows
        # instead of two): h is the residual stream, x the normalised input of the next block
        # (in one buffer: each x is consumed before the next is written).
        normed = buffers.get("normed", num_tokens, hidden, h) if h.device.type == "cpu" else None
        h, x = self._add_norm(h, None, layers[0].input_layernorm, normed)
        reduce = self.reduce
        interrupt = self.interrupt
        last = len(layers) - 1
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            if interrupt is not None and interrupt():
                raise StepInterrupted(start + i)
            a = layer.self_attn(x, rope, LayerKVCache(*kv), attn_metadata, buffers)
            if reduce is not None:
                reduce(a)
            h, x = self._add_norm(h, a, layer.post_attention_layernorm, normed)
            m = layer.mlp(x, buffers)
            if reduce is not None:
                reduce(m)
            if i < last:
                h, x = self._add_norm(h, m, layers[i + 1].input_layernorm, normed)
        # The last layer's residual add: fused into the final norm, or on its own (the same
        # float add the next stage's first norm would have fused).
        if final_norm:
            return self._add_norm(h, m, self.model.norm)[1]
        return h + m

    @staticmethod
    def _add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_ops.add_rms_norm(h, delta, norm.weight, norm.eps, out)

    def _check_step_indices(self, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache) -> None:
        """Once per step, the indices the native rotary kernel trusts in every layer."""
        if int(positions.min()) < 0 or int(positions.max()) >= self.rotary.max_len:
            raise ValueError(f"positions fall outside the rotary table (0..{self.rotary.max_len - 1})")
        if k_cache is not None:
            num_slots = k_cache.shape[0] * k_cache.shape[1]
            if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots:
                raise ValueError(f"slot mapping names slots outside the KV cache (0..{num_slots - 1})")

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on the rows that sample: ``[B, hidden] -> [B, vocab]`` (model dtype), into
        ``out`` (contiguous, ``[B, vocab]``) when given."""
        return self.lm_head(hidden, out)

    def pack_weights(self) -> int:
        """Pack every dense layer's weight for its native kernel now, as its first call would:
        start-up pays it rather than the first step. bfloat16 layers (and the LM head) for the AMX
        kernel (or, without AMX, laid out for oneDNN), int8 layers (``--quantization``) for
        theirs: the MLP's gate/up projection for the fused SwiGLU the MLP calls first where the
        fused CPU ops run. Returns how many were packed
        (none on other devices, or without a native kernel for the layer)."""
        packed = 0
        dtype = self.dtype  # the rows' dtype: the model's
        fused_mlp = cpu_ops.cpu_ops_available()
        gate_ups = {id(m.gate_up_proj) for m in self.modules() if isinstance(m, MLP)}
        for module in self.modules():
            if isinstance(module, (Linear, LMHead)) and module.weight.device.type == "cpu":
                rows = torch.empty(1, module.weight.shape[1], dtype=module.weight.dtype)
                # The MLP's gate/up goes to the fused SwiGLU where it runs, and only there.
                if (fused_mlp and id(module) in gate_ups
                        and amx_swiglu_weight(module, rows, cpu_ops.silu_vector_chunk(rows.dtype)) is not None):
                    packed += 1
                else:
                    packed += (amx_weight(module, rows) or onednn_weight(module, rows)) is not None
            elif hasattr(module, "pack_now") and module.qweight.device.type == "cpu":
                packed += module.pack_now(dtype, fused=fused_mlp and id(module) in gate_ups)
        return packed

    # ------------------------------------------------------------------ loading
    def checkpoint_weight_names(self) -> set[str]:
        """The Hugging Face tensor names a complete checkpoint provides for this model."""
        names = set()
        for name, param in self.named_parameters():
            module, _, leaf = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj == "qkv_proj":
                names.update(f"{parent}.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj"))
            elif proj == "gate_up_proj":
                names.update(f"{parent}.{p}.{leaf}" for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names used.

        Raises ``ModelLoadError`` for a tensor with an unknown name or the wrong shape.
        """
        params = dict(self.named_parameters())
        for module in self.modules():  # packed copies of the old weights
            if isinstance(module, Linear):
                module.packed = module.packed_swiglu = None
            elif isinstance(module, LMHead):
                module.packed = None
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            module, _, leaf = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj in _FUSED:
                fused, shard = _FUSED[proj]
                target_name = f"{parent}.{fused}.{leaf}"
                param = params.get(target_name)
                if param is None:
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
                offsets = self._shard_offsets[fused]
                target = param.data[offsets[shard] : offsets[shard + 1]]
            else:
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
                target = param.data
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        return loaded
