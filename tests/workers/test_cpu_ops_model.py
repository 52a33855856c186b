"""The model with the native fused CPU ops (RMSNorm + residual, SwiGLU, rotary + KV store,
greedy argmax) gives exactly the results of its PyTorch path: same logits bit for bit, same KV
cache, same greedy tokens, in float32 and bfloat16, over mixed prefill / decode steps."""

from __future__ import annotations

import pytest
import torch

from mqinfer.kernels import cpu_ops
from mqinfer.kernels.attention import build_attention_metadata
from mqinfer.kernels.sampling import greedy
from mqinfer.workers.engine.loader import load_model, make_random_checkpoint

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_ops_available(), reason="no C compiler for the native CPU ops")

BLOCK = 16
# Two sequences over three steps: prefills (one in two chunks), then decodes.
PROMPTS = ([5, 17, 250, 3, 99, 42, 42, 7, 150, 5, 61, 200, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18],
           [1, 2, 3, 4, 5, 6, 7, 300, 301, 302, 303, 304, 305, 306, 307, 308])
STEPS = [(22, 7), (1, 9), (1, 1), (1, 1)]  # new tokens per sequence per step


def _run(model, info):
    """Logits of every packed row of every step, the sampled tokens, and the final caches."""
    num_blocks = 8
    tables = [[6, 1, 4], [0, 7, 2]]  # non-trivial block order
    caches = [
        (torch.zeros(num_blocks, BLOCK, info.num_kv_heads, info.head_dim, dtype=model.dtype),
         torch.zeros(num_blocks, BLOCK, info.num_kv_heads, info.head_dim, dtype=model.dtype))
        for _ in range(info.num_layers)
    ]
    tokens = [list(PROMPTS[0]), list(PROMPTS[1])]
    done = [0, 0]
    logits_all, sampled = [], []
    with torch.inference_mode():
        for step in STEPS:
            ids = []
            for s, n in enumerate(step):
                ids += tokens[s][done[s]:done[s] + n]
            seq_lens = [done[s] + step[s] for s in range(2)]
            md = build_attention_metadata(list(step), seq_lens, tables, BLOCK, info.num_heads // info.num_kv_heads)
            hidden = model(torch.tensor(ids), md.positions, caches, md)
            logits = model.compute_logits(hidden)
            logits_all.append(logits)
            last = torch.tensor([step[0] - 1, step[0] + step[1] - 1])
            picked = greedy(logits.index_select(0, last)).tolist()
            sampled.append(picked)
            for s in range(2):
                done[s] = seq_lens[s]
                if done[s] == len(tokens[s]):
                    tokens[s].append(picked[s])
    return torch.cat(logits_all), sampled, caches


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_ops_change_nothing(tmp_path, monkeypatch, one_torch_thread, arch, dtype):
    # head_dim 64 with 4 query heads per KV head: the AVX-512 attention kernel too; an
    # intermediate size that is not a multiple of 64 exercises SwiGLU's scalar tail.
    make_random_checkpoint(tmp_path, dtype="float32", seed=3, architectures=[arch], hidden_size=256,
                           intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=64, vocab_size=400)
    model, info = load_model(str(tmp_path), "cpu", dtype)
    torch.manual_seed(0)
    with torch.no_grad():  # random norm weights: a misplaced norm or residual would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    assert cpu_ops.native_for(model.model.embed_tokens.weight)
    native_logits, native_tokens, native_caches = _run(model, info)
    monkeypatch.setenv("MQINFER_CPU_OPS", "torch")
    assert not cpu_ops.native_for(model.model.embed_tokens.weight)
    ref_logits, ref_tokens, ref_caches = _run(model, info)

    assert native_logits.dtype == model.dtype
    assert torch.equal(native_logits, ref_logits)
    assert native_tokens == ref_tokens
    for (k1, v1), (k2, v2) in zip(native_caches, ref_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # The logits are not degenerate (the comparison means something).
    assert float(native_logits.float().std()) > 0
