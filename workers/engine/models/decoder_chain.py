"""The decoder layers of a bfloat16 Llama step in one native call, on a CPU with AMX.

``LlamaForCausalLM.run_layers`` runs eight kernel calls per layer from Python (q/k/v projection,
rotary and KV store, attention, output projection, residual add + RMSNorm, SwiGLU, down
projection, residual add + RMSNorm). On two cores a small model's decoding step spends about a
third of its time between them, in the wrappers' checks, argument records and ctypes crossings:
SmolLM2 at one row took 20 ms a step, 10 of them the weights' reads. :class:`DecoderChain`
checks once per step what those wrappers check per call, fills the kernels' argument records
once, and hands the whole layer loop to ``mqinfer_decoder_layers`` (kernels/csrc/decoder_layers.c),
which calls the same kernels in the same order on the same buffers: the outputs and the KV cache
are the same bits as the Python loop's (tests/workers/test_decoder_chain.py holds it to that).

It takes a step when all of these hold, else the Python loop runs: bfloat16 on a CPU whose AMX
kernel is in use (``MQINFER_CPU_LINEAR``, ``MQINFER_CPU_OPS`` and ``MQINFER_CPU_ATTENTION`` not
``torch``), a Llama or Qwen2 layer (biases on the q/k/v projection only, no q/k norms, bfloat16
projections: not w8a8 or w8a16), the KV cache in the model's
dtype, the whole model on one rank (no tensor-parallel reduce, not a pipeline stage's range), at
most ``linear_amx.MAX_ROWS`` rows (above, the plain projections go to PyTorch's matmul). With an
``interrupt`` (workers/engine/core.py) it runs one layer per call and asks before each.
``MQINFER_CPU_LAYERS=torch`` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable

import torch

from mqinfer.kernels import attention_native, cpu_ops, linear_amx, native
from mqinfer.kernels.attention import AttentionMetadata
from mqinfer.workers.engine.models.layers import KVCaches, Linear, StepInterrupted, amx_swiglu_weight, amx_weight

if TYPE_CHECKING:
    from mqinfer.workers.engine.models.llama import LlamaForCausalLM


# The switch: ``torch`` runs the Python layer loop always (``auto``, the default, the chain where it applies).
SWITCH = "MQINFER_CPU_LAYERS"


class DecoderChain:
    """The native layer loop of one model (see the module docstring)."""

    def __init__(self, model: "LlamaForCausalLM") -> None:
        self.model = model
        config = model.config
        self.plain = model.shard is None and not config.o_bias and not config.mlp_bias and not config.qk_norm
        self._weights: list | None = None  # (module, its packed weight) of every projection
        self._arrays: tuple | None = None
        self._caches: tuple | None = None
        # The first layer's q/k/v projection when the projections were found not to suit the
        # kernels (8-bit modules, or a weight the AMX kernel does not pack): not tried again.
        self._refused = None

    # -- when it applies ------------------------------------------------------------------------
    def takes(self, h: torch.Tensor, kv_caches: KVCaches) -> bool:
        """Whether this step's layers can run here (the module docstring's conditions)."""
        if native.switch_mode(SWITCH) == "torch":
            return False
        if not self.plain or h.dtype != torch.bfloat16 or h.device.type != "cpu" or self.model.reduce is not None:
            return False
        rows, hidden = h.shape
        if not 0 < rows <= linear_amx.MAX_ROWS or not h.is_contiguous():
            return False
        lib = native.switched_library("MQINFER_CPU_OPS")
        if lib is None or not hasattr(lib, "mqinfer_decoder_layers") or not linear_amx.available():
            return False
        if not attention_native.native_attention_available():
            return False
        return self._caches_ok(kv_caches)

    def _caches_ok(self, kv_caches: KVCaches) -> bool:
        key = tuple(id(kv) for kv in kv_caches)
        if self._caches is not None and self._caches[0] == key:
            return True
        model = self.model
        layers = model.model.layers
        if len(kv_caches) != len(layers):
            return False
        attn = layers[0].self_attn
        for kv in kv_caches:
            k_cache, v_cache = kv[0], kv[1]
            quantized = len(kv) > 2 and kv[2] is not None
            if (quantized or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
                    or k_cache.device.type != "cpu" or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                    or k_cache.dim() != 4 or v_cache.shape != k_cache.shape
                    or tuple(k_cache.shape[2:]) != (attn.num_kv_heads, attn.head_dim)):
                return False
        k_ptrs = (ctypes.c_void_p * len(kv_caches))(*(kv[0].data_ptr() for kv in kv_caches))
        v_ptrs = (ctypes.c_void_p * len(kv_caches))(*(kv[1].data_ptr() for kv in kv_caches))
        self._caches = (key, k_ptrs, v_ptrs, list(kv_caches))
        return True

    # -- the weights ----------------------------------------------------------------------------
    def _weight_arrays(self, x: torch.Tensor, vector_chunk: int) -> tuple | None:
        """The per-layer pointer arrays, made again when a projection's packed weight changed
        (``load_weights`` drops them); None when a weight does not pack for the kernel."""
        weights = self._weights
        if weights is not None and all(m.packed is p for m, p in weights[0]) and \
                all(m.packed_swiglu is p for m, p in weights[1]):
            return self._arrays
        layers = self.model.model.layers
        # 8-bit projections (w8a8, w8a16) replace the Linear modules: those steps stay in Python.
        first = layers[0].self_attn.qkv_proj
        if self._refused is first:
            return None
        if not all(type(m) is Linear for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            self._refused = first
            return None
        plain, fused = [], []
        qkv, o, gate_up, down = [], [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module, out in ((attn.qkv_proj, qkv), (attn.o_proj, o), (mlp.down_proj, down)):
                probe = x if module.weight.shape[1] == x.shape[1] else x.new_empty(1, module.weight.shape[1])
                packed = amx_weight(module, probe)
                if packed is None:
                    self._refused = first
                    return None
                plain.append((module, packed))
                out.append(packed.data.data_ptr())
            packed = amx_swiglu_weight(mlp.gate_up_proj, x, vector_chunk)
            if packed is None:
                self._refused = first
                return None
            fused.append((mlp.gate_up_proj, packed))
            gate_up.append(packed.data.data_ptr())

        def array(ptrs: list[int]):
            return (ctypes.c_void_p * len(ptrs))(*ptrs)

        biases = [layer.self_attn.qkv_proj.bias for layer in layers]
        if any(b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()) for b in biases):
            return None
        qkv_bias = None if biases[0] is None else array([b.data_ptr() for b in biases])
        norms_in = [layer.input_layernorm.weight for layer in layers]
        norms_post = [layer.post_attention_layernorm.weight for layer in layers]
        if not all(w.is_contiguous() and w.dtype == torch.bfloat16 for w in norms_in + norms_post):
            return None
        self._arrays = (array([w.data_ptr() for w in norms_in]), array([w.data_ptr() for w in norms_post]),
                        array(qkv), qkv_bias, array(o), array(gate_up), array(down))
        self._weights = (plain, fused)
        return self._arrays

    # -- one step -------------------------------------------------------------------------------
    def run(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, metadata: AttentionMetadata,
            interrupt: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Every layer and the final norm over ``h`` (updated in place): the final norm's output in
        a tensor of its own; None when the chain cannot take the step after all (the caller runs
        the Python loop, nothing having been written)."""
        args = self._step_args(h, positions, kv_caches, metadata)
        if args is None:
            return None
        args, final = args
        lib = native.load()
        layers = len(kv_caches)
        threads = torch.get_num_threads()
        spans = [(0, layers)] if interrupt is None else [(i, i + 1) for i in range(layers)]
        for first, last in spans:
            if interrupt is not None and interrupt():
                raise StepInterrupted(first)
            status = lib.mqinfer_decoder_layers(ctypes.byref(args), first, last, threads)
            if status != 0:
                raise RuntimeError(f"the native decoder layers failed at layers {first}..{last - 1} (status {status})")
        return final

    def _step_args(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                   metadata: AttentionMetadata) -> tuple[native.DecoderArgs, torch.Tensor] | None:
        """The step's argument record and the final norm's output tensor; None where a weight or
        table does not suit the kernels."""
        model = self.model
        rows, hidden = h.shape
        vector_chunk = cpu_ops.silu_vector_chunk(torch.bfloat16)
        arrays = self._weight_arrays(h, vector_chunk)
        if arrays is None or model.model.norm.weight.dtype != torch.bfloat16:
            return None
        attn = model.model.layers[0].self_attn
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_size, kv_size = hq * d, hkv * d
        inter = model.model.layers[0].mlp.intermediate_size
        if hidden % linear_amx.K_BLOCK or q_size % linear_amx.K_BLOCK or inter % linear_amx.K_BLOCK or d % 2:
            return None
        cos, sin = model.rotary.cos, model.rotary.sin
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape[1] == d and sin.shape == cos.shape) or metadata.seq_of_token is None:
            return None
        tables = self._checked_indices(rows, positions, kv_caches, metadata, hq, hkv)
        buffers = model.activations
        qkv_cols = q_size + 2 * kv_size
        x = buffers.get("normed", rows, hidden, h)
        qkv = buffers.get("qkv", rows, qkv_cols, h)
        att = buffers.get("attention", rows, q_size, h)
        o = buffers.get("o_proj", rows, hidden, h)
        act = buffers.get("silu_mul", rows, inter, h)
        down = buffers.get("down_proj", rows, hidden, h)
        final = torch.empty(rows, hidden, dtype=h.dtype)
        _, k_ptrs, v_ptrs, _ = self._caches
        norm_in, norm_post, qkv_w, qkv_b, o_w, gate_up_w, down_w = (
            None if a is None else ctypes.cast(a, ctypes.c_void_p) for a in arrays)
        k_cache = kv_caches[0][0]
        args = native.DecoderArgs(
            h=h.data_ptr(), x=x.data_ptr(), qkv=qkv.data_ptr(), attn=att.data_ptr(), o=o.data_ptr(),
            act=act.data_ptr(), down=down.data_ptr(), final_out=final.data_ptr(),
            input_norm=norm_in, post_norm=norm_post, final_norm=model.model.norm.weight.data_ptr(),
            qkv_packed=qkv_w, qkv_bias=qkv_b, o_packed=o_w, gate_up_packed=gate_up_w, down_packed=down_w,
            k_cache=ctypes.cast(k_ptrs, ctypes.c_void_p), v_cache=ctypes.cast(v_ptrs, ctypes.c_void_p),
            rotary=native.RotaryArgs(
                cos=cos.data_ptr(), sin=sin.data_ptr(), positions=positions.data_ptr(),
                slots=metadata.slot_mapping.data_ptr(), rows=rows, qk_stride=qkv_cols, v_stride=qkv_cols,
                num_q_heads=hq, num_kv_heads=hkv, head_dim=d, is_bf16=1, kv_quant=0),
            attention=native.AttentionArgs(
                block_tables=tables[0].data_ptr(), seq_of_token=tables[1].data_ptr(),
                positions=tables[2].data_ptr(), num_tokens=rows, q_token_stride=qkv_cols, num_heads=hq,
                num_kv_heads=hkv, head_dim=d, block_size=k_cache.shape[1], max_blocks=tables[0].shape[1],
                max_len=metadata.max_seq_len, scale=attn.scale, is_bf16=1, kv_quant=0),
            num_layers=len(kv_caches), rows=rows, hidden=hidden, q_size=q_size, kv_size=kv_size, inter=inter,
            vector_chunk=vector_chunk, norm_threads=cpu_ops.elementwise_threads(rows * hidden),
            rotary_threads=cpu_ops.elementwise_threads(rows * (q_size + kv_size)), eps=model.model.norm.eps,
        )
        # The record holds raw pointers: keep what they point into alive with it.
        args.keep = (tables, x, qkv, att, o, act, down, arrays)
        return args, final

    @staticmethod
    def _checked_indices(rows: int, positions: torch.Tensor, kv_caches: KVCaches, metadata: AttentionMetadata,
                         hq: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the rotary and attention wrappers check per call, once: the index tensors' types
        and shapes, and (once per metadata and cache) every index the attention kernel will read
        (the model checked positions and slots against the tables and caches). Returns the
        attention's block tables, sequence ids and positions, contiguous."""
        for name, index in (("positions", positions), ("slot_mapping", metadata.slot_mapping)):
            if tuple(index.shape) != (rows,) or index.dtype != torch.int64 or not index.is_contiguous():
                raise ValueError(f"{name} must hold one int64 entry per token ({rows}), got {tuple(index.shape)}")
        if metadata.num_queries_per_kv * hkv != hq:
            raise ValueError(f"{hq} query heads do not match {hkv} KV heads x {metadata.num_queries_per_kv}")
        k_cache = kv_caches[0][0]
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        tables = metadata.block_tables.contiguous()
        seq_of_token = metadata.seq_of_token.contiguous()
        att_positions = metadata.positions.contiguous()
        attention_native.check_index_tensors(tables, seq_of_token, att_positions, rows)
        if metadata.native_checked_blocks != num_blocks:
            attention_native.check_attention_indices(metadata, tables, seq_of_token, att_positions, num_blocks,
                                                     block_size)
            metadata.native_checked_blocks = num_blocks
        return tables, seq_of_token, att_positions
