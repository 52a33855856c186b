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

Parsers are ``CommandParser``s: each keeps a record of the Options added to it and of its
sub-commands, which config-file checking, ``bench``'s environment handling and the generated
command reference (docs/commands.md, ``python -m mqinfer.cli_reference``) read.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import typing
from dataclasses import MISSING, dataclass, fields, replace
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

    @property
    def value_kind(self) -> str | None:
        """What kind of value the option takes, in words (for the command reference); None when
        its parser is the option's own (its help and metavar say what it takes)."""
        return _KINDS.get(self.type)

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


_KINDS: dict[Any, str] = {
    bool: "on/off", int: "integer", float: "number", str: "text", Path: "path",
    _optional_int: "integer", _optional_float: "number", _optional_path: "path",
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
MAX_COST_USD = Option("max_cost_usd", float, None, "Cost cap of the job in USD: once its spend plus the cost of "
                      "its requests in flight reaches it, no new request of the job starts and the rest end with "
                      "error rows budget_exceeded (requests already running finish). Running the job again (`mqinfer run` "
                      "with the same --out and --job-id, `mqinfer jobs submit` with the same INPUT and --out) with a "
                      "higher cap, or none, computes the requests a cap stopped and keeps the others' rows.",
                      metavar="USD")
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
# Producers that order or route by prefix (submit, jobs submit) group requests as the workers share
# their cached KV: the workers' flag, with the same name (so one MQINFER_PREFIX_CACHE_SCOPE serves
# both) and default.
PREFIX_CACHE_SCOPE = replace(
    next(o for o in ENGINE_OPTIONS if o.name == "prefix_cache_scope"), field=None,
    help="The workers' --prefix-cache-scope, which prefix order and routing follow: tenant = requests are "
         "grouped by tenant and cache_salt before their prompt, since only those share cached KV; global = by "
         "cache_salt alone, so that different tenants' requests with one prefix go together.")
_WORKER_FIELDS = {o.name: o for o in options_from(WorkerConfig)}
# Stream and cluster flags are shared with the producer commands (submit, jobs).
STREAM = _WORKER_FIELDS["stream"]
REDIS_CLUSTER = _WORKER_FIELDS["redis_cluster"]
# Lanes: producers choose a request's lane, workers read them all.
LANES = _WORKER_FIELDS["lanes"]
MAX_LANES = _WORKER_FIELDS["max_lanes"]
# Without --stream: `run` gives each worker its shard's stream itself.
WORKER_OPTIONS = [o for o in _WORKER_FIELDS.values() if o is not STREAM]


class CommandParser(argparse.ArgumentParser):
    """An argparse parser that keeps a record of what the project added to it, so that nothing
    needs argparse's internals to know a command's flags: the Options given to ``add_options``
    (in order, with the required ones, the argument group each went into, and which keep argparse's
    own defaults), every argument added with ``add_argument`` on the parser itself (positional
    arguments, ``--config``, ``--help``), and the sub-commands by name.

    Sub-parsers made by ``add_subparsers().add_parser`` are CommandParsers too (argparse makes them
    of the parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[Option] = []
        self.required: tuple[str, ...] = ()
        # Option name -> the title of the argument group it was added to (none: the parser's own).
        self.option_groups: dict[str, str] = {}
        # Options whose default argparse puts into the parsed namespace (see add_options).
        self.argparse_defaults: set[str] = set()
        self.arguments: list[argparse.Action] = []  # set before argparse adds --help
        self.commands: dict[str, CommandParser] = {}
        self.commands_metavar: str | None = None
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.arguments.append(action)
        return action

    def add_subparsers(self, **kwargs: Any):
        action = super().add_subparsers(**kwargs)
        # The subparsers action's choices: the name -> parser map that add_parser fills.
        self.commands = action.choices
        self.commands_metavar = kwargs.get("metavar")
        return action

    def extra_flags(self) -> list[argparse.Action]:
        """The flags added with plain ``add_argument`` (``--help``, ``--config``, ``--version``)."""
        names = {o.name for o in self.options}
        return [a for a in self.arguments if a.option_strings and a.dest not in names]

    def positionals(self) -> list[argparse.Action]:
        return [a for a in self.arguments if not a.option_strings]


def _help_text(opt: Option, required: tuple[str, ...]) -> str:
    env_note = f"env {opt.env} or {opt.negative_env}" if opt.is_switch else f"env {opt.env}"
    if opt.name in required:
        return f"{opt.help} (required; {env_note})"
    if opt.is_switch:
        return f"{opt.help} (default: {'on' if opt.default else 'off'}; {env_note})"
    if opt.default is None:  # its help says what happens without it
        return f"{opt.help} ({env_note})"
    return f"{opt.help} (default: {opt.default}; {env_note})"


def add_options(parser: argparse.ArgumentParser, options: list[Option], *, required: tuple[str, ...] = (),
                group: Any = None, argparse_defaults: bool = False) -> None:
    """Add flags whose argparse default is 'not given', so env and config can fill them later
    (``resolve``), and record them on ``parser`` when it is a CommandParser.

    ``group``: an argument group of ``parser`` to add them to (for ``--help``'s layout).
    ``argparse_defaults``: for a command that reads its parsed namespace directly (``bench``):
    argparse checks types and choices and puts each default into the namespace, the help text is
    the option's own, an on/off option is a plain ``--x`` switch that is off by default, and
    ``fill_from_env_and_config`` applies the environment and the config file afterwards.
    """
    target = group if group is not None else parser
    for opt in options:
        if argparse_defaults:
            _add_with_default(target, opt)
            continue
        help_text = _help_text(opt, required).replace("%", "%%")  # plain text; argparse %-formats help
        if opt.is_switch:
            target.add_argument(opt.flag, dest=opt.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            choices = "{" + ",".join(opt.choices) + "}" if opt.choices else None
            # argparse checks no choices: resolve() does, for every source, naming the source.
            target.add_argument(opt.flag, dest=opt.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=opt.metavar or choices or opt.name.upper())
    if isinstance(parser, CommandParser):
        parser.options += options
        parser.required += tuple(required)
        if group is not None:
            parser.option_groups.update((o.name, group.title) for o in options)
        if argparse_defaults:
            parser.argparse_defaults.update(o.name for o in options)


def _add_with_default(target: Any, opt: Option) -> None:
    help_text = opt.help.replace("%", "%%")
    if opt.is_switch:
        if opt.default:
            raise TypeError(f"{opt.flag}: an on/off option added with its argparse default must be off by default")
        target.add_argument(opt.flag, dest=opt.name, action="store_true", help=help_text)
    else:
        target.add_argument(opt.flag, dest=opt.name, type=opt.type, default=opt.default, choices=opt.choices,
                            metavar=opt.metavar, help=help_text)


def config_keys(parser: CommandParser) -> tuple[set[str], set[str]]:
    """(every flag name of every command, in every spelling, e.g. both ``prefix_cache`` and
    ``no_prefix_cache``; every command name): what a config file may hold."""
    flags: set[str] = {"config"}
    commands: set[str] = set()

    def walk(p: CommandParser) -> None:
        for opt in p.options:
            flags.add(opt.name)
            if opt.is_switch and opt.name not in p.argparse_defaults:
                flags.add(_opposite(opt.name))
        flags.update(a.dest for a in p.extra_flags())
        for name, sub in p.commands.items():
            commands.add(name)
            walk(sub)

    walk(parser)
    return flags, commands


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


def given_dests(parser: CommandParser, argv: list[str]) -> set[str]:
    """The recorded options that ``argv`` sets explicitly (abbreviations included)."""
    # argparse fills a default only into an attribute the namespace does not have yet: one that
    # still holds the marker after parsing was not given.
    unset = object()
    marked = argparse.Namespace(**{opt.name: unset for opt in parser.options})
    seen, _ = parser.parse_known_args(argv, namespace=marked)
    return {opt.name for opt in parser.options if getattr(seen, opt.name) is not unset}


def fill_from_env_and_config(parser: CommandParser, args: argparse.Namespace, argv: list[str],
                             file_values: dict[str, Any]) -> argparse.Namespace:
    """For a command whose options were added with their argparse defaults (``bench``): each
    option not given on the command line takes ``MQINFER_<FLAG>``, else the config file's value,
    else keeps its default."""
    if not isinstance(parser, CommandParser):
        raise TypeError("fill_from_env_and_config needs a CommandParser (it reads the options recorded on it)")
    given = given_dests(parser, argv)
    for opt in parser.options:
        if opt.name in given:
            continue
        if opt.env in os.environ:
            raw, source = os.environ[opt.env], f"environment {opt.env}"
        elif opt.name in file_values:
            raw, source = file_values[opt.name], "config file"
        else:
            continue
        if not opt.is_switch:  # the types parse text: a TOML number, or an array for a comma-separated flag
            raw = ",".join(str(v) for v in raw) if isinstance(raw, list) else str(raw)
        setattr(args, opt.name, opt.convert(raw, source))
    return args
