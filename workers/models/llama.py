"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the packed flat batch.

Owns the network: RMSNorm, rotary embeddings (default, linear and Llama-3 frequency scaling),
grouped-query attention over the paged KV cache, SwiGLU MLP, and the mapping from Hugging
Face checkpoint tensor names onto our fused layout (q/k/v in one projection, gate/up in one),
which halves the number of matmuls per layer.

``forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, H]`` runs
every scheduled token of every sequence at once (no padding); ``compute_logits`` then runs
the LM head on only the rows that sample. Its decoder layers run in ``run_layers``, which runs
any range of them over a residual stream: a pipeline stage (``stage.py``) runs its own range there.

Numerics follow the reference implementation where it matters for exact agreement: RMSNorm
in float32 then cast back before the weight, rotary tables in float32 cast to the activation
dtype, residual adds in the activation dtype.

On CPU the elementwise steps run as fused native kernels (``kernels/cpu_ops.py``): each
residual add inside the RMSNorm that follows it, SiLU * up in one pass, and rotary written
straight into the KV cache. They round exactly where the PyTorch ops do, so the results are
the same bit for bit (``MQINFER_CPU_OPS=torch`` runs the PyTorch ops instead).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mqinfer.kernels import cpu_ops
from mqinfer.kernels import linear as dense
from mqinfer.kernels import linear_amx, linear_onednn
from mqinfer.kernels.attention import AttentionMetadata, paged_attention, store_kv
from mqinfer.kernels.kv_quant import LayerKVCache
from mqinfer.workers.models.config import ModelConfig, ModelLoadError

if TYPE_CHECKING:
    from mqinfer.workers.parallel import Shard

# One cache per layer: a LayerKVCache, or a plain (k_cache, v_cache) pair.
KVCaches = Sequence[LayerKVCache | tuple[torch.Tensor, torch.Tensor]]


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by the checkpoint, and random
    # init of a billion parameters would cost seconds.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _packed_weight(module: nn.Module, x: torch.Tensor, *, attr: str = "packed", weight: torch.Tensor | None = None,
                   pack=dense.pack) -> dense.PackedWeight | None:
    """``weight`` (default ``module.weight``) in the native dense kernel's layout when ``x`` and
    the weight suit it (2-D float32 on CPU, a CPU the kernel serves, the switch allowing): made
    by ``pack`` on first use and kept in ``module.<attr>``, made again when the weight was
    replaced; None otherwise. ``load_weights`` drops the packed copies."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or not dense.native_linear_available():
        return None
    weight = module.weight if weight is None else weight
    packed = getattr(module, attr)
    if packed is None or not packed.packed_from(weight):
        packed = pack(weight)
        setattr(module, attr, packed)
    return packed


def _amx_weight(module: nn.Module, x: torch.Tensor) -> linear_amx.AmxWeight | None:
    """``module.weight`` packed for the AMX kernel when rows ``x`` go there (``linear_amx.takes``:
    bfloat16, at most its row limit, a CPU with AMX): made on first use and kept in
    ``module.packed`` (a bfloat16 model never holds the float32 kernel's packing there), made
    again when the weight was replaced; None otherwise."""
    if not linear_amx.takes(x):
        return None
    packed = module.packed
    if not isinstance(packed, linear_amx.AmxWeight) or not packed.packed_from(module.weight):
        packed = module.packed = linear_amx.pack(module.weight)
    return packed


def _onednn_weight(module: nn.Module, x: torch.Tensor) -> linear_onednn.OneDnnWeight | None:
    """``module.weight`` laid out for oneDNN when rows ``x`` go there (``linear_onednn.takes``:
    bfloat16, at most its row limit, a CPU without AMX whose oneDNN runs bfloat16), kept in
    ``module.packed`` as ``_amx_weight`` keeps its own; None otherwise."""
    if linear_amx.available() or not linear_onednn.takes(x):
        return None
    packed = module.packed
    if not isinstance(packed, linear_onednn.OneDnnWeight) or not packed.packed_from(module.weight):
        packed = module.packed = linear_onednn.pack(module.weight)
    return packed


def _amx_swiglu_weight(module: nn.Module, x: torch.Tensor, vector_chunk: int) -> linear_amx.AmxWeight | None:
    """SwiGLU's gate/up weight packed for the AMX kernel's fused SwiGLU when rows ``x`` go to the
    kernel and the layer has no bias: kept in ``module.packed_swiglu``, made again when the weight
    was replaced; None otherwise. Any number of rows: unlike the plain layers, which leave long
    prompts to PyTorch's matmul (``linear_amx.MAX_ROWS``), the fused form beats PyTorch's matmul
    followed by the SwiGLU kernel there too (BENCHMARKS.md)."""
    if module.bias is not None or vector_chunk % linear_amx.PANEL or not linear_amx.takes(x, None):
        return None
    packed = module.packed_swiglu
    if not isinstance(packed, linear_amx.AmxWeight) or not packed.packed_from(module.weight):
        packed = module.packed_swiglu = linear_amx.pack_swiglu(module.weight)
    return packed


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: dense.PackedWeight | None = None
        self.packed_swiglu: dense.PackedWeight | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] -> [T, out]``, into ``out`` when given. On an AVX2 CPU in float32 the
        native kernel with the packed weight (``kernels/linear.py``); on a CPU with AMX in
        bfloat16, up to ``linear_amx.MAX_ROWS`` rows, the AMX kernel with its packed weight
        (``kernels/linear_amx.py``); on another CPU in bfloat16, up to ``linear_onednn.MAX_ROWS``
        rows, oneDNN with the weight laid out once (``kernels/linear_onednn.py``; the bits of
        ``F.linear``, in a new tensor rather than ``out``); elsewhere the very calls ``F.linear``
        makes for 2-D input (``mm``, or ``addmm`` with a bias), the same bits."""
        packed = _packed_weight(self, x)
        if packed is not None:
            return dense.linear(x, packed, self.bias, out)
        amx = _amx_weight(self, x)
        if amx is not None:
            return linear_amx.linear(x, amx, self.bias, out)
        laid_out = _onednn_weight(self, x)
        if laid_out is not None:
            return linear_onednn.linear(x, laid_out, self.bias)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def swiglu(self, x: torch.Tensor, vector_chunk: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """For SwiGLU's fused gate/up projection (gate rows first): ``silu(gate) * up`` straight
        from the native dense kernel's registers (float32) or the AMX kernel's tiles (bfloat16,
        no bias), the same bits as the projection followed by ``cpu_ops.silu_mul``
        (``vector_chunk`` as there), without the 2 x wide intermediate; None where neither
        applies (the caller runs those two steps)."""
        packed = _packed_weight(self, x, attr="packed_swiglu", pack=lambda w: dense.pack_swiglu(w, self.bias))
        if packed is not None:
            return dense.swiglu(x, packed, vector_chunk, out)
        amx = _amx_swiglu_weight(self, x, vector_chunk)
        return None if amx is None else linear_amx.swiglu(x, amx, vector_chunk, out)


class Activations:
    """Buffers for the intermediate activations of the model's forward pass, one per kind (the
    q/k/v projection, the attention output projection, gate/up, SwiGLU, down, the normalised
    rows, the residual stream), reused by every layer and every step.

    Why. On CPU a fresh tensor of a few MiB comes from a new memory mapping that the kernel
    faults in page by page (and MKL zeroes before it writes): at a 4096-token prefill the
    gate/up projection's 48 MiB output cost about a tenth of the matmul itself. Each layer's
    outputs are consumed before the next layer writes the same kind, so one buffer per kind
    serves all layers. Only the model's forward writes them, and what it returns is never one
    of them. A buffer grows to the largest step seen and stays.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, kind: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` tensor of ``like``'s dtype and device, contents undefined."""
        numel = rows * cols
        buffer = self._buffers.get(kind)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[kind] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(rows, cols)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers as they are now (a captured CUDA graph keeps those it writes alive)."""
        return list(self._buffers.values())


class Embedding(nn.Module):
    """Token embedding; with tied weights the LM head shares ``weight``."""

    def __init__(self, num_embeddings: int, dim: int, dtype, device) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


# Vocabulary rows of the LM head per matmul on CPU: about 1 MiB of weights (at least 256
# rows). One matmul over a whole large vocabulary ran at 46 GFLOP/s on 64 rows where slices of
# 512 rows written into their columns of the same output ran at 60 (float32, one AVX2 core):
# MKL packs the weight operand block by block, and a slice's blocks stay in cache.
_LM_HEAD_SLICE_BYTES = 1 << 20


class LMHead(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.packed: dense.PackedWeight | None = None

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, hidden] -> [B, vocab]``, into ``out`` when given. On an AVX2 CPU in float32 the
        native dense kernel, on a CPU with AMX in bfloat16 the AMX kernel, on another in bfloat16
        oneDNN with the weight laid out (all as ``Linear``); elsewhere on CPU in slices of the
        vocabulary, each logit the same dot product as in one matmul (the same bits)."""
        packed = _packed_weight(self, hidden)
        if packed is not None:
            return dense.linear(hidden, packed, None, out)
        amx = _amx_weight(self, hidden)
        if amx is not None:
            return linear_amx.linear(hidden, amx, None, out)
        laid_out = _onednn_weight(self, hidden)
        if laid_out is not None:
            logits = linear_onednn.linear(hidden, laid_out)
            return logits if out is None else out.copy_(logits)
        weight = self.weight
        vocab, dim = weight.shape
        if hidden.device.type != "cpu" or hidden.dim() != 2:
            return F.linear(hidden, weight) if out is None else torch.mm(hidden, weight.t(), out=out)
        if out is None:
            out = torch.empty(hidden.shape[0], vocab, dtype=hidden.dtype)
        rows = max(256, _LM_HEAD_SLICE_BYTES // (dim * weight.element_size()) // 64 * 64)
        for start in range(0, vocab, rows):
            stop = min(start + rows, vocab)
            torch.mm(hidden, weight[start:stop].t(), out=out[:, start:stop])
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` (float32) with the configured scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    params = config.rope_scaling
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        try:
            factor = float(params["factor"])
            low = float(params["low_freq_factor"])
            high = float(params["high_freq_factor"])
            old_len = float(params["original_max_position_embeddings"])
        except KeyError as exc:
            raise ModelLoadError(f"llama3 rope scaling is missing {exc.args[0]!r}") from None
        # Long wavelengths (beyond the original context / low) are slowed by `factor`, short
        # ones (below original context / high) are kept, and the band between is blended.
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blend = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - blend) * slowed / factor + blend * slowed
        in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(in_band, smoothed, slowed)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``0..max_len-1`` (float32), looked up per packed token."""

    def __init__(self, config: ModelConfig, max_len: int, device) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config).to(device)
        self.max_len = 0
        self.cos = self.sin = torch.empty(0)
        self.extend(max_len)

    def extend(self, max_len: int) -> None:
        if max_len <= self.max_len:
            return
        positions = torch.arange(max_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin, self.max_len = emb.cos(), emb.sin(), max_len

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos[:, None, :], sin[:, None, :]


class RotaryInputs:
    """One step's rotary inputs, shared by every layer: the float32 tables and the positions
    for the native kernel, and the per-token cos/sin (``[T, 1, D]`` in the activation dtype)
    that the PyTorch path needs, built on first use only."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._per_token: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._per_token is None:
            self._per_token = self.rotary(self.positions, self.dtype)
        return self._per_token


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        qkv = self.qkv_proj(x, _buffer(buffers, "qkv", num_tokens, self.qkv_proj.out_features, x))
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
            qk = qk * cos + _rotate_half(qk) * sin
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
                           _buffer(buffers, "o_proj", num_tokens, self.o_proj.out_features, x))


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
        act_buffer = _buffer(buffers, "silu_mul", rows, self.intermediate_size, x) if x.device.type == "cpu" else None
        act = None
        if cpu_ops.cpu_ops_available():
            act = self.gate_up_proj.swiglu(x, cpu_ops.silu_vector_chunk(x.dtype), act_buffer)
        if act is None:
            gate_up = self.gate_up_proj(x, _buffer(buffers, "gate_up", rows, 2 * self.intermediate_size, x))
            act = cpu_ops.silu_mul(gate_up, act_buffer)
        return self.down_proj(act, _buffer(buffers, "down_proj", rows, self.down_proj.out_features, x))


def _buffer(buffers: Activations | None, kind: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
    return None if buffers is None else buffers.get(kind, rows, cols, like)


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
        """``shard``: this rank's part of a tensor-parallel model (``workers/parallel.py``): its
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
                    else _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        elif config.tie_word_embeddings:  # this rank's rows of the (replicated) embedding
            head = nn.Parameter(self.model.embed_tokens.weight.data[shard.vocab[0]:shard.vocab[1]],
                                requires_grad=False)
        else:
            head = _empty_param(shard.vocab[1] - shard.vocab[0], config.hidden_size, dtype=dtype, device=device)
        self.lm_head = LMHead(head)
        self._init_running(config, local, device, max_len)

    def _init_running(self, config: ModelConfig, local: ModelConfig, device: torch.device,
                      max_len: int | None) -> None:
        """What the forward pass and the loader use beside the weights (the whole model and a
        pipeline stage alike); ``local``: this rank's shard of ``config``."""
        # Tensor parallel: sums each attention and MLP block's partial output over the ranks, in place.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.activations = Activations()
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
        the layer-skip draft of self-speculation (workers/self_proposer.py), whose logits come
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
        # Each residual add runs inside the RMSNorm that follows it (one pass over the rows
        # instead of two): h is the residual stream, x the normalised input of the next block
        # (in one buffer: each x is consumed before the next is written).
        normed = buffers.get("normed", num_tokens, hidden, h) if h.device.type == "cpu" else None
        h, x = self._add_norm(h, None, layers[0].input_layernorm, normed)
        reduce = self.reduce
        last = len(layers) - 1
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
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
                        and _amx_swiglu_weight(module, rows, cpu_ops.silu_vector_chunk(rows.dtype)) is not None):
                    packed += 1
                else:
                    packed += (_amx_weight(module, rows) or _onednn_weight(module, rows)) is not None
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
