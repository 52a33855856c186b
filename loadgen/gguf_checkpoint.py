"""A benchmark checkpoint's weights as a GGUF file for llama.cpp: the same bfloat16 values.

Owns ``write_gguf(path, config, tensors)``: a Llama-architecture Hugging Face config and its
tensors (HF names, the bfloat16 tensors of the safetensors file) written the way llama.cpp's
``convert_hf_to_gguf.py --outtype bf16`` writes such a model, so that ``mqinfer bench --compare
llamacpp`` runs both engines on exactly the same numbers:

- matrices stay bfloat16, byte for byte; 1-D tensors (the RMSNorm weights) are float32, as the
  converter stores them (every bfloat16 value is exactly a float32 value);
- q/k projection rows are reordered within each head from HF's rotate-half pairing to llama.cpp's
  interleaved pairs (the converter's ``permute``; ``workers/engine/gguf.py`` undoes it when mqinfer reads
  such a file);
- a tied LM head is left out (llama.cpp then uses the embedding, as HF does);
- the vocabulary is llama.cpp's ``none`` kind with ``llama.vocab_size`` tokens: benchmark prompts
  are token ids on both sides (``llama-batched-bench`` draws its own at random), so the random
  checkpoints carry no tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

ARCHITECTURE = "llama"


def permute_rows(weight, num_heads: int):
    """HF's rotate-half q/k row order to llama.cpp's interleaved order, head by head: within a
    head of d rows, HF row ``i + j * d/2`` becomes row ``2i + j``."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf_name in glob:
        return glob[hf_name]
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        module = ".".join(parts[3:-1])
        if module in layer:
            return f"blk.{parts[2]}.{layer[module]}.{parts[-1]}"
    raise ValueError(f"tensor {hf_name!r} has no place in a llama GGUF")


def write_gguf(path: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, Any],
               name: str = "mqinfer-random-llama") -> Path:
    """Write ``tensors`` (HF name -> bfloat16 torch tensor) of a Llama ``config`` (HF config.json
    keys) to ``path`` as a bf16 GGUF; ValueError for a tensor or setting it cannot express."""
    import gguf
    import numpy as np
    import torch

    if config.get("attention_bias") or config.get("mlp_bias") or config.get("rope_scaling"):
        raise ValueError("this writer makes bias-free Llama GGUFs without rope scaling only")
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer = gguf.GGUFWriter(str(path), ARCHITECTURE)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_tokenizer_model("none")
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(config.get(key), int):
            getattr(writer, f"add_{key}")(config[key])
    for hf_name, tensor in tensors.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if tensor.dtype != torch.bfloat16:
            raise ValueError(f"{hf_name} is {tensor.dtype}; the GGUF holds the bfloat16 checkpoint's bytes")
        if hf_name.endswith("q_proj.weight"):
            tensor = permute_rows(tensor, heads)
        elif hf_name.endswith("k_proj.weight"):
            tensor = permute_rows(tensor, kv_heads)
        if tensor.dim() == 1:
            writer.add_tensor(_gguf_name(hf_name), tensor.float().numpy())
        else:
            bits = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(_gguf_name(hf_name), bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


__all__ = ["permute_rows", "write_gguf"]
