"""Dense layers in bfloat16 through oneDNN with the weight laid out once (kernels/linear_onednn.py):
the bits of ``F.linear``, taken by the model's layers on CPUs without AMX up to its row limit, and
off under the dense layers' switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mqinfer.kernels import linear_amx, linear_onednn

pytestmark = pytest.mark.skipif(not linear_onednn.available(),
                                reason="this CPU's oneDNN has no native bfloat16 matmul, or the CPU has AMX")


@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 64), (17, 40)])
@pytest.mark.parametrize("rows", [1, 7, 64, 200, linear_onednn.MAX_ROWS])
def test_the_bits_of_f_linear(out_features, in_features, rows):
    torch.manual_seed(rows)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    packed = linear_onednn.pack(w)
    assert packed is not None and packed.packed_from(w) and not packed.packed_from(w.clone())
    assert torch.equal(linear_onednn.linear(x, packed, bias), F.linear(x, w, bias))
    assert torch.equal(linear_onednn.linear(x, packed), F.linear(x, w))
    # Rows that are a strided view of wider ones.
    wide = torch.randn(rows, in_features + 8).bfloat16()
    assert torch.equal(linear_onednn.linear(wide[:, :in_features], packed), F.linear(wide[:, :in_features], w))


def test_what_it_takes_and_clear_errors(monkeypatch):
    w = torch.randn(64, 96).bfloat16()
    assert linear_onednn.pack(w.float()) is None  # float32 stays with the float32 kernels
    assert linear_onednn.takes(torch.zeros(linear_onednn.MAX_ROWS, 96, dtype=torch.bfloat16))
    assert not linear_onednn.takes(torch.zeros(linear_onednn.MAX_ROWS + 1, 96, dtype=torch.bfloat16))
    assert not linear_onednn.takes(torch.zeros(0, 96, dtype=torch.bfloat16))
    assert not linear_onednn.takes(torch.zeros(4, 96))
    packed = linear_onednn.pack(w)
    with pytest.raises(ValueError, match=r"bfloat16 tensor \[T, 96\]"):
        linear_onednn.linear(torch.zeros(4, 95, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"bias must be a bfloat16 tensor \[64\]"):
        linear_onednn.linear(torch.zeros(4, 96, dtype=torch.bfloat16), packed, torch.zeros(63, dtype=torch.bfloat16))
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    assert linear_onednn.pack(w) is None and not linear_onednn.takes(torch.zeros(4, 96, dtype=torch.bfloat16))


@pytest.mark.skipif(linear_amx.available(), reason="with AMX the model's bfloat16 layers take the AMX kernel")
def test_the_models_layers_take_it_up_to_the_row_limit_with_the_same_outputs(tmp_path, monkeypatch):
    from mqinfer.loadgen.checkpoint import make_llama_checkpoint
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine
    from mqinfer.workers.engine.models.layers import LMHead, Linear

    folder = make_llama_checkpoint(tmp_path / "ck", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=128)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", num_threads=1, num_kv_blocks=32))
    layers = [m for m in engine.model.modules() if isinstance(m, (Linear, LMHead))]
    # Laid out at start-up, every dense layer and the LM head.
    assert all(isinstance(m.packed, linear_onednn.OneDnnWeight) and m.packed.packed_from(m.weight) for m in layers)
    torch.manual_seed(0)
    for m in layers:
        for rows in (3, linear_onednn.MAX_ROWS, linear_onednn.MAX_ROWS + 1):
            x = torch.randn(rows, m.weight.shape[1]).bfloat16()
            bias = getattr(m, "bias", None)
            assert torch.equal(m(x), F.linear(x, m.weight, bias))
    # Greedy outputs with it and with every layer on F.linear are the same.
    from mqinfer.scheduler.request import SamplingParams

    def outputs():
        prompts = {f"r{i}": [3 + (7 * i + j) % 290 for j in range(5 + 3 * i)] for i in range(6)}
        for rid, ids in prompts.items():
            engine.add_request(rid + str(len(got)), ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        done = {}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.finished:
                    done[o.request_id[:2]] = o.output_token_ids
        return done

    got: list = []
    got.append(outputs())
    monkeypatch.setenv("MQINFER_CPU_LINEAR", "torch")
    got.append(outputs())
    assert got[0] == got[1] and len(got[0]) == 6
