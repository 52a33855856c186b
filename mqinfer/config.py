"""Command-line options in one place: each flag, its type, default and help, and where values come from.

Every flag can also be given as an environment variable ``MQINFER_<FLAG>`` (``--max-wait-ms`` →
``MQINFER_MAX_WAIT_MS``) and in a TOML file passed with ``--config`` (keys spelled like the flag,
with dashes or underscores; a table named after the command, e.g. ``[worker]``, overrides the top
level for that command). Precedence: command line > environment > config file > default.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Option:
    name: str  # python name, e.g. "max_wait_ms"
    type: Callable[[str], Any] | type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "MQINFER_" + self.name.upper()

    def convert(self, raw: Any, source: str) -> Any:
        if raw is None:
            return None
        try:
            if self.type is bool:
                if isinstance(raw, bool):
                    return raw
                text = str(raw).strip().lower()
                if text in _TRUE:
                    return True
                if text in _FALSE:
                    return False
                raise ValueError(f"expected true/false, got {raw!r}")
            value = self.type(raw) if not isinstance(raw, bool) else raw
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.flag} (from {source}): {exc}") from None
        if self.choices and value not in self.choices:
            raise ConfigError(f"{self.flag} (from {source}): {value!r} is not one of {', '.join(self.choices)}")
        return value


class ConfigError(ValueError):
    """A flag, environment variable or config file value that cannot be used."""


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("", "none", "auto") else int(text)


def _optional_float(text: str) -> float | None:
    return None if str(text).lower() in ("", "none", "off") else float(text)


def _wait_ms(text: str) -> float | str:
    """Milliseconds, or ``auto`` (the batcher chooses its wait from arrival rate and step time)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected milliseconds or auto, got {text!r}") from None


REDIS = Option("redis", str, None, "Redis URL: redis://[user:pass@]host:port/db, rediss:// (TLS) or "
               "unix://[:pass@]/path.sock.", metavar="URL")
STREAM = Option("stream", str, "requests", "Stream name S: requests go to key mqinfer:{S}.", metavar="S")
LOG_LEVEL = Option("log_level", str, "info", "Log level.", choices=("debug", "info", "warning", "error"))
LOG_FORMAT = Option("log_format", str, "text", "Log line format.", choices=("text", "json"))
REDIS_CLUSTER = Option("redis_cluster", bool, False, "--redis is a seed node of a Redis Cluster (keys are "
                       "hash-tagged per stream; rq bulk jobs need a plain server).")
SHARDS = Option("shards", int, 1, "Spread requests over N streams S-0..S-{N-1} by a hash of their id, each "
                "read by its own workers (`run` gives worker i shard i mod N); for Redis Cluster, where one "
                "stream lives in one slot.", metavar="N")
JOB_ID = Option("job_id", str, None, "Job id stamped on every request (default: requests keep their own "
                "job_id; `run` derives one from the input file's content, so running it again resumes).",
                metavar="ID")

ENGINE_OPTIONS = [
    Option("model", str, "tiny", "`tiny` (built-in smoke-test model) or a local Hugging Face checkpoint folder.",
           metavar="M"),
    Option("device", str, "auto", "Where the model runs.", choices=("auto", "cpu", "cuda")),
    Option("dtype", str, "auto", "Weight and activation dtype (auto = the checkpoint's own).",
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("block_size", int, 16, "Tokens per KV cache block."),
    Option("num_kv_blocks", _optional_int, None, "KV cache blocks (default: sized from the model and memory).",
           metavar="K"),
    Option("max_num_batched_tokens", int, 4096, "Token budget of one engine step (prefill chunks + decodes); "
           "at least --max-num-seqs, so every running request can advance every step.", metavar="T"),
    Option("max_num_seqs", int, 256, "Requests running at once, at most.", metavar="S"),
    Option("max_model_len", _optional_int, None, "Context length (default: the model's).", metavar="N"),
    Option("no_prefix_cache", bool, False, "Turn prefix caching off."),
    Option("preemption", str, "recompute", "When KV blocks run out: recompute the preempted request later, "
           "or swap its KV to host memory and back.", choices=("recompute", "swap")),
    Option("swap_space_gib", float, 4.0, "Host memory for swapped-out KV blocks (with --preemption swap).",
           metavar="G"),
    Option("priority_aging_s", float, 60.0, "Waiting this long is worth one priority level, so nothing "
           "starves (0 = strict priority).", metavar="S"),
    Option("num_threads", _optional_int, None, "CPU threads for the model (default: OMP_NUM_THREADS, else "
           "every core).", metavar="N"),
]

WORKER_OPTIONS = [
    Option("group", str, "workers", "Consumer group name.", metavar="G"),
    Option("consumer", str, None, "Consumer name (default: hostname-pid-random).", metavar="C"),
    Option("max_batch", int, 64, "Dual-threshold batcher: release a batch at this many requests...", metavar="N"),
    Option("max_wait_ms", _wait_ms, 10.0, "...or this long after the oldest arrival, whichever comes first; "
           "`auto` chooses it from the arrival rate and step time.", metavar="T"),
    Option("claim_idle_ms", int, 30_000, "Take over another consumer's entries idle this long (it is "
           "presumed dead; live workers keep their entries fresh).", metavar="MS"),
    Option("max_deliveries", int, 3, "After this many deliveries a request ends with an error row.",
           metavar="N"),
    Option("idle_exit_s", _optional_float, None, "Exit 0 after this many seconds with nothing to do "
           "(default: never).", metavar="S"),
    Option("metrics_port", _optional_int, None, "Serve Prometheus metrics, /healthz and /readyz on this port.",
           metavar="P"),
    Option("metrics_host", str, "127.0.0.1", "Address the metrics endpoint binds to.", metavar="ADDR"),
    Option("price_per_device_hour", float, 1.0, "Price of one device hour in USD, for cost_usd.", metavar="USD"),
    Option("flush_rows", int, 256, "Write Parquet part files once this many rows are pending...", metavar="N"),
    Option("flush_interval_s", float, 0.5, "...or once the oldest pending row is this old.", metavar="S"),
    Option("drain_timeout_s", float, 30.0, "On SIGTERM, finish running requests for at most this long, "
           "then hand the rest back.", metavar="S"),
    Option("idempotency_ttl_s", float, 86_400.0, "Remember each request (job_id, id) this long, so that a "
           "producer's second copy is computed once, or refused if its content differs (0 = off).",
           metavar="S"),
    Option("max_entry_bytes", int, 1 << 20, "Largest stream entry accepted; a larger one ends as an error.",
           metavar="N"),
    Option("max_tokens_limit", _optional_int, None, "Largest max_tokens accepted; a larger request ends as an "
           "error (default: bounded only by the context length).", metavar="N"),
    Option("budgets", str, None, "TOML file of per-tenant budgets (period, default_usd, [tenants]); exports "
           "budget and spend metrics.", metavar="FILE"),
    Option("enforce_budgets", bool, False, "Refuse new requests of a tenant whose budget is spent: they end "
           "with error_code budget_exceeded. Needs --budgets."),
    Option("reply_maxlen", int, 100_000, "Reply streams keep about this many messages at most.", metavar="N"),
    Option("reply_ttl_s", int, 3600, "Reply streams expire this long after their last message.", metavar="S"),
    REDIS_CLUSTER,
]


def add_options(parser: argparse.ArgumentParser, options: list[Option], *, required: tuple[str, ...] = ()) -> None:
    """Add flags whose argparse default is 'not given', so env and config can fill them later."""
    for opt in options:
        default_text = "off" if opt.type is bool and not opt.default else opt.default
        env_note = f"env {opt.env}"
        help_text = f"{opt.help} (default: {default_text}; {env_note})"
        if opt.name in required:
            help_text = f"{opt.help} (required; {env_note})"
        if opt.type is bool:
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const=True,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=opt.metavar or opt.name.upper(), choices=None)


def load_config_file(path: str | os.PathLike | None, command: str,
                     known: tuple[set[str], set[str]] | None = None) -> dict[str, Any]:
    """The settings of a TOML config file that apply to ``command``.

    ``known`` = (every flag name of every command, every command name): a key or table that no
    command knows is an error naming it, so a misspelt setting is never silently ignored.
    """
    if not path:
        return {}
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {p}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {p}: not valid TOML: {exc}") from None
    if known is not None:
        _check_keys(p, data, *known)
    values = {k.replace("-", "_"): v for k, v in data.items() if not isinstance(v, dict)}
    section = data.get(command)
    if isinstance(section, dict):
        values.update({k.replace("-", "_"): v for k, v in section.items()})
    return values


def _check_keys(path: Path, data: dict[str, Any], flags: set[str], commands: set[str]) -> None:
    problems = []
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in commands:
                problems.append(f"[{key}] is not a command (tables: {', '.join(sorted(commands))})")
                continue
            problems += [f"{key}.{k} is not a flag of any command" for k in value
                         if k.replace("-", "_") not in flags]
        elif key.replace("-", "_") not in flags:
            problems.append(f"{key} is not a flag of any command")
    if problems:
        raise ConfigError(f"--config {path}: " + "; ".join(problems))


def resolve(args: argparse.Namespace, options: list[Option], file_values: dict[str, Any],
            required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Final value of each option: command line > environment > config file > default."""
    resolved: dict[str, Any] = {}
    for opt in options:
        if hasattr(args, opt.name):
            value = opt.convert(getattr(args, opt.name), "command line")
        elif opt.env in os.environ:
            value = opt.convert(os.environ[opt.env], f"environment {opt.env}")
        elif opt.name in file_values:
            value = opt.convert(file_values[opt.name], "config file")
        else:
            value = opt.default
        resolved[opt.name] = value
    for name in required:
        if resolved.get(name) in (None, ""):
            opt = next(o for o in options if o.name == name)
            raise ConfigError(f"{opt.flag} is required (or set {opt.env})")
    return resolved
