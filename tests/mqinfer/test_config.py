"""Flags resolve command line > environment > config file > default, with clear errors; every default
of the worker and the engine is the config dataclass's, and on/off flags have their --no- forms."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from mqinfer.cli import REDIS_CMD, RUN_CMD, WORKER_CMD, build_parser, command_parser, config_keys
from mqinfer.commands import engine_config, worker_config
from mqinfer.config import (
    ENGINE_OPTIONS, STREAM, WORKER_OPTIONS, ConfigError, load_config_file, resolve,
)
from mqinfer.scheduler.config import SchedulerConfig
from mqinfer.workers.config import EngineConfig, WorkerConfig
from tests import zygote


@pytest.fixture(autouse=True)
def _no_mqinfer_environment(monkeypatch):
    for name in [n for n in os.environ if n.startswith("MQINFER_")]:
        monkeypatch.delenv(name)


def _resolve(argv, file_values=None, required=(), command="worker", options=WORKER_CMD):
    args = build_parser().parse_args([command, *argv])
    return resolve(args, options, file_values or {}, required)


def _config(tmp_path, text: str, command: str = "worker") -> dict:
    path = tmp_path / "mq.toml"
    path.write_text(text)
    return load_config_file(path, command, config_keys(build_parser()))


def test_the_shared_parser_carries_nothing_from_one_command_line_to_the_next():
    """`main` parses every command line of a process with one parser (command_parser)."""
    parser = command_parser()
    assert command_parser() is parser
    first = resolve(parser.parse_args(["worker", "--redis", "redis://a", "--max-batch", "4", "--no-prefix-cache"]),
                    WORKER_CMD, {}, ())
    second = resolve(parser.parse_args(["worker", "--redis", "redis://b"]), WORKER_CMD, {}, ())
    fresh = resolve(build_parser().parse_args(["worker", "--redis", "redis://b"]), WORKER_CMD, {}, ())
    assert (first["max_batch"], first["prefix_cache"]) == (4, False)
    assert second == fresh and second["redis"] == "redis://b" and second["max_batch"] != 4
    assert "max_batch" not in vars(parser.parse_args(["worker", "--redis", "redis://c"]))  # not given: not there


def test_precedence(monkeypatch, tmp_path):
    values = _config(tmp_path, 'max-batch = 8\nmax_wait_ms = 3.5\n[worker]\nblock_size = 32\n')
    opts = _resolve([], values)
    assert (opts["max_batch"], opts["max_wait_ms"], opts["block_size"]) == (8, 3.5, 32)
    monkeypatch.setenv("MQINFER_MAX_BATCH", "16")
    assert _resolve([], values)["max_batch"] == 16
    assert _resolve(["--max-batch", "4"], values)["max_batch"] == 4
    assert _resolve([])["max_num_seqs"] == 256  # default


def test_one_default_per_setting_in_help_resolve_and_every_config():
    """`mqinfer worker --help`, resolve() and the dataclasses agree on every default, and the engine
    hands the scheduler the scheduler's own defaults: a second copy of any number fails here."""
    out = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--help"], capture_output=True, text=True,
                     env={k: v for k, v in os.environ.items() if not k.startswith("MQINFER_")})
    assert out.returncode == 0, out.stderr
    help_text = " ".join(out.stdout.split())
    resolved = _resolve([])
    engine, worker = EngineConfig(), WorkerConfig(redis_url="redis://h", out_dir=Path("o"))
    for opt in [*ENGINE_OPTIONS, STREAM, *WORKER_OPTIONS]:
        owner = engine if opt in ENGINE_OPTIONS else worker
        default = getattr(owner, opt.field)
        assert opt.default == default and resolved[opt.name] == default, opt.name
        if opt.is_switch:
            shown = f"(default: {'on' if default else 'off'}; env {opt.env} or {opt.negative_env})"
        elif default is None:
            shown = f"(env {opt.env})"
        else:
            shown = f"(default: {default}; env {opt.env})"
        assert shown in help_text, (opt.name, shown)
    # The measured defaults (BENCHMARKS.md), for the command line and the Python API alike.
    assert (engine.max_num_batched_tokens, engine.max_num_seqs) == (2048, 256)
    assert "--max-num-batched-tokens T Token budget" in help_text and "(default: 2048;" in help_text
    scheduler = SchedulerConfig()
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
                 "preemption_mode", "priority_aging_s"):
        assert getattr(engine, name) == getattr(scheduler, name), name
    # Flags left at their defaults build exactly the dataclasses' defaults.
    assert engine_config(resolved) == engine
    assert worker_config(resolved, redis_url="redis://h", out=Path("o")) == worker
    # Every flagged field is a flag, and no flag invents a field.
    flagged = {f.name for cls in (EngineConfig, WorkerConfig) for f in dataclasses.fields(cls) if "flag" in f.metadata}
    assert {o.field for o in [*ENGINE_OPTIONS, STREAM, *WORKER_OPTIONS]} == flagged


def test_bool_and_optional_values(monkeypatch):
    assert _resolve([])["prefix_cache"] is True
    assert _resolve(["--no-prefix-cache"])["prefix_cache"] is False
    assert engine_config(_resolve(["--no-prefix-cache"])).enable_prefix_caching is False
    monkeypatch.setenv("MQINFER_NO_PREFIX_CACHE", "yes")
    assert _resolve([])["prefix_cache"] is False
    assert _resolve(["--prefix-cache"])["prefix_cache"] is True
    assert _resolve(["--idle-exit-s", "2.5"])["idle_exit_s"] == 2.5
    assert _resolve(["--num-kv-blocks", "auto"])["num_kv_blocks"] is None
    opts = _resolve(["--priority-aging-s", "0", "--budgets", "b.toml"])
    assert engine_config(opts).priority_aging_s is None  # 0: strict priority
    assert worker_config(opts, redis_url="redis://h", out=Path("o")).budgets == Path("b.toml")


SWITCHES = [  # (command, its options, flag name, required flags)
    ("worker", WORKER_CMD, "prefix_cache", ()),
    ("worker", WORKER_CMD, "enforce_budgets", ()),
    ("worker", WORKER_CMD, "redis_cluster", ()),
    ("run", RUN_CMD, "fresh", ("INPUT",)),
    ("redis", REDIS_CMD, "unix_socket", ()),
]


@pytest.mark.parametrize("command, options, name, positional", SWITCHES)
def test_off_form_on_the_command_line_beats_env_and_config(monkeypatch, tmp_path, command, options, name,
                                                            positional):
    flag = name.replace("_", "-")

    def value(argv, file_values=None):
        return _resolve([*argv, *positional], file_values, command=command, options=options)[name]

    on_in_file = _config(tmp_path, f"{flag} = true\n", command)
    assert value([], on_in_file) is True
    assert value([f"--no-{flag}"], on_in_file) is False
    off_in_file = _config(tmp_path, f"no-{flag} = true\n", command)
    assert value([], off_in_file) is False
    assert value([f"--{flag}"], off_in_file) is True
    # The command's own table overrides the top level, whichever spelling either uses.
    assert value([], _config(tmp_path, f"{flag} = true\n[{command}]\nno_{name} = true\n", command)) is False
    assert value([], _config(tmp_path, f"no-{flag} = true\n[{command}]\n{flag} = true\n", command)) is True

    monkeypatch.setenv(f"MQINFER_{name.upper()}", "1")
    assert value([], off_in_file) is True  # environment over config file
    assert value([f"--no-{flag}"]) is False
    monkeypatch.setenv(f"MQINFER_NO_{name.upper()}", "1")
    with pytest.raises(ConfigError, match=f"--{flag}: environment MQINFER_{name.upper()} and environment "
                                          f"MQINFER_NO_{name.upper()} disagree"):
        value([])
    assert value([f"--{flag}"]) is True  # the command line settles it
    monkeypatch.delenv(f"MQINFER_{name.upper()}")
    assert value([], on_in_file) is False
    assert value([f"--{flag}"]) is True


def test_off_form_round_trips_through_argv():
    """Option.argv gives a child process the flags that reproduce a resolved value, off forms included."""
    for opt in [o for o in WORKER_CMD if o.is_switch]:
        for value in (True, False):
            assert _resolve(opt.argv(value))[opt.name] is value
    assert _resolve(next(o for o in ENGINE_OPTIONS if o.name == "max_num_seqs").argv(32))["max_num_seqs"] == 32


def test_config_keys_know_both_spellings_and_nothing_else(tmp_path):
    assert _config(tmp_path, "no-prefix-cache = true\nprefix_cache = false\nno_fresh = true\n")["no_prefix_cache"]
    for text, problem in [("no-max-batch = 3\n", "no-max-batch is not a flag"),
                          ("[worker]\nno_such = 1\n", "worker.no_such is not a flag"),
                          ("[report]\nbyy = 'model'\n", "report.byy is not a flag")]:
        with pytest.raises(ConfigError, match=problem):
            _config(tmp_path, text)


def test_errors_name_the_flag_and_source(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"--max-batch \(from command line\)"):
        _resolve(["--max-batch", "lots"])
    monkeypatch.setenv("MQINFER_DEVICE", "tpu")
    with pytest.raises(ConfigError, match=r"--device \(from environment MQINFER_DEVICE\): expected auto, cpu, cuda or cuda:N"):
        _resolve([])
    monkeypatch.delenv("MQINFER_DEVICE")
    with pytest.raises(ConfigError, match=r"--enforce-budgets \(from config file key no_enforce_budgets\)"):
        _resolve([], {"no_enforce_budgets": "maybe"})
    with pytest.raises(ConfigError, match="--redis is required"):
        _resolve([], required=("redis",))
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batch = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(bad, "worker")


def test_tenant_weights_from_every_source_reach_the_scheduler_and_child_workers(monkeypatch, tmp_path):
    opts = _resolve(["--tenant-weights", "gold = 2, std=0.5"])
    assert opts["tenant_weights"] == "gold=2,std=0.5"  # checked and written one way
    engine = engine_config(opts)
    assert engine.tenant_weight_map == {"gold": 2.0, "std": 0.5}
    # `run` hands each worker the flags that give the same value.
    option = next(o for o in ENGINE_OPTIONS if o.name == "tenant_weights")
    assert _resolve(option.argv(opts["tenant_weights"]))["tenant_weights"] == "gold=2,std=0.5"
    monkeypatch.setenv("MQINFER_TENANT_WEIGHTS", "a=3")
    assert _resolve([])["tenant_weights"] == "a=3"
    monkeypatch.delenv("MQINFER_TENANT_WEIGHTS")
    assert _resolve([], _config(tmp_path, 'tenant-weights = "b=4"\n'))["tenant_weights"] == "b=4"
    assert _resolve([])["tenant_weights"] is None and engine_config(_resolve([])).tenant_weight_map == {}


@pytest.mark.parametrize("value, message", [
    ("gold=fast", r"the weight of tenant 'gold' must be a number, got 'fast'"),
    ("gold=0", r"the weight of tenant 'gold' must be a finite number > 0, got '0'"),
    ("gold=-2", r"the weight of tenant 'gold' must be a finite number > 0, got '-2'"),
    ("gold=1,gold=2", r"tenant 'gold' is given twice"),
    ("gold", r"entry 'gold' is not tenant=weight"),
])
def test_bad_tenant_weights_name_the_flag_the_source_and_the_entry(monkeypatch, value, message):
    with pytest.raises(ConfigError, match=r"--tenant-weights \(from command line\): tenant weights: " + message):
        _resolve(["--tenant-weights", value])
    monkeypatch.setenv("MQINFER_TENANT_WEIGHTS", value)
    with pytest.raises(ConfigError, match=r"--tenant-weights \(from environment MQINFER_TENANT_WEIGHTS\): "):
        _resolve([])
    with pytest.raises(ValueError, match=message):
        EngineConfig(tenant_weights=value)


def test_missing_required_flag_exits_2_with_message():
    out = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--out", "x"], capture_output=True, text=True,
                     env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "--redis is required" in out.stderr


def test_every_commands_help_renders():
    """Help texts are plain text: a '%' in one (a share of the work) is shown as it is, not taken
    for argparse's %-formatting."""
    def walk(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    helps = {p.prog: " ".join(p.format_help().split()) for p in walk(build_parser())}
    assert {"mqinfer run", "mqinfer submit", "mqinfer jobs submit"} <= set(helps)
    for prog in ("mqinfer run", "mqinfer submit", "mqinfer jobs submit"):
        assert "within 10% of an even share" in helps[prog], prog


def test_tenant_limits_from_every_source_reach_the_worker_and_child_workers(monkeypatch, tmp_path):
    opts = _resolve(["--tenant-limits", "gold = 200:2, std=50"])
    assert opts["tenant_limits"] == "gold=200:2,std=50"  # checked and written one way
    config = worker_config(opts, redis_url="redis://h", out=Path("o"))
    assert {t: (s.tokens_per_s, s.requests_per_s) for t, s in config.tenant_limit_map.items()} == {
        "gold": (200.0, 2.0), "std": (50.0, None)}
    option = next(o for o in WORKER_OPTIONS if o.name == "tenant_limits")
    assert _resolve(option.argv(opts["tenant_limits"]))["tenant_limits"] == "gold=200:2,std=50"
    assert "tenant_limits" in {o.name for o in RUN_CMD}  # `run` takes it and hands it to its workers
    monkeypatch.setenv("MQINFER_TENANT_LIMITS", "a=3")
    assert _resolve([])["tenant_limits"] == "a=3"
    monkeypatch.delenv("MQINFER_TENANT_LIMITS")
    assert _resolve([], _config(tmp_path, 'tenant-limits = "b=4:1"\n'))["tenant_limits"] == "b=4:1"
    assert _resolve([])["tenant_limits"] is None


@pytest.mark.parametrize("value, message", [
    ("a=", r"the tokens per second of tenant 'a' must be a number, got ''"),
    ("a=-1", r"the tokens per second of tenant 'a' must be a finite number > 0, got '-1'"),
    ("a=x", r"the tokens per second of tenant 'a' must be a number, got 'x'"),
    ("a=1,a=2", r"tenant 'a' is given twice"),
])
def test_bad_tenant_limits_name_the_flag_the_source_and_the_entry(monkeypatch, tmp_path, value, message):
    with pytest.raises(ConfigError, match=r"--tenant-limits \(from command line\): tenant limits: " + message):
        _resolve(["--tenant-limits", value])
    with pytest.raises(ConfigError, match=r"--tenant-limits \(from config file key tenant_limits\): "):
        _resolve([], _config(tmp_path, f'tenant-limits = "{value}"\n'))
    monkeypatch.setenv("MQINFER_TENANT_LIMITS", value)
    with pytest.raises(ConfigError, match=r"--tenant-limits \(from environment MQINFER_TENANT_LIMITS\): "):
        _resolve([])
    with pytest.raises(ValueError, match=message):
        WorkerConfig(redis_url="redis://h", out_dir=Path("o"), tenant_limits=value)


def test_a_bad_tenant_limit_exits_2_with_message():
    out = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--redis", "redis://127.0.0.1:1", "--out", "x",
                      "--tenant-limits", "gold=200,batch=-1"], capture_output=True, text=True,
                     env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert ("--tenant-limits (from command line): tenant limits: the tokens per second of tenant 'batch' must be "
            "a finite number > 0, got '-1'") in out.stderr


def test_tenant_slos_from_every_source_reach_the_worker_and_child_workers(monkeypatch, tmp_path):
    opts = _resolve(["--tenant-slos", " chat = 500/50, batch=60000/2000"])
    assert opts["tenant_slos"] == "chat=500/50,batch=60000/2000"  # checked and written one way
    config = worker_config(opts, redis_url="redis://h", out=Path("o"))
    assert config.tenant_slo_map == {"chat": (500, 50), "batch": (60000, 2000)}
    option = next(o for o in WORKER_OPTIONS if o.name == "tenant_slos")
    assert _resolve(option.argv(opts["tenant_slos"]))["tenant_slos"] == "chat=500/50,batch=60000/2000"
    assert "tenant_slos" in {o.name for o in RUN_CMD}  # `run` takes it and hands it to its workers
    monkeypatch.setenv("MQINFER_TENANT_SLOS", "a=300/30")
    assert _resolve([])["tenant_slos"] == "a=300/30"
    monkeypatch.delenv("MQINFER_TENANT_SLOS")
    assert _resolve([], _config(tmp_path, 'tenant-slos = "b=400/40"\n'))["tenant_slos"] == "b=400/40"
    assert _resolve([])["tenant_slos"] is None


@pytest.mark.parametrize("value, message", [
    ("a=500", r"the targets of tenant 'a' must be TTFT_MS/TPOT_MS, got '500'"),
    ("a=0/50", r"the TTFT target of tenant 'a' must be a whole number of milliseconds from 1 to 86400000, got '0'"),
    ("a=500/-5", r"the TPOT target of tenant 'a' must be a whole number"),
    ("a=500/2.5", r"the TPOT target of tenant 'a' must be a whole number"),
    ("a=500/86400001", r"the TPOT target of tenant 'a' must be a whole number"),
    ("a=1/1,a=2/2", r"tenant 'a' is given twice"),
])
def test_bad_tenant_slos_name_the_flag_the_source_and_the_entry(monkeypatch, tmp_path, value, message):
    with pytest.raises(ConfigError, match=r"--tenant-slos \(from command line\): tenant SLOs: " + message):
        _resolve(["--tenant-slos", value])
    with pytest.raises(ConfigError, match=r"--tenant-slos \(from config file key tenant_slos\): "):
        _resolve([], _config(tmp_path, f'tenant-slos = "{value}"\n'))
    monkeypatch.setenv("MQINFER_TENANT_SLOS", value)
    with pytest.raises(ConfigError, match=r"--tenant-slos \(from environment MQINFER_TENANT_SLOS\): "):
        _resolve([])
    with pytest.raises(ValueError, match=message):
        WorkerConfig(redis_url="redis://h", out_dir=Path("o"), tenant_slos=value)


def test_a_bad_tenant_slo_exits_2_with_message():
    out = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--redis", "redis://127.0.0.1:1", "--out", "x",
                      "--tenant-slos", "chat=500/0"], capture_output=True, text=True,
                     env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert ("--tenant-slos (from command line): tenant SLOs: the TPOT target of tenant 'chat' must be a whole "
            "number of milliseconds from 1 to 86400000, got '0'") in out.stderr


def test_device_share_from_every_source_reaches_the_worker_and_run(monkeypatch, tmp_path):
    opts = _resolve(["--device-share", "0.25"])
    assert worker_config(opts, redis_url="redis://h", out=Path("o")).device_share == 0.25
    assert "device_share" in {o.name for o in RUN_CMD}  # `run` takes it and hands it to its workers
    monkeypatch.setenv("MQINFER_DEVICE_SHARE", "0.5")
    assert _resolve([])["device_share"] == 0.5
    monkeypatch.delenv("MQINFER_DEVICE_SHARE")
    assert _resolve([], _config(tmp_path, "device-share = 0.75\n"))["device_share"] == 0.75
    assert _resolve([])["device_share"] is None  # the worker works its share out (workers/queue/costs.py)


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_a_device_share_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match=r"--device-share must be a number > 0 \(the devices this worker bills"):
        WorkerConfig(redis_url="redis://h", out_dir=Path("o"), device_share=value)


def test_a_zero_device_share_exits_2_with_message():
    for command in ("worker", "run"):
        out = zygote.run([sys.executable, "-m", "mqinfer", command, *(["in.jsonl"] if command == "run" else []),
                          "--redis", "redis://127.0.0.1:1", "--out", "x", "--device-share", "0"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
        assert out.returncode == 2, (command, out.stderr)
        assert "--device-share must be a number > 0" in out.stderr, (command, out.stderr)


def test_prefix_cache_scope_from_every_source_reaches_the_scheduler_and_run(monkeypatch, tmp_path):
    assert _resolve([])["prefix_cache_scope"] == "tenant"  # the default: no sharing between tenants
    opts = _resolve(["--prefix-cache-scope", "global"])
    assert engine_config(opts).prefix_cache_scope == "global"
    assert "prefix_cache_scope" in {o.name for o in RUN_CMD}  # `run` takes it and hands it to its workers
    option = next(o for o in ENGINE_OPTIONS if o.name == "prefix_cache_scope")
    assert _resolve(option.argv("global"))["prefix_cache_scope"] == "global"
    monkeypatch.setenv("MQINFER_PREFIX_CACHE_SCOPE", "global")
    assert _resolve([])["prefix_cache_scope"] == "global"
    monkeypatch.delenv("MQINFER_PREFIX_CACHE_SCOPE")
    assert _resolve([], _config(tmp_path, 'prefix-cache-scope = "global"\n'))["prefix_cache_scope"] == "global"
    for build in (lambda: EngineConfig(prefix_cache_scope="everyone"),
                  lambda: SchedulerConfig(prefix_cache_scope="everyone")):
        with pytest.raises(ValueError, match="prefix_cache_scope must be one of tenant, global, got 'everyone'"):
            build()


def test_a_bad_prefix_cache_scope_exits_2_with_message():
    out = zygote.run([sys.executable, "-m", "mqinfer", "worker", "--redis", "redis://127.0.0.1:1", "--out", "x",
                      "--prefix-cache-scope", "everyone"], capture_output=True, text=True,
                     env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr
    assert "--prefix-cache-scope" in out.stderr and "tenant" in out.stderr, out.stderr
