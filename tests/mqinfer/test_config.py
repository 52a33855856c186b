"""Flags resolve command line > environment > config file > default, with clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mqinfer.cli import WORKER_CMD, build_parser
from mqinfer.config import ConfigError, load_config_file, resolve


def _resolve(argv, file_values=None, required=()):
    args = build_parser().parse_args(["worker", *argv])
    return resolve(args, WORKER_CMD, file_values or {}, required)


def test_precedence(monkeypatch, tmp_path):
    cfg = tmp_path / "mq.toml"
    cfg.write_text('max-batch = 8\nmax_wait_ms = 3.5\n[worker]\nblock_size = 32\n')
    values = load_config_file(cfg, "worker")
    opts = _resolve([], values)
    assert (opts["max_batch"], opts["max_wait_ms"], opts["block_size"]) == (8, 3.5, 32)
    monkeypatch.setenv("MQINFER_MAX_BATCH", "16")
    assert _resolve([], values)["max_batch"] == 16
    assert _resolve(["--max-batch", "4"], values)["max_batch"] == 4
    assert _resolve([])["max_num_seqs"] == 256  # default


def test_bool_and_optional_values(monkeypatch):
    assert _resolve([])["no_prefix_cache"] is False
    assert _resolve(["--no-prefix-cache"])["no_prefix_cache"] is True
    monkeypatch.setenv("MQINFER_NO_PREFIX_CACHE", "yes")
    assert _resolve([])["no_prefix_cache"] is True
    assert _resolve(["--idle-exit-s", "2.5"])["idle_exit_s"] == 2.5
    assert _resolve(["--num-kv-blocks", "auto"])["num_kv_blocks"] is None


def test_errors_name_the_flag_and_source(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"--max-batch \(from command line\)"):
        _resolve(["--max-batch", "lots"])
    monkeypatch.setenv("MQINFER_DEVICE", "tpu")
    with pytest.raises(ConfigError, match=r"--device \(from environment MQINFER_DEVICE\): 'tpu' is not one of"):
        _resolve([])
    monkeypatch.delenv("MQINFER_DEVICE")
    with pytest.raises(ConfigError, match="--redis is required"):
        _resolve([], required=("redis",))
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(bad, "worker")


def test_help_lists_every_flag_with_default_and_env():
    out = subprocess.run([sys.executable, "-m", "mqinfer", "worker", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag, default in [("--max-batch", "64"), ("--max-wait-ms", "10.0"), ("--block-size", "16"),
                          ("--claim-idle-ms", "30000"), ("--max-deliveries", "3")]:
        assert flag in text
        env = "MQINFER_" + flag[2:].upper().replace("-", "_")
        assert f"(default: {default}; env {env})" in text


def test_missing_required_flag_exits_2_with_message():
    out = subprocess.run([sys.executable, "-m", "mqinfer", "worker", "--out", "x"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "--redis is required" in out.stderr
