"""`mqinfer bench` reads MQINFER_<FLAG> and --config like every other command."""

from __future__ import annotations

import argparse

import pytest

from mqinfer.cli import build_parser, config_keys
from mqinfer.config import ConfigError, fill_from_env_and_config, load_config_file


def bench_args(argv: list[str], config=None):
    parser = build_parser()
    args = parser.parse_args(["bench", *argv])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    values = load_config_file(config, "bench", config_keys(parser)) if config else {}
    return fill_from_env_and_config(sub, args, argv, values)


def test_env_and_config_fill_what_the_command_line_leaves(monkeypatch, tmp_path):
    cfg = tmp_path / "mq.toml"
    cfg.write_text('[bench]\nworkload = "fixed"\nprompt-len = 32\nhf_batch_sizes = [8, 16]\nskip_engine = true\n')
    monkeypatch.setenv("MQINFER_NUM_REQUESTS", "7")
    args = bench_args([], cfg)
    assert (args.num_requests, args.workload, args.prompt_len, args.hf_batch_sizes, args.skip_engine) == \
        (7, "fixed", 32, [8, 16], True)
    # The command line wins over both, abbreviated or not.
    args = bench_args(["--num-requests", "5", "--worklo", "uniform"], cfg)
    assert (args.num_requests, args.workload) == (5, "uniform")
    monkeypatch.delenv("MQINFER_NUM_REQUESTS")
    assert bench_args([]).num_requests == 256  # the default


def test_bad_values_name_the_flag_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("MQINFER_WORKLOAD", "huge")
    with pytest.raises(ConfigError, match=r"--workload \(from environment MQINFER_WORKLOAD\)"):
        bench_args([])
    monkeypatch.delenv("MQINFER_WORKLOAD")
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[bench]\nnum_requestz = 3\n")
    with pytest.raises(ConfigError, match="bench.num_requestz is not a flag of any command"):
        bench_args([], cfg)
