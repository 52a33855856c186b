"""Pipeline parallelism on CPU: two and four gloo stages (one thread each), and two stages of two
tensor-parallel ranks, against one rank.

Greedy float32 output must be token for token the same as one rank's, on a Llama (grouped-query
attention) and a Qwen2 (q/k/v biases, tied embeddings: the last stage reads the embedding as its
head), with chunked prefill, preemption (recompute and swap), prefix-cache hits and an 8-bit KV
cache; seeded sampling must draw the same tokens. Each stage reads only its own tensors and its KV
cache holds only its own layers; the stages chained in one process compute the whole model's
hidden states bit for bit.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from mqinfer.cli import RUN_CMD, WORKER_CMD, build_parser, config_keys
from mqinfer.commands import engine_config
from mqinfer.config import load_config_file, resolve
from mqinfer.kernels.attention import build_attention_metadata
from mqinfer.workers import devices
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.loader import load_model
from mqinfer.workers.engine.models.config import ModelLoadError
from mqinfer.workers.engine.models.stage import Stage
from mqinfer.workers.engine.parallel import StepPlan
from mqinfer.workers.engine.pipeline import MICRO_BATCHES_ENV, micro_batches, split_micro_batches
from tests.workers.parallel_helpers import (
    CASES, Outcome, assert_generates_what_one_rank_does, llama_checkpoint, prompts, qwen2_checkpoint,
    record_safetensors_reads, run_engine,
)

NUM_NEW = 8
NUM_PROMPTS = 10
LAYERS = 4


def _run(folder, case: str, tp: int = 1, pp: int = 1, inspect=None) -> Outcome:
    return run_engine(folder, CASES[case], num_new=NUM_NEW, num_prompts=NUM_PROMPTS, tp=tp, pp=pp, inspect=inspect)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_hf_checkpoint):
    return llama_checkpoint(make_hf_checkpoint, tmp_path_factory.mktemp("pp-llama"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, make_hf_checkpoint):
    return qwen2_checkpoint(make_hf_checkpoint, tmp_path_factory.mktemp("pp-qwen2"), num_hidden_layers=LAYERS)


# Micro-batches per step: forced (these steps are too small for the rule to cut them, which the
# swap case keeps: it cuts only its larger prefill steps).
@pytest.mark.parametrize("family,case,tp,pp,micro", [
    ("llama", "chunked-recompute", 1, 2, "2"),
    ("qwen2", "swap", 1, 2, None),
    ("llama", "int8-kv", 1, 4, "4"),
    ("qwen2", "chunked-recompute", 2, 2, "3"),
])
def test_stages_generate_what_one_rank_does(request, monkeypatch, family, case, tp, pp, micro):
    folder = request.getfixturevalue(family)
    one = _run(folder, case)
    if micro is not None:
        monkeypatch.setenv(MICRO_BATCHES_ENV, micro)  # read by every rank (the ranks inherit it)
    billed, cuts = [], Counter()

    def bills(engine):  # on a 16-core machine, T x P one-thread ranks hold T x P sixteenths of it
        with monkeypatch.context() as patch:
            patch.setattr(devices, "usable_cores", lambda: 16)
            billed.append((engine.device_share, len(engine.tensor_parallel.procs)))
        cuts.update(engine.runner.steps_by_micro_batches)

    many = _run(folder, case, tp, pp, bills)
    assert billed == [(tp * pp / 16, tp * pp - 1)]
    # Steps were cut (three ways and more where forced to; the rule kept some whole).
    assert max(cuts) >= min(int(micro or 2), 3) and (micro is not None or cuts[1] > 0), cuts
    assert_generates_what_one_rank_does(one, many)
    # Rank 0's cache holds stage 0's layers only (Qwen2's one KV head: replicated over tensor ranks).
    assert many.kv_cache_bytes == one.kv_cache_bytes * Stage.of(LAYERS, 0, pp).num_layers // LAYERS


def test_stages_chained_compute_the_whole_models_hidden_states(llama, qwen2):
    for folder in (llama, qwen2):
        whole, info = load_model(str(folder))
        stages = [load_model(str(folder), stage=(s, 3))[0] for s in range(3)]
        assert [m.stage.num_layers for m in stages] == [2, 1, 1]
        block_size, blocks = 8, 6
        shape = (blocks, block_size, info.num_kv_heads, info.head_dim)

        def caches(n):
            return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(n)]

        whole_kv, stage_kv, split_kv = caches(LAYERS), [caches(m.stage.num_layers) for m in stages], caches(LAYERS)
        prompt = torch.tensor(prompts(info.vocab_size, 1, seed=5)[0][:30])
        steps = [(prompt, [30], [30]), (torch.tensor([17]), [1], [31])]  # a prefill, then a decode
        with torch.inference_mode():
            for ids, query_lens, seq_lens in steps:
                meta = build_attention_metadata(query_lens, seq_lens, [list(range(blocks))], block_size,
                                                info.num_heads // info.num_kv_heads)
                expected = whole(ids, meta.positions, whole_kv, meta)
                hidden = ids
                for model, kv in zip(stages, stage_kv):
                    hidden = model(hidden, meta.positions, kv, meta)
                assert torch.equal(hidden, expected)
                # The whole model's own layers run as two ranges, the residual stream between them.
                h = whole.run_layers(whole.embed(ids), meta.positions, split_kv[:1], meta, stop=1, final_norm=False)
                assert torch.equal(whole.run_layers(h, meta.positions, split_kv[1:], meta, start=1), expected)
                rows = torch.tensor([len(ids) - 1])
                assert torch.equal(stages[-1].compute_logits(hidden[rows]), whole.compute_logits(expected[rows]))
        for s, kv in zip(range(3), stage_kv):  # each stage's cache holds its own layers' KV
            start = stages[s].stage.start
            for i, (k, v) in enumerate(kv):
                assert torch.equal(k, whole_kv[start + i][0]) and torch.equal(v, whole_kv[start + i][1])


def test_each_stage_reads_only_its_own_tensors(qwen2, monkeypatch):
    reads = record_safetensors_reads(monkeypatch)
    layers = {0: {"model.layers.0.", "model.layers.1."}, 1: {"model.layers.2.", "model.layers.3."}}
    for s in (0, 1):
        reads.clear()
        model, info = load_model(str(qwen2), stage=(s, 2))
        read = [name for name, _ in reads]
        assert read and all(name.startswith(tuple(layers[s])) or name in ("model.embed_tokens.weight",
                                                                         "model.norm.weight") for name in read)
        assert ("model.embed_tokens.weight" in read) and (("model.norm.weight" in read) == (s == 1))
        assert len(model.model.layers) == 2 and info.num_layers == LAYERS
    # Tied embeddings: the last stage's head is the embedding's table, the first stage has no head.
    first, last = load_model(str(qwen2), stage=(0, 2))[0], load_model(str(qwen2), stage=(1, 2))[0]
    assert first.lm_head is None and last.model.embed_tokens is None
    assert torch.equal(last.lm_head.weight, first.model.embed_tokens.weight)


def test_a_model_in_memory_is_cut_into_stages_too():
    # The built-in model (and a GGUF file) is read whole and cut: stage 1 of 2 keeps layers 2 and 3.
    whole = load_model("tiny")[0]
    last = load_model("tiny", stage=(1, 2))[0]
    assert len(last.model.layers) == 2 and last.model.embed_tokens is None
    for mine, theirs in zip(last.model.layers.parameters(), whole.model.layers[2:].parameters()):
        assert torch.equal(mine, theirs)
    assert torch.equal(last.lm_head.weight, whole.lm_head.weight)


def test_the_layers_split_into_stages():
    assert [(s.start, s.stop) for s in (Stage.of(10, i, 4) for i in range(4))] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    stage = Stage.of(4, 1, 2)
    assert (stage.first, stage.last, stage.num_layers) == (False, True, 2)
    assert stage.local_name("model.layers.3.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj.weight"
    assert stage.global_name("model.layers.1.input_layernorm.weight") == "model.layers.3.input_layernorm.weight"
    assert not stage.holds("model.layers.1.mlp.up_proj.weight") and stage.holds("lm_head.weight")
    assert not stage.holds("model.embed_tokens.weight") and stage.holds("model.embed_tokens.weight", True)
    assert not Stage.of(4, 0, 2).holds("model.norm.weight")
    with pytest.raises(ModelLoadError, match="pipeline parallel size 5 exceeds the model's 4 layers"):
        Stage.of(4, 0, 5)


def test_micro_batches_cut_the_requests_into_runs_of_about_equal_tokens():
    plan = StepPlan(query_lens=[10, 1, 1, 1, 9, 2], sample_rows=[9, 10, 11, 12, 21, 23])
    batches = split_micro_batches(plan, 2)
    assert [(b.requests.start, b.requests.stop) for b in batches] == [(0, 3), (3, 6)]  # 12 tokens each
    assert [b.rows for b in batches] == [(0, 12), (12, 24)]
    assert [b.sample_rows for b in batches] == [[9, 10, 11], [0, 9, 11]]
    # As many runs as asked where there are requests enough, never an empty one.
    assert [b.rows for b in split_micro_batches(StepPlan(query_lens=[30, 1, 1]), 3)] == [(0, 30), (30, 31), (31, 32)]
    assert len(split_micro_batches(StepPlan(query_lens=[5]), 4)) == 1
    four = split_micro_batches(StepPlan(query_lens=[1] * 8), 4)
    assert [b.num_rows for b in four] == [2, 2, 2, 2]


def test_a_step_is_cut_only_where_each_micro_batch_has_tokens_enough(monkeypatch):
    monkeypatch.delenv(MICRO_BATCHES_ENV, raising=False)
    # On CPU 32 tokens each: a few decodes stay whole (cut, each would read the weights again).
    assert [micro_batches(2, n, "cpu") for n in (1, 16, 63, 64, 2048)] == [1, 1, 1, 2, 2]
    assert [micro_batches(4, n, "cpu") for n in (64, 100, 128, 4096)] == [2, 3, 4, 4]
    assert micro_batches(2, 300, "cuda") == 1 and micro_batches(2, 512, "cuda") == 2
    monkeypatch.setenv(MICRO_BATCHES_ENV, "3")
    assert micro_batches(2, 1, "cpu") == 3
    monkeypatch.setenv(MICRO_BATCHES_ENV, "0")
    with pytest.raises(ValueError, match="MQINFER_PIPELINE_MICRO_BATCHES must be a whole number of at least 1"):
        micro_batches(2, 100, "cpu")


@pytest.mark.parametrize("command,options", [("worker", WORKER_CMD), ("run", RUN_CMD)])
def test_the_flag_from_every_source(monkeypatch, capsys, tmp_path, command, options):
    for name in [n for n in os.environ if n.startswith("MQINFER_")]:
        monkeypatch.delenv(name)
    positional = ["in.jsonl"] if command == "run" else []

    def stages(argv, file_values=None):
        args = build_parser().parse_args([command, *positional, *argv])
        return engine_config(resolve(args, options, file_values or {}, ())).pipeline_parallel_size

    toml = tmp_path / "mq.toml"
    toml.write_text(f"[{command}]\npipeline-parallel-size = 3\n")
    assert stages([]) == 1
    assert stages([], load_config_file(toml, command, config_keys(build_parser()))) == 3
    monkeypatch.setenv("MQINFER_PIPELINE_PARALLEL_SIZE", "2")
    assert stages([]) == 2
    assert stages(["--pipeline-parallel-size", "4"]) == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--pipeline-parallel-size P" in help_text and "each stage the KV cache of its own layers" in help_text
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        EngineConfig(pipeline_parallel_size=0)


def test_a_draft_or_quantization_is_refused_over_stages():
    with pytest.raises(ValueError, match="--speculative self does not combine with --pipeline-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", pipeline_parallel_size=2, speculative="self")
    with pytest.raises(ValueError, match="--quantization w8a8 does not combine with --pipeline-parallel-size 2"):
        EngineConfig(model="tiny", device="cpu", pipeline_parallel_size=2, quantization="w8a8")
    EngineConfig(model="tiny", device="cpu", pipeline_parallel_size=2, speculative="ngram")


def test_run_places_and_bills_each_worker_on_its_t_x_p_devices(monkeypatch):
    from mqinfer.machine import worker_shares
    from mqinfer.run import placement

    opts = {"workers": 2, "device": "cuda", "devices": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
            "num_threads": 1, "device_share": None}
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    places = placement(opts)
    assert places == [("cuda:0", "0,1"), ("cuda:2", "2,3")]  # each worker's two stages on two devices
    assert worker_shares(opts, places, cuda_count=4) == ([2.0, 2.0], 4.0)
    # On a CPU: the worker's T x P one-thread ranks over the cores.
    cpu = {**opts, "workers": 1, "device": "cpu", "tensor_parallel_size": 2}
    assert worker_shares(cpu, placement(cpu), cores=16) == ([4 / 16], 1.0)
