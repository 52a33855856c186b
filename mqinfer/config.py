"""Command-line options in one place: each flag, its type, default and help, and where values come from.

The worker's and the engine's flags are built from the fields of their config dataclasses
(``WorkerConfig`` and ``EngineConfig`` in workers/config.py), so each of their defaults is written
once, there, and ``--help`` shows it. Flags that belong to one command only are declared here or
next to their command.

Every flag can also be given as an environment variable ``MQINFER_<FLAG>`` (``--max-wait-ms`` →
``MQINFER_MAX_WAIT_MS``) and in a TOML file passed with ``--config`` (keys spelled like the flag,
with dashes or underscores; a table named after the command, e.g. ``[worker]``, overrides the top
level for that command). An on/off flag ``--x`` also has its off form everywhere: ``--no-x``,
``MQINFER_NO_X``, key ``no-x``. Precedence: command line > environment > config file > default.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from mqinfer.workers.config import EngineConfig, WorkerConfig

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
    # The config dataclass field this option fills, when it is built from one.
    field: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "MQINFER_" + self.name.upper()

    @property
    def is_switch(self) -> bool:
        """An on/off flag: ``--x`` / ``--no-x``."""
        return self.type is bool

    @property
    def negative_flag(self) -> str:
        return "--no-" + self.name.replace("_", "-")

    @property
    def negative_env(self) -> str:
        return "MQINFER_NO_" + self.name.upper()

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this option ``value`` (for a child process's argv)."""
        if value is None:
            return []
        if self.is_switch:
            return [self.flag if value else self.negative_flag]
        return [self.flag, str(value)]

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
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
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


def _optional_path(text: str) -> Path | None:
    return Path(text) if str(text) else None


# How text becomes a value, by a field's type (its own Flag.parse otherwise).
_PARSERS: dict[Any, Callable[[str], Any]] = {bool: bool, int: int, float: float, str: str, Path: Path}
_OPTIONAL_PARSERS: dict[Any, Callable[[str], Any]] = {
    int: _optional_int, float: _optional_float, str: str, Path: _optional_path,
}


def _parser_for(cls: type, name: str, hint: Any) -> Callable[[str], Any]:
    args = typing.get_args(hint)
    kinds = [a for a in args if a is not type(None)] if args else [hint]
    table = _OPTIONAL_PARSERS if type(None) in args else _PARSERS
    if len(kinds) != 1 or kinds[0] not in table:
        raise TypeError(f"{cls.__name__}.{name}: type {hint} needs its own Flag(parse=...)")
    return table[kinds[0]]


def options_from(cls: type) -> list[Option]:
    """The options of the fields of config dataclass ``cls`` that carry ``flag(...)`` metadata."""
    hints = typing.get_type_hints(cls)
    options = []
    for f in fields(cls):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        default = f.default if f.default is not MISSING else None
        options.append(Option(spec.name or f.name, spec.parse or _parser_for(cls, f.name, hints[f.name]), default,
                              spec.help, choices=spec.choices, metavar=spec.metavar, field=f.name))
    return options


REDIS = Option("redis", str, None, "Redis URL: redis://[user:pass@]host:port/db, rediss:// (TLS) or "
               "unix://[:pass@]/path.sock.", metavar="URL")
LOG_LEVEL = Option("log_level", str, "info", "Log level.", choices=("debug", "info", "warning", "error"))
LOG_FORMAT = Option("log_format", str, "text", "Log line format.", choices=("text", "json"))
SHARDS = Option("shards", int, 1, "Spread requests over N streams S-0..S-{N-1} (see --route), each read by its "
                "own workers (`run` gives worker i shard i mod N); for Redis Cluster, where one stream lives in "
                "one slot, and for prefix locality: each shard's workers cache their own prefixes.", metavar="N")
ROUTE = Option("route", str, "prefix", "How requests are spread over --shards: prefix = by their leading prompt "
               "(64 token ids, else 256 bytes), so that requests sharing a prefix go to one shard while the "
               "shards stay within 10% of an even share of the work (a prefix spills over to a second shard "
               "beyond that); id = by a hash of the request's id.", choices=("prefix", "id"))
ORDER = Option("order", str, "prefix", "The order requests enter the stream: prefix = requests sharing a prompt "
               "prefix next to each other (token ids, else the prompt's bytes), so a worker computes a shared "
               "prefix once while its KV blocks are cached; input = the file's order. Results are the same rows "
               "either way.", choices=("prefix", "input"))
JOB_ID = Option("job_id", str, None, "Job id stamped on every request (default: requests keep their own "
                "job_id; `run` derives one from the input file's content, so running it again resumes).",
                metavar="ID")

ENGINE_OPTIONS = options_from(EngineConfig)
_WORKER_FIELDS = {o.name: o for o in options_from(WorkerConfig)}
# Stream and cluster flags are shared with the producer commands (submit, jobs).
STREAM = _WORKER_FIELDS["stream"]
REDIS_CLUSTER = _WORKER_FIELDS["redis_cluster"]
# Lanes: producers choose a request's lane, workers read them all.
LANES = _WORKER_FIELDS["lanes"]
MAX_LANES = _WORKER_FIELDS["max_lanes"]
# Without --stream: `run` gives each worker its shard's stream itself.
WORKER_OPTIONS = [o for o in _WORKER_FIELDS.values() if o is not STREAM]


def add_options(parser: argparse.ArgumentParser, options: list[Option], *, required: tuple[str, ...] = ()) -> None:
    """Add flags whose argparse default is 'not given', so env and config can fill them later."""
    for opt in options:
        env_note = f"env {opt.env} or {opt.negative_env}" if opt.is_switch else f"env {opt.env}"
        if opt.name in required:
            help_text = f"{opt.help} (required; {env_note})"
        elif opt.is_switch:
            help_text = f"{opt.help} (default: {'on' if opt.default else 'off'}; {env_note})"
        elif opt.default is None:  # its help says what happens without it
            help_text = f"{opt.help} ({env_note})"
        else:
            help_text = f"{opt.help} (default: {opt.default}; {env_note})"
        help_text = help_text.replace("%", "%%")  # the help is plain text; argparse %-formats it
        if opt.is_switch:
            parser.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            choices = "{" + ",".join(opt.choices) + "}" if opt.choices else None
            # argparse checks no choices: resolve() does, for every source, naming the source.
            parser.add_argument(opt.flag, dest=opt.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=opt.metavar or choices or opt.name.upper())


def _opposite(key: str) -> str:
    """``no_x`` for ``x`` and ``x`` for ``no_x``: the two spellings of an on/off setting."""
    return key[3:] if key.startswith("no_") else "no_" + key


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
        for k, v in section.items():
            key = k.replace("-", "_")
            # The command's table overrides the top level in either spelling (`x` or `no_x`).
            values.pop(_opposite(key), None)
            values[key] = v
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


_UNSET = object()


def _given(opt: Option, values: Any, keys: list[tuple[str, bool]], source: Callable[[str], str]) -> Any:
    """What ``values`` (the environment, or a config file's settings) says for ``opt``, under any
    of ``keys`` = [(key, is the off form)]; _UNSET if nothing. Two spellings that disagree
    (MQINFER_X=1 and MQINFER_NO_X=1) are an error."""
    found = []
    for key, off_form in keys:
        if key in values:
            value = opt.convert(values[key], source(key))
            found.append((not value if off_form else value, source(key)))
    if not found:
        return _UNSET
    if any(value != found[0][0] for value, _ in found):
        raise ConfigError(f"{opt.flag}: {found[0][1]} and {found[1][1]} disagree")
    return found[0][0]


def resolve(args: argparse.Namespace, options: list[Option], file_values: dict[str, Any],
            required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Final value of each option: command line > environment > config file > default."""
    resolved: dict[str, Any] = {}
    for opt in options:
        env_keys = [(opt.env, False)] + ([(opt.negative_env, True)] if opt.is_switch else [])
        file_keys = [(opt.name, False)] + ([(_opposite(opt.name), True)] if opt.is_switch else [])
        if hasattr(args, opt.name):
            value = opt.convert(getattr(args, opt.name), "command line")
        elif (value := _given(opt, os.environ, env_keys, lambda key: f"environment {key}")) is _UNSET:
            value = _given(opt, file_values, file_keys, lambda key: f"config file key {key}")
            if value is _UNSET:
                value = opt.default
        resolved[opt.name] = value
    for name in required:
        if resolved.get(name) in (None, ""):
            opt = next(o for o in options if o.name == name)
            raise ConfigError(f"{opt.flag} is required (or set {opt.env})")
    return resolved


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option destinations that ``argv`` sets explicitly (abbreviations included)."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        seen, _ = parser.parse_known_args(argv)
    finally:
        for action in parser._actions:
            action.default = saved[action.dest]
    return set(vars(seen))


def fill_from_env_and_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str],
                             file_values: dict[str, Any]) -> argparse.Namespace:
    """For a command whose flags are plain argparse arguments (``bench``): each flag not given on
    the command line takes ``MQINFER_<FLAG>``, else the config file's value, else its default."""
    given = given_dests(parser, argv)
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in given or dest in ("help", "config"):
            continue
        env = "MQINFER_" + dest.upper()
        if env in os.environ:
            raw, source = os.environ[env], f"environment {env}"
        elif dest in file_values:
            raw, source = file_values[dest], "config file"
        else:
            continue
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        kind = bool if switch else (action.type or str)
        option = Option(dest, kind, action.default, "", choices=tuple(action.choices) if action.choices else None)
        if not switch:  # argparse types parse text: a TOML number, or an array for a comma-separated flag
            raw = ",".join(str(v) for v in raw) if isinstance(raw, list) else str(raw)
        value = option.convert(raw, source)
        if isinstance(action, argparse._StoreFalseAction):
            value = not value
        setattr(args, dest, value)
    return args

