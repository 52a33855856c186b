"""SchedulerConfig checks itself when built."""

from __future__ import annotations

import pytest

from mqinfer.scheduler.config import SchedulerConfig


def test_defaults_are_valid():
    config = SchedulerConfig()
    assert (config.block_size, config.num_kv_blocks) == (16, 4096)
    assert config.num_cache_tokens == 16 * 4096
    assert config.enable_prefix_caching is True
    # The measured step limits (BENCHMARKS.md); the engine's and the CLI's defaults are these.
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (2048, 256)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size must be at least 1, got 0"),
        ({"num_kv_blocks": -3}, "num_kv_blocks must be at least 1, got -3"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"max_model_len": 0}, "max_model_len must be at least 1"),
        ({"block_size": 16.0}, "block_size must be an integer"),
        ({"num_kv_blocks": True}, "num_kv_blocks must be an integer"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be true or false"),
        (
            {"max_num_batched_tokens": 64, "max_num_seqs": 65},
            r"max_num_batched_tokens \(64\) must be at least max_num_seqs \(65\)",
        ),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_frozen():
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.block_size = 32
