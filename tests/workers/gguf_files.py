"""Writing small GGUF files for the tests: a HF state dict in llama.cpp's names and layout, every
tensor type the loader reads, and vocabularies trained on the spot.

The ``gguf`` package quantizes the float types and the 32-value block types; it has no quantizer
for the 256-value K types (Q4_K, Q5_K, Q6_K), so ``quantize_k`` below writes them from the block
layouts (a plain min/max quantizer, not llama.cpp's optimising one). The loader decodes every type
with the ``gguf`` package, so these encoders and that decoder check each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

QK_K = 256

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, leaf = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, index, rest = module.split(".", 3)
        return f"blk.{index}.{HF_TO_GGUF[rest]}.{leaf}"
    return f"{HF_TO_GGUF[module]}.{leaf}"


def llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows to llama.cpp's interleaved pairs, as its converter writes them."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------ K-quant encoders
def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_6bit_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block into 12 bytes: bytes 0-3 and 4-7 hold scales and
    mins 0-3 in their low 6 bits and the top 2 bits of scales/mins 4-7 above them; bytes 8-11 the
    low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _affine_k(blocks: np.ndarray, levels: int):
    """Per 32-value sub-block: x ~ d*sc*q - dmin*m with q in 0..levels, sc and m 6-bit."""
    sub = blocks.reshape(len(blocks), 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d = _fp16(scale.max(-1) / 63)
    dmin = _fp16((-lo).max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * m)[..., None]
    q = np.rint(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0))
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(len(blocks), QK_K)
    return d, dmin, _pack_6bit_scales(sc, m), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Low 4 bits of 256 values into 128 bytes: per 64 values, byte l holds value l (low nibble)
    and value 32 + l (high nibble)."""
    q = q.reshape(len(q), 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def quantize_k(x: np.ndarray, kind: str) -> np.ndarray:
    """Rows of floats (length a multiple of 256) as Q4_K / Q5_K / Q6_K blocks (uint8 bytes)."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, scales, q = _affine_k(blocks, 15 if kind == "Q4_K" else 31)
        parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
        if kind == "Q5_K":  # bit 4 of value 32 * b + l is bit b of byte l
            high = ((q >> 4) & 1).reshape(len(q), 8, 32)
            parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
        parts.append(_nibbles(q))
    elif kind == "Q6_K":
        sub = blocks.reshape(len(blocks), 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = _fp16(scale.max(-1) / 127)
        df = d.astype(np.float32)[:, None]
        sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
        step = (df * sc)[..., None]
        q = np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0))
        q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, 4, 32)  # half, quarter, l
        # ql: per half, byte i < 64 holds value i (low nibble) and value 64 + i (high nibble).
        low = q & 15
        ql = (low[:, :, 0:2].reshape(-1, 2, 64) | (low[:, :, 2:4].reshape(-1, 2, 64) << 4)).reshape(-1, 128)
        # qh: per half, byte l holds the top 2 bits of values l, 32 + l, 64 + l, 96 + l.
        top = (q >> 4) & 3
        qh = (top << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2).astype(np.uint8).reshape(-1, 64)
        parts = [ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)]
    else:
        raise ValueError(kind)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """A float32 matrix in GGUF tensor type ``kind`` (the bytes, or a float array)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(x, kind)
    return gguf_quantize(x.astype(np.float32), GGMLQuantizationType[kind])


# ------------------------------------------------------------------------ vocabularies
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "A batch of requests goes to the worker; the worker answers every request in order.",
    "Numbers like 12345 and 2024 appear in the text, and so do words such as these and those.",
    "Call 12345, 12345 or 12345 before 2024; 12345 12345 12345 12345 12345 12345 12345 12345.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells for sure.",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _trained_merges(tok) -> list[str]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def byte_level_vocab(size: int) -> dict:
    """A GPT-2-style byte-level BPE vocabulary of ``size`` tokens trained on CORPUS: tokens (the
    three specials first), merges and token types (specials are control tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda item: item[1])]
    assert len(tokens) == size
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"model": "gpt2", "tokens": tokens, "merges": _trained_merges(tok), "types": types,
            "bos": 1, "eos": 2, "add_bos": False}


def sentencepiece_vocab(num_merges: int = 40) -> dict:
    """A sentencepiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, the corpus's
    characters, and merged pieces scored by merge order (earlier = higher)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    chars = sorted(set("".join(CORPUS).replace(" ", "\u2581")) | {"\u2581"})
    trainer = trainers.BpeTrainer(vocab_size=len(chars) + num_merges, show_progress=False, initial_alphabet=chars)
    tok.train_from_iterator(CORPUS, trainer)
    pieces = [m.replace(" ", "") for m in _trained_merges(tok)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1000.0 - i for i in range(len(chars))]
    for rank, piece in enumerate(p for p in pieces if p not in tokens):
        tokens.append(piece)
        scores.append(-float(rank))
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 1, "eos": 2,
            "add_bos": True, "unk": 0}


# ------------------------------------------------------------------------ files
def write_gguf(path: Path, arch: str, hf: dict, state: dict[str, torch.Tensor], kind: str = "F32",
               vocab: dict | None = None, chat_template: str | None = CHAT_TEMPLATE,
               extra: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF of ``state`` (HF names, float) with ``hf``'s config: matrices in type ``kind``
    (1-D tensors stay F32, as llama.cpp keeps them), Llama q/k rows in llama.cpp's order."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(hf.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(hf["vocab_size"])
    if vocab:
        w.add_tokenizer_model(vocab["model"])
        w.add_tokenizer_pre(vocab.get("pre", "default"))
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        if "merges" in vocab:
            w.add_token_merges(vocab["merges"])
        if "scores" in vocab:
            w.add_token_scores(vocab["scores"])
        w.add_bos_token_id(vocab["bos"])
        w.add_eos_token_id(vocab["eos"])
        if "unk" in vocab:
            w.add_unk_token_id(vocab["unk"])
        w.add_add_bos_token(vocab["add_bos"])
    if chat_template:
        w.add_chat_template(chat_template)
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    for name, tensor in state.items():
        x = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = llama_permute(x, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = llama_permute(x, kv_heads)
        add_tensor(w, gguf_name(name), x, kind if x.ndim == 2 else "F32")
    for name, x in (extra_tensors or {}).items():
        add_tensor(w, name, x, "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tensor(writer, name: str, x: np.ndarray, kind: str) -> None:
    from gguf import GGMLQuantizationType

    data = quantize(x, kind) if kind != "F32" else x.astype(np.float32)
    raw = GGMLQuantizationType[kind] if data.dtype == np.uint8 else None
    writer.add_tensor(name, data, raw_dtype=raw)
