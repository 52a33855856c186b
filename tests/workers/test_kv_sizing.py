"""The automatic KV cache size: what the engine can use (max_num_seqs full contexts), within the
memory share, logged with its reason; the swap pool bounded the same way; the prefix cache and
swap preemption still work on automatically sized caches."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mqinfer.scheduler.request import SamplingParams
from mqinfer.workers.engine import startup as engine_startup
from mqinfer.workers.config import EngineConfig
from mqinfer.workers.engine.core import LLMEngine
from mqinfer.workers.engine.loader import load_model

TINY_KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads, head dim 64, float32


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def tiny_info():
    return load_model("tiny", "cpu")[1]


def _bound(max_model_len: int, block_size: int, max_num_seqs: int) -> int:
    return math.ceil(max_model_len / block_size) * max_num_seqs


def _auto(info, config: EngineConfig, physical: int, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(engine_startup, "physical_memory", lambda: physical)
    return engine_startup.default_num_kv_blocks(info, torch.device("cpu"), config,
                                                config.max_model_len or info.max_model_len)


@pytest.mark.parametrize("max_num_seqs", [128, 256])
def test_tiny_default_size_is_what_max_num_seqs_full_contexts_use(tiny_info, monkeypatch, max_num_seqs):
    assert tiny_info.kv_bytes_per_token == TINY_KV_BYTES_PER_TOKEN
    config = EngineConfig(max_num_seqs=max_num_seqs)
    blocks, why = _auto(tiny_info, config, 64 << 30, monkeypatch)
    assert blocks == _bound(2048, 16, max_num_seqs) == 128 * max_num_seqs
    assert f"max_num_seqs {max_num_seqs} x 128 blocks for max_model_len 2048" in why


def test_the_bound_rounds_each_sequence_up_to_whole_blocks(tiny_info, monkeypatch):
    # 3 sequences of 100 tokens need 7 blocks of 16 each (21), not ceil(300 / 16) = 19.
    blocks, _ = _auto(tiny_info, EngineConfig(max_num_seqs=3, max_model_len=100), 64 << 30, monkeypatch)
    assert blocks == 21


def test_memory_share_caps_the_size(tiny_info, monkeypatch):
    block_bytes = TINY_KV_BYTES_PER_TOKEN * 16
    # 25% of 64 MiB = 16 MiB = 256 blocks of 64 KiB, far below 256 x 128 usable blocks.
    blocks, why = _auto(tiny_info, EngineConfig(max_num_seqs=256), 64 << 20, monkeypatch)
    assert blocks == (64 << 20) // 4 // block_bytes == 256
    assert "memory budget 16.0 MiB" in why and "would need 32768" in why
    # Less than one full-length sequence fits: still one sequence and a block, so prompts can run.
    blocks, why = _auto(tiny_info, EngineConfig(max_num_seqs=256), 1 << 20, monkeypatch)
    assert blocks == 128 + 1
    assert "one full-length sequence" in why
    # Never more than the absolute cap on CPU (4 GiB), however much memory there is.
    blocks, _ = _auto(tiny_info, EngineConfig(max_num_seqs=4096), 1 << 40, monkeypatch)
    assert blocks == (4 << 30) // block_bytes


def test_engine_uses_and_logs_the_automatic_size(monkeypatch, caplog):
    monkeypatch.setattr(engine_startup, "physical_memory", lambda: 64 << 30)
    with caplog.at_level(logging.INFO, logger="mqinfer.workers.engine.startup"):
        engine = LLMEngine(EngineConfig(num_threads=1, max_num_seqs=3, max_model_len=100))
    assert engine.scheduler_config.num_kv_blocks == 21
    assert engine.runner.kv_cache_bytes == 21 * 16 * TINY_KV_BYTES_PER_TOKEN
    lines = [r.getMessage() for r in caplog.records if "KV cache sized automatically" in r.getMessage()]
    assert lines == ["KV cache sized automatically: 21 blocks x 16 tokens (1.3 MiB): max_num_seqs 3 x 7 blocks "
                     "for max_model_len 100, within the memory budget 4096.0 MiB (25% of 64.0 GiB of memory, "
                     "at most 4 GiB)"]
    # A size given explicitly is used as it is, and no automatic sizing is logged.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mqinfer.workers.engine.startup"):
        explicit = LLMEngine(EngineConfig(num_threads=1, max_num_seqs=3, max_model_len=100, num_kv_blocks=50))
    assert explicit.scheduler_config.num_kv_blocks == 50
    assert not [r for r in caplog.records if "sized automatically" in r.getMessage()]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    finished = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished()
    return finished


def test_prefix_cache_hits_on_an_automatically_sized_cache(monkeypatch):
    monkeypatch.setattr(engine_startup, "physical_memory", lambda: 64 << 30)
    engine = LLMEngine(EngineConfig(num_threads=1, max_num_seqs=2, max_model_len=128))
    assert engine.scheduler_config.num_kv_blocks == 16
    shared = list(range(3, 3 + 48))
    first = _run(engine, [shared + [60, 61]], 4)["r0"]
    again = _run(engine, [shared + [70, 71, 72]], 4)["r0"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # the shared prefix's three full blocks
    assert len(again.output_token_ids) == 4


def test_swap_pool_is_bounded_by_what_the_requests_can_hold(monkeypatch):
    monkeypatch.setattr(engine_startup, "physical_memory", lambda: 64 << 30)
    # 4 GiB of swap space would be 65,536 tiny blocks; 4 requests of 64 tokens hold at most 16.
    engine = LLMEngine(EngineConfig(num_threads=1, max_num_seqs=4, max_model_len=64, num_kv_blocks=6,
                                    preemption_mode="swap", swap_space_gib=4.0))
    assert engine.scheduler.kv_cache_manager.num_swap_blocks == 16
    assert engine.runner.host_cache is not None and engine.runner.host_cache.num_blocks == 16
    # A device cache of 6 blocks for 4 requests of up to 60 tokens: they preempt each other and swap.
    prompts = [[3 + i] * 20 for i in range(4)]
    finished = _run(engine, prompts, 40)
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 40 for o in finished.values())
    assert engine.scheduler.num_swaps_total > 0
    # The outputs are those of a cache big enough for all of them.
    reference = _run(LLMEngine(EngineConfig(num_threads=1, max_num_seqs=4, max_model_len=64, num_kv_blocks=64)),
                     prompts, 40)
    assert {k: v.output_token_ids for k, v in finished.items()} == {k: v.output_token_ids
                                                                     for k, v in reference.items()}


def test_on_cuda_the_size_follows_free_device_memory(tiny_info, monkeypatch):
    block_bytes = TINY_KV_BYTES_PER_TOKEN * 16
    cuda = torch.device("cuda:0")
    free = {"bytes": 100 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 140 << 30))
    config = EngineConfig(max_num_seqs=256)
    # Plenty free: what 256 full contexts use (2 GiB), not 90% of 100 GiB.
    blocks, why = engine_startup.default_num_kv_blocks(tiny_info, cuda, config, 2048)
    assert blocks == 256 * 128
    assert "90% of the 100.0 GiB free on cuda:0 less 2 GiB for activations" in why
    # 3 GiB free: 90% of it less the 2 GiB reserve.
    free["bytes"] = 3 << 30
    blocks, why = engine_startup.default_num_kv_blocks(tiny_info, cuda, config, 2048)
    assert blocks == (int((3 << 30) * 0.9) - (2 << 30)) // block_bytes
    assert "would need 32768" in why
