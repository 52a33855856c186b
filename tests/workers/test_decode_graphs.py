"""Decode-only steps over static padded buffers (workers/engine/decode_graphs.py), through its CPU stand-in:
the engine with them gives exactly the eager engine's float32 tokens, greedy and seeded, at batch
sizes that need padding, under recompute and swap preemption and with n > 1; prompt steps stay
eager; the padded sizes; the scratch block is held for good; the set-up is timed and logged;
--enforce-eager (flag, environment, config file) keeps an engine eager."""

from __future__ import annotations

import logging

import pytest
import torch

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.decode_graphs import (
    decode_graphs_wanted,
    enable_decode_graphs,
    padded_size,
    padded_sizes,
)
from mqinfer.workers.engine.core import LLMEngine


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_threads=1, **kw))


def _prompts(batch: int) -> list[list[int]]:
    # Distinct lengths, so that the sequences' contexts (and block tables) differ.
    return [[7 + (i * 13 + j * 5) % 200 for j in range(5 + 7 * i)] for i in range(batch)]


def _run(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                assert o.error is None, o.error
                out[f"{o.request_id}/{o.index}"] = list(o.output_token_ids)
    return out


GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch", [3, 5, 9])  # padded to 4, 8 and 16
def test_padded_decode_steps_give_the_eager_tokens(batch):
    eager = _run(_engine(max_num_seqs=16), _prompts(batch), GREEDY)
    engine = _engine(max_num_seqs=16)
    graphs = enable_decode_graphs(engine)
    assert engine.runner.decode_graphs is graphs and padded_size(batch, graphs.sizes) > batch
    assert _run(engine, _prompts(batch), GREEDY) == eager
    # Each request's first token comes from its prompt step (eager); the other 13 from decode steps.
    assert graphs.replays >= GREEDY.max_tokens - 1


def test_the_pytorch_attention_path_plans_each_padded_step(monkeypatch):
    """Without the native kernel, attention plans its groups per step; the padded step's plan
    must be the padded step's own, not the first one's."""
    monkeypatch.setenv("MQINFER_CPU_ATTENTION", "torch")
    eager = _run(_engine(max_num_seqs=8), _prompts(5), GREEDY)
    engine = _engine(max_num_seqs=8)
    graphs = enable_decode_graphs(engine)
    assert _run(engine, _prompts(5), GREEDY) == eager and graphs.replays > 0


def test_seeded_sampling_and_n_choices_give_the_eager_tokens():
    for sampling in (SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=3),
                     SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=11, ignore_eos=True, n=3)):
        eager = _run(_engine(max_num_seqs=16), _prompts(2), sampling)
        engine = _engine(max_num_seqs=16)
        graphs = enable_decode_graphs(engine)
        got = _run(engine, _prompts(2), sampling)
        assert len(got) == 6 and got == eager
        assert graphs.replays > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_give_the_eager_tokens(mode):
    kw = dict(max_num_seqs=8, num_kv_blocks=24, block_size=4, preemption_mode=mode, swap_space_gib=0.01)
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eager_engine = _engine(**kw)
    eager = _run(eager_engine, _prompts(7), sampling)
    # One block fewer for the eager engine, as the scratch block takes one from the graphed one.
    engine = _engine(**{**kw, "num_kv_blocks": 25})
    graphs = enable_decode_graphs(engine)
    assert _run(engine, _prompts(7), sampling) == eager
    assert engine.scheduler.num_preemptions_total > 0 and graphs.replays > 0


def test_prompt_steps_stay_eager_and_the_scratch_block_is_held():
    engine = _engine(max_num_seqs=4)
    pool = engine.scheduler.kv_cache_manager.block_pool
    free = pool.num_free_blocks
    graphs = enable_decode_graphs(engine)
    assert pool.num_free_blocks == free - 1
    engine.add_request("one", list(range(10, 40)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert graphs.replays == steps - 1  # every step but the prompt's
    assert pool.num_free_blocks == free - 1  # the request's blocks came back; the scratch block did not
    assert not graphs.accepts([1, 2], [[0], [1]]) and not graphs.accepts([1] * 5, [[0]] * 5)


def test_padded_sizes():
    assert padded_sizes(1) == [1]
    assert padded_sizes(6) == [1, 2, 4, 6]
    assert padded_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert padded_sizes(256)[-6:] == [176, 192, 208, 224, 240, 256]
    assert padded_sizes(100)[-3:] == [80, 96, 100]
    sizes = padded_sizes(256)
    assert [padded_size(b, sizes) for b in (1, 3, 5, 9, 17, 65, 256, 257)] == [1, 4, 8, 16, 24, 80, 256, None]
    with pytest.raises(ValueError):
        padded_sizes(0)


def test_set_up_time_is_logged(caplog):
    engine = _engine(max_num_seqs=8)
    with caplog.at_level(logging.INFO, logger="mqinfer.workers.engine.decode_graphs"):
        graphs = enable_decode_graphs(engine)
    assert graphs.setup_seconds >= 0 and not graphs.captured  # nothing is captured on CPU
    assert any("decode graphs: 4 batch sizes (1,2,4,8)" in r.getMessage() for r in caplog.records)


def test_enforce_eager_and_where_graphs_are_not_used(tmp_path, monkeypatch):
    from mqinfer.cli import RUN_CMD, WORKER_CMD, build_parser, config_keys
    from mqinfer.commands import engine_config
    from mqinfer.config import ENGINE_OPTIONS, load_config_file, resolve

    for name in [n for n in __import__("os").environ if n.startswith("MQINFER_")]:
        monkeypatch.delenv(name)

    def resolved(argv, file_text="", command="worker", options=WORKER_CMD):
        path = tmp_path / "mq.toml"
        path.write_text(file_text)
        values = load_config_file(path, command, config_keys(build_parser()))
        args = build_parser().parse_args([command, *argv, *(["in.jsonl"] if command == "run" else [])])
        return engine_config(resolve(args, options, values, ())).enforce_eager

    assert resolved([]) is False
    assert resolved(["--enforce-eager"]) is True
    assert resolved([], "enforce-eager = true\n") is True
    assert resolved([], "enforce-eager = true\n", command="run", options=RUN_CMD) is True
    monkeypatch.setenv("MQINFER_ENFORCE_EAGER", "1")
    assert resolved([]) is True and resolved(["--no-enforce-eager"]) is False

    cuda = torch.device("cuda")
    assert decode_graphs_wanted(EngineConfig(), cuda) is None
    assert decode_graphs_wanted(EngineConfig(enforce_eager=True), cuda) == "--enforce-eager"
    assert "not on CUDA" in decode_graphs_wanted(EngineConfig(), torch.device("cpu"))
    assert decode_graphs_wanted(EngineConfig(speculative="ngram"), cuda) is not None
    assert decode_graphs_wanted(EngineConfig(tensor_parallel_size=2), cuda) is not None
    assert _engine(max_num_seqs=4).runner.decode_graphs is None  # the CPU engine stays eager by default
    option = next(o for o in ENGINE_OPTIONS if o.name == "enforce_eager")
    assert option.default is False and "CUDA graphs" in option.help
