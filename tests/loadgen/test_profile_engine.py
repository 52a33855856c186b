"""The engine profiler: it drives the real engine over a standard-workload subset, accounts every
step's time to its phases, and compares with transformers on the same requests."""

from __future__ import annotations

import argparse

import pytest

from mqinfer.loadgen.checkpoint import make_llama_checkpoint
from mqinfer.loadgen.profile_engine import PHASES, build_engine, main, run_engine, step_medians
from mqinfer.loadgen.workload import standard_workload

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return str(make_llama_checkpoint(tmp_path_factory.mktemp("ck") / "small", **SMALL))


def _args(**kw) -> argparse.Namespace:
    base = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, num_threads=1, num_kv_blocks=256,
                block_size=16, quantization="none", kv_cache_dtype="auto")
    return argparse.Namespace(**{**base, **kw})


def test_run_engine_generates_every_token_and_accounts_the_steps(small_checkpoint):
    engine = build_engine(small_checkpoint, _args())
    requests = standard_workload(vocab_size=300, n=6, seed=3)
    fig = run_engine(engine, requests)
    assert fig.tokens == sum(r["max_tokens"] for r in requests)
    assert sorted(fig.outputs) == sorted(r["id"] for r in requests)
    assert [len(fig.outputs[r["id"]]) for r in requests] == [r["max_tokens"] for r in requests]
    # 8 seqs and 256 tokens a step: at least the longest output's worth of steps.
    assert fig.steps >= max(r["max_tokens"] for r in requests)
    assert set(fig.phase_seconds) == set(PHASES)
    assert all(v >= 0 for v in fig.phase_seconds.values())
    assert fig.phase_seconds["forward"] > 0 and fig.wall_s >= sum(fig.phase_seconds.values()) * 0.9
    # Greedy and seeded by nothing else: a second run of the same requests gives the same tokens.
    again = run_engine(engine, [dict(r, id=r["id"] + "-again") for r in requests])
    assert {k[: -len("-again")]: v for k, v in again.outputs.items()} == fig.outputs


def test_kv_cache_dtype_reaches_the_engine(small_checkpoint, capsys):
    import torch

    engine = build_engine(small_checkpoint, _args(kv_cache_dtype="int8"))
    assert {cache.k.dtype for cache in engine.runner.kv_caches} == {torch.int8}
    code = main(["--model", small_checkpoint, "--num-requests", "2", "--dtype", "float32", "--num-threads", "1",
                 "--max-num-seqs", "8", "--kv-cache-dtype", "fp8", "--hf-batch-size", "0"])
    assert code == 0 and "KV cache fp8" in capsys.readouterr().out


def test_main_prints_phases_and_the_ratio_to_transformers(small_checkpoint, capsys):
    code = main(["--model", small_checkpoint, "--num-requests", "3", "--dtype", "float32", "--num-threads", "1",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--hf-batch-size", "3",
                 "--torch-profile", "--top", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mqinfer engine:" in out and "outside the forward pass" in out
    assert "hf static@3:" in out and "ratio mqinfer / hf static@3" in out
    # float32 greedy on the same checkpoint: the same tokens as transformers.
    assert "identical=1.0" in out
    assert "Self CPU time total" in out  # the torch.profiler table


def test_prefill_latency_times_one_request_alone(small_checkpoint, capsys):
    code = main(["--model", small_checkpoint, "--dtype", "float32", "--num-threads", "1", "--num-requests", "1",
                 "--prefill-latency", "4,40"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("prompt of")]
    assert [line.split()[2] for line in lines] == ["4", "40"]
    assert all(float(line.split("after ")[1].split(" ms")[0]) > 0 for line in lines)
    with pytest.raises(SystemExit):
        main(["--model", small_checkpoint, "--prefill-latency", "4,x"])


def test_step_medians_time_decoding_and_joining_steps(small_checkpoint):
    engine = build_engine(small_checkpoint, _args())
    steps_before = engine.num_steps
    decode, joined = step_medians(engine, batch=4, context=10, prefill=20, steps=5, prefills=3)
    assert decode > 0 and joined > 0
    # Two warm steps, the timed ones, then the decoding sequences run to their end.
    assert engine.num_steps - steps_before >= 2 + 5 + 3
    assert not engine.has_unfinished()


def test_step_medians_joins_several_prompts_in_one_step(small_checkpoint, capsys):
    engine = build_engine(small_checkpoint, _args())
    finished = []
    step = engine.step

    def counting_step():
        result = step()
        finished.extend(o.request_id for o in result.outputs if o.finished and o.request_id.startswith("join-"))
        return result

    engine.step = counting_step
    step_medians(engine, batch=2, context=10, prefill=8, steps=2, prefills=3, joins=2)
    assert sorted(finished) == sorted(f"join-{k}-{j}" for k in range(3) for j in range(2))
    assert main(["--model", small_checkpoint, "--step-medians", "--step-batch", "2", "--step-prefill", "8",
                 "--step-joins", "3"]) == 0
    assert "3 prompt(s) of 8 tokens join them" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", small_checkpoint, "--step-medians", "--step-joins", "0"])


@pytest.fixture(scope="module")
def timed_run(small_checkpoint):
    """One engine run with its ops clocked: (the clocks, the run's figures, whether every op was
    put back afterwards)."""
    from mqinfer.kernels import cpu_ops
    from mqinfer.kernels import linear as dense
    from mqinfer.loadgen.op_timer import timing_ops

    engine = build_engine(small_checkpoint, _args())
    originals = (dense.linear, dense.swiglu, cpu_ops.add_rms_norm, cpu_ops.rotary_store_kv)
    attention = engine.model.model.layers[0].self_attn
    original_attention = attention.paged_attention
    requests = standard_workload(vocab_size=300, n=4, seed=5)
    with timing_ops(engine.model) as times:
        fig = run_engine(engine, requests)
    put_back = ((dense.linear, dense.swiglu, cpu_ops.add_rms_norm, cpu_ops.rotary_store_kv) == originals
                and attention.paged_attention is original_attention)
    return times, fig, put_back


def test_op_timing_clocks_the_kernels_and_puts_them_back(timed_run):
    times, fig, put_back = timed_run
    # Two layers: one attention call per layer per step, and what the clocks saw fits in the
    # forward pass they ran inside.
    assert times.calls["attention"] == 2 * fig.steps
    assert 0 < sum(times.seconds.values()) <= fig.phase_seconds["forward"]
    table = times.table(fig.phase_seconds["forward"])
    assert "attention" in table and "everything else" in table
    assert put_back


def test_each_op_is_held_against_its_own_roof(timed_run):
    from mqinfer.loadgen.op_roofs import Roofs, measure_roofs, roof_table

    times, fig, _ = timed_run
    # The bytes attention must move: every key and value of each step's contexts, so more than the
    # cache of one step's tokens, and counted per call.
    assert times.bytes["attention"] > 0 and times.bytes["residual + RMSNorm"] > 0
    assert times.bytes["rotary + KV store"] > 0
    dense = [name for name in times.shapes if name.startswith("dense")]
    assert dense and all(len(times.shapes[n]) == 2 and times.rows[n] >= times.calls[n] for n in dense)
    roofs = measure_roofs(times, "float32")
    assert roofs.copy_bytes_per_s > 1e8 and set(roofs.dense_flops_per_s) == set(dense)
    assert all(rate > 0 for rate in roofs.dense_flops_per_s.values())
    table = roof_table(times, roofs, fig.phase_seconds["forward"], fig.phase_seconds)
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "GB/s" in lines["attention"] and "%" in lines["attention"].split("GB/s")[-1]
    assert all("GF/s" in lines[name] for name in dense)
    assert "forward, outside the ops" in table and "step: schedule" in table and "step: sample" in table
    # A roof of zero bytes per second cannot give a share: the column is left empty, not infinite.
    empty = roof_table(times, Roofs(copy_bytes_per_s=0.0), fig.phase_seconds["forward"], {})
    assert "inf" not in empty


def test_op_timing_clocks_the_native_dense_layers(timed_run):
    from mqinfer.kernels import linear as dense

    if not dense.native_linear_available():
        pytest.skip("no native dense kernel for this CPU: its dense layers run on PyTorch")
    times, fig, _ = timed_run
    assert times.calls["dense lm_head"] == fig.steps and times.flops["dense qkv_proj"] > 0


def test_op_timing_names_the_int8_layers(small_checkpoint):
    from mqinfer.kernels import linear_int8 as q8
    from mqinfer.loadgen.op_timer import timing_ops

    if not q8.native_available():
        pytest.skip("no native int8 kernel for this CPU (it needs AVX2, or AVX-512 with VNNI)")
    engine = build_engine(small_checkpoint, _args(quantization="w8a8"))
    originals = (q8.linear, q8.swiglu)
    with timing_ops(engine.model) as times:
        fig = run_engine(engine, standard_workload(vocab_size=300, n=4, seed=5))
    assert times.calls["dense qkv_proj (int8)"] == 2 * fig.steps and times.flops["dense down_proj (int8)"] > 0
    # w8a8 quantizes the LM head too (--quantize-lm-head): once per step, on the sampled rows.
    assert times.calls["dense lm_head (int8)"] == fig.steps and "dense lm_head" not in times.calls
    assert (q8.linear, q8.swiglu) == originals


def test_op_timing_clocks_each_layer_of_a_bfloat16_step(small_checkpoint, monkeypatch):
    """On an AMX CPU a bfloat16 step's decoder layers run in one native call, whose kernels no
    clock can see: while the ops are timed the layers run one call at a time, so every layer's
    attention is clocked, and the switch is as it was afterwards."""
    import os

    from mqinfer.kernels import linear_amx
    from mqinfer.loadgen.op_timer import timing_ops

    LAYERS_SWITCH = "MQINFER_CPU_LAYERS"
    if not linear_amx.available():
        pytest.skip("needs a CPU with AMX tiles (the only one where the layers run in one call)")
    monkeypatch.delenv(LAYERS_SWITCH, raising=False)
    engine = build_engine(small_checkpoint, _args(dtype="bfloat16"))
    requests = standard_workload(vocab_size=300, n=4, seed=5)
    with timing_ops(engine.model) as times:
        fig = run_engine(engine, requests)
    assert times.calls["attention"] == 2 * fig.steps
    assert LAYERS_SWITCH not in os.environ
