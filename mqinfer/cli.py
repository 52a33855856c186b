"""The `mqinfer` command line: run, worker, submit, redis, compact, report.

Producer-side commands (submit, redis, compact, report) never import torch; `worker` and `run`
load the engine only in the worker processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from mqinfer import __version__
from mqinfer.config import (
    ENGINE_OPTIONS,
    JOB_ID,
    LOG_FORMAT,
    LOG_LEVEL,
    MAX_COST_USD,
    ORDER,
    REDIS,
    REDIS_CLUSTER,
    LANES,
    MAX_LANES,
    PREFIX_CACHE_SCOPE,
    ROUTE,
    SHARDS,
    STREAM,
    WORKER_OPTIONS,
    CommandParser,
    ConfigError,
    Option,
    add_options,
    config_keys,
    fill_from_env_and_config,
    load_config_file,
    resolve,
)
from mqinfer.commands import read_input, submit_sharded, worker_config
from mqinfer.layout import parse_workers
from mqinfer.procs import short_openmp_spin

OUT = Option("out", str, None, "Output folder: results/ and costs/ Parquet datasets go here. Object storage works "
             "too, any pyarrow filesystem URI (s3://bucket/prefix, gs://...; an S3-compatible server with "
             "?endpoint_override=HOST:PORT&scheme=http): each part file becomes visible by one upload under its "
             "final name; `mqinfer run` then keeps its state in the user's cache folder.", metavar="DIR")
WORKERS = Option("workers", parse_workers, "auto", "Worker processes to run, or auto: on a CPU one per core with one "
                 "thread each (fewer when the model would not fit in memory that many times; --num-threads N "
                 "gives cores / N workers); on CUDA one per visible GPU (or per group of tensor x pipeline "
                 "ranks).", metavar="N")
FORMAT = Option("format", str, "msgpack", "Stream entry encoding.", choices=("msgpack", "json"))
PORT = Option("port", int, 0, "TCP port on 127.0.0.1 (0 = pick a free one).", metavar="P")
DATA_DIR = Option("dir", str, "mqinfer-redis", "Data folder: the append-only file, and the password and port kept "
                  "across restarts (one server per folder).", metavar="DIR")
FRESH = Option("fresh", bool, False, "Start the job over: remove its result and cost rows from --out first "
               "(without it, running the same command again resumes: only requests without a row are computed).")
UNIX_SOCKET = Option("unix_socket", bool, False, "Listen on a unix socket instead of TCP.")

# `report costs`
BY = Option("by", str, "tenant", "Comma-separated group keys: tenant, model, request_type, job_id, worker, "
            "model_variant (dtype, quantization, KV cache dtype, tensor and pipeline ranks), metadata.KEY (the "
            "requests' metadata label KEY; requests without it group as (none)), prompt_band (0-127, 128-511, "
            "512-2047, 2048-8191, 8192+ prompt tokens) and output_band (0-31, 32-127, 128-511, 512-2047, 2048+ "
            "output tokens).", metavar="KEYS")
REPORT_FORMAT = Option("format", str, "table", "Output format.", choices=("table", "csv", "json"))
SINCE = Option("since", str, None, "Only rows finished at or after this time (ISO 8601 or unix seconds).",
               metavar="WHEN")
UNTIL = Option("until", str, None, "Only rows finished before this time (ISO 8601 or unix seconds).",
               metavar="WHEN")
TOP = Option("top", int, 10, "How many of the most expensive requests to list.", metavar="N")
REPORT_BUDGETS = Option("budgets", str, None, "TOML file of budgets (tenants, jobs, metadata.KEY = VALUE groups, "
                        "warning thresholds; see docs/costs.md): list each group's spend and the thresholds it "
                        "reached, and mark the groups of a budgeted key.", metavar="FILE")
PLOT = Option("plot", str, None, "Also write PNG charts into DIR (needs matplotlib).", metavar="DIR")
HTML = Option("html", str, None, "Also write the report as one self-contained HTML page: the tables, and inline SVG "
              "charts of the groups' cost per hour, dollars per million tokens by group, cost per request, the "
              "overhead share and budgets against spend (it loads nothing from elsewhere).", metavar="FILE")
BASIS = Option("basis", str, "usage", "usage: each group pays for its requests' device time. allocation: also for a "
               "share of the workers' startup, idle and lost time, per worker and hour, in proportion to its "
               "requests' device time there (new columns alloc_usd and total_usd; totals unchanged).",
               choices=("usage", "allocation"))

COMMON = [LOG_LEVEL, LOG_FORMAT]
WORKER_CMD = [REDIS, OUT, STREAM, *ENGINE_OPTIONS, *WORKER_OPTIONS, *COMMON]
RUN_CMD = [OUT, REDIS, STREAM, SHARDS, ROUTE, WORKERS, JOB_ID, FRESH, ORDER, MAX_COST_USD, *ENGINE_OPTIONS,
           *[o for o in WORKER_OPTIONS if o.name != "consumer"], *COMMON]
SUBMIT_CMD = [REDIS, STREAM, SHARDS, ROUTE, PREFIX_CACHE_SCOPE, LANES, MAX_LANES, REDIS_CLUSTER, JOB_ID, FORMAT,
              *COMMON]
REDIS_CMD = [DATA_DIR, PORT, UNIX_SOCKET, *COMMON]
LANES_FORMAT = Option("format", str, "table", "Output format.", choices=("table", "json"))
LANES_CMD = [REDIS, STREAM, SHARDS, REDIS_CLUSTER, LANES_FORMAT, *COMMON]
REPORT_COSTS_CMD = [BY, REPORT_FORMAT, SINCE, UNTIL, TOP, REPORT_BUDGETS, PLOT, HTML, BASIS]

log = logging.getLogger("mqinfer")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # structured lines (a finished request) keep their fields as keys
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="mqinfer",
        description="Message-queue batch inference for LLMs: Redis streams in, continuous batching over a "
                    "paged KV cache, Parquet results and per-request costs out.",
        epilog="Every flag can also be set as MQINFER_<FLAG> in the environment or in a TOML file given "
               "with --config. Quick start: mqinfer run examples/prompts.jsonl --out out/",
    )
    parser.add_argument("--version", action="version", version=f"mqinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str, options: list[Option], required=(), *, under=sub,
                description: str | None = None) -> argparse.ArgumentParser:
        p = under.add_parser(name, help=help_text, description=description or help_text)
        p.add_argument("--config", metavar="FILE", help="TOML file with flag values (env MQINFER_CONFIG).")
        add_options(p, options, required=required)
        p.set_defaults(_options=options, _required=required)
        return p

    p = command("run", "Run a whole bulk job: submit INPUT, run workers until every request has a row, "
                "compact, print a summary. Without --redis an embedded server runs for the job.", RUN_CMD,
                required=("out",))
    p.add_argument("input", metavar="INPUT", help="JSONL or Parquet file of requests (or OpenAI Batch lines).")
    command("worker", "Run a long-lived inference worker on a request stream.", WORKER_CMD,
            required=("redis", "out"))
    p = command("submit", "Validate INPUT and add its requests to the request stream. Invalid lines are "
                "reported with their numbers and not sent; exit 1 if there were any.", SUBMIT_CMD,
                required=("redis",))
    p.add_argument("input", metavar="INPUT", help="JSONL or Parquet file of requests.")
    command("redis", "Run an embedded Redis-compatible server in the foreground and print its URL.", REDIS_CMD)
    command("lanes", "List the plain request stream and its lanes (--lanes) with their backlogs: entries, "
            "unread, pending, the age of the oldest unread entry, and when a producer last wrote to each.",
            LANES_CMD, required=("redis",))
    p = command("compact", "Rewrite DIR/results keeping one row per (job_id, id); mark discarded "
                "duplicates' cost rows as `duplicate`. Several folders are compacted one after another.", COMMON)
    p.add_argument("dir", metavar="DIR", nargs="+", help="Output folder of a job or worker (local: compaction "
                   "renames files and holds a lock, which object stores do not offer).")
    report = sub.add_parser("report", help="Reports over an output folder.", description="Reports over an output folder.")
    rsub = report.add_subparsers(dest="report", metavar="REPORT")
    rc = command(
        "costs", "Cost by tenant, model, request type, job, worker, model variant, metadata label or "
        "length band.", REPORT_COSTS_CMD, under=rsub,
        description="Cost by tenant, model, request type, job, worker, model variant, metadata label or length "
        "band, over one output folder or several (their rows together), local or pyarrow filesystem URIs "
        "(s3://bucket/prefix?endpoint_override=host:port&scheme=http, gs://...). Under the groups, in every "
        "format: "
        "`billed` (the request rows, what the groups add up to), `overhead` (startup + idle + lost rows; "
        "`lost`: what a killed worker used and never wrote), `duplicate` (cost rows of results that compaction discarded) and `TOTAL` (every row: the three "
        "added up); only `billed` is charged to a tenant. Run it after `mqinfer compact DIR`: before, "
        "a retried request's rows each count as a request, and a warning on stderr says how many. "
        "A [report] table of the --config file overrides its top level here.",
    )
    rc.add_argument("dir", metavar="DIR", nargs="+", help="Output folder (with costs/), or a filesystem URI of one.")
    from mqinfer import jobs_cli
    from mqinfer.loadgen.bench_options import add_bench_arguments
    from mqinfer.loadgen.plan.options import PLAN_CMD, PLAN_DESCRIPTION, PLAN_HELP

    p = command("plan", PLAN_HELP, PLAN_CMD, description=PLAN_DESCRIPTION)
    p.add_argument("input", metavar="INPUT", nargs="?", help="JSONL or Parquet file of requests (or give --workload).")

    jobs_cli.add_jobs_parser(sub)
    bench = sub.add_parser("bench", help="Benchmark the whole pipeline (offline or online), optionally "
                           "against transformers on the same checkpoint and requests.",
                           description="Benchmark the whole pipeline (offline or online), optionally "
                           "against transformers on the same checkpoint and requests. See BENCHMARKS.md.")
    add_bench_arguments(bench)
    bench.add_argument("--config", metavar="FILE", help="TOML file with flag values; a [bench] table applies to "
                       "bench only (env MQINFER_CONFIG). Flags also read MQINFER_<FLAG>.")
    return parser


@functools.cache
def command_parser() -> CommandParser:
    """The whole command line's parser, built once per process. Parsing leaves it as it was, so
    every ``main`` call of the process shares it, and a worker forked from a warm template
    (mqinfer.warm_template) finds it built: building it takes about 14 ms of CPU, with its modules
    imported."""
    return build_parser()


def main(argv: list[str] | None = None) -> int:
    short_openmp_spin()  # before anything imports torch: the worker, run and bench commands do
    parser = command_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    if args.command == "report" and not getattr(args, "report", None):
        parser.parse_args(["report", "--help"])
    if args.command == "jobs":
        from mqinfer import jobs_cli

        args._config_known = config_keys(parser)
        return jobs_cli.run(args)
    if args.command == "bench":
        from mqinfer.loadgen.bench import run_bench

        argv = sys.argv[1:] if argv is None else argv
        bench_parser = parser.commands["bench"]
        try:
            config_path = getattr(args, "config", None) or os.environ.get("MQINFER_CONFIG")
            file_values = load_config_file(config_path, "bench", config_keys(parser))
            fill_from_env_and_config(bench_parser, args, argv[argv.index("bench") + 1:], file_values)
        except ConfigError as exc:
            print(f"mqinfer bench: error: {exc}", file=sys.stderr)
            return 2
        setup_logging("info", "text")
        return run_bench(args)
    args._config_known = config_keys(parser)
    try:
        config_path = getattr(args, "config", None) or os.environ.get("MQINFER_CONFIG")
        file_values = load_config_file(config_path, args.command, args._config_known)
        opts = resolve(args, args._options, file_values, args._required)
    except ConfigError as exc:
        print(f"mqinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts.get("log_level", "info"), opts.get("log_format", "text"))
    handler = {
        "run": cmd_run, "worker": cmd_worker, "submit": cmd_submit, "redis": cmd_redis,
        "compact": cmd_compact, "report": cmd_report, "lanes": cmd_lanes, "plan": cmd_plan,
    }[args.command]
    import redis

    try:
        return handler(args, opts)
    except KeyboardInterrupt:
        print(f"mqinfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"mqinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        print(f"mqinfer {args.command}: error: {redis_problem(exc, opts.get('redis'))}", file=sys.stderr)
        return 2


def redis_problem(exc: Exception, url: str | None) -> str:
    """One line for a Redis server that cannot be used: which server, and why."""
    import redis

    from mqinfer.schemas.connection import redact

    where = redact(url) if url else "the Redis server"
    if isinstance(exc, redis.exceptions.AuthenticationError) or "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
        return f"cannot authenticate to {where}: {exc} (check the password in the URL)"
    return f"cannot reach {where}: {exc}"


# -- worker ----------------------------------------------------------------------------------
def cmd_worker(args, opts: dict) -> int:
    from mqinfer.schemas.dataset_uri import out_location
    from mqinfer.workers import devices

    # The settings are checked before the engine (PyTorch) is imported: a bad one is refused at once.
    config = worker_config(opts, redis_url=opts["redis"], out=out_location(opts["out"]))
    try:  # a device that does not exist is refused before anything waits for Redis
        devices.engine_rank_devices(config.engine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from mqinfer.ops.budgets import BudgetGuard, load_budgets
    from mqinfer.ops.metrics import WorkerMetrics
    from mqinfer.schemas.connection import connect_redis
    from mqinfer.workers.queue.worker import Worker

    # The worker gets its metrics and budget guard from here: workers/ never imports ops/.
    guard = None
    if config.budgets is not None:
        guard = BudgetGuard(load_budgets(config.budgets), connect_redis(config.redis_url, cluster=config.redis_cluster),
                            config.stream)
    return Worker(config, metrics=WorkerMetrics(), budget_guard=guard).run()


# -- submit ----------------------------------------------------------------------------------
def cmd_submit(args, opts: dict) -> int:
    from mqinfer.client import Producer

    if opts["shards"] < 1:
        raise ConfigError("--shards must be >= 1")
    requests, invalid, duplicates = read_input(args.input, opts["job_id"])
    for item in invalid:
        print(f"line {item.line}: {item.error.code}: {item.error.message}", file=sys.stderr)
    for message in duplicates:
        print(message, file=sys.stderr)
    if opts["shards"] > 1 or opts["redis_cluster"]:
        sent, where = submit_sharded(opts, opts["redis"], requests)
    else:
        producer = Producer(opts["redis"], stream=opts["stream"], fmt=opts["format"], lanes=opts["lanes"],
                            max_lanes=opts["max_lanes"])
        sent = producer.submit_many(requests)
        used = producer.lane_keys
        where = producer.stream_key + (f" and {len(used)} lanes" if used else "")
    print(f"submitted {sent} requests to {where}"
          + (f"; {len(invalid) + len(duplicates)} lines not sent" if invalid or duplicates else ""))
    return 1 if invalid or duplicates else 0


def cmd_lanes(args, opts: dict) -> int:
    from mqinfer.ops.lanes import format_lanes, lane_statuses
    from mqinfer.schemas.connection import connect_redis
    from mqinfer.schemas.keys import shard_streams

    client = connect_redis(opts["redis"], cluster=opts["redis_cluster"])
    try:
        for stream in shard_streams(opts["stream"], opts["shards"]):
            if opts["shards"] > 1 and opts["format"] == "table":
                print(f"stream {stream}:")
            print(format_lanes(lane_statuses(client, stream), opts["format"]))
    finally:
        client.close()
    return 0


# -- redis -----------------------------------------------------------------------------------
def cmd_redis(args, opts: dict) -> int:
    from mqinfer.server import EmbeddedServer, ServerError

    server = EmbeddedServer(opts["dir"], port=opts["port"] or None, unix_socket=opts["unix_socket"])
    stop = False

    def on_signal(_signum, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
    except ServerError as exc:
        print(f"mqinfer redis: error: {exc}", file=sys.stderr)
        return 1
    print(server.url, flush=True)
    print(f"embedded server running (data in {server.data_dir}); Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        while not stop and server.process.poll() is None:
            time.sleep(0.2)
        # The server runs in its own session: a terminal's Ctrl-C never reaches it, so any exit
        # before our stop() is the server dying on its own.
        if server.process.poll() is not None:
            print(f"mqinfer redis: error: {server.exit_message()}", file=sys.stderr)
            return 1
    finally:
        server.stop()
    return 0


# -- compact / report ------------------------------------------------------------------------
def cmd_compact(args, opts: dict) -> int:
    from mqinfer.ops.compact import compact

    for directory in args.dir:
        if "://" in directory:
            raise ValueError(f"cannot compact {directory}: compaction needs a local folder (it renames files "
                             "under a lock); compact where the workers write, before copying to object storage")
    directories = [Path(d) for d in args.dir]
    for directory in directories:
        if not directory.is_dir():
            raise FileNotFoundError(f"no such output folder: {directory}")
    for directory in directories:
        s = compact(directory)
        where = f"{directory}: " if len(directories) > 1 else ""
        print(f"{where}results: {s.results_before} rows -> {s.results_after} ({s.duplicates_removed} duplicates "
              f"removed); costs: {s.costs_before} rows -> {s.costs_after} ({s.cost_rows_marked_duplicate} marked "
              "duplicate)")
    return 0


def _parse_time(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        from datetime import datetime, timezone

        dt = datetime.fromisoformat(text)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp()


def cmd_report(args, opts: dict) -> int:
    from mqinfer.ops.budgets import load_budgets
    from mqinfer.ops.report import cost_report, schema_validity, uncompacted_warning
    from mqinfer.ops.report_render import plot, render

    by = [b.strip() for b in opts["by"].split(",") if b.strip()]
    try:
        budgets = load_budgets(opts["budgets"]) if opts["budgets"] else None
        report = cost_report(args.dir, by=by, since=_parse_time(opts["since"]),
                             until=_parse_time(opts["until"]), top=opts["top"], budgets=budgets,
                             basis=opts["basis"])
    except (ValueError, OSError) as exc:
        print(f"mqinfer report costs: error: {exc}", file=sys.stderr)
        return 2
    warning = uncompacted_warning(report, args.dir)
    if warning:
        print(f"mqinfer report costs: {warning}", file=sys.stderr)
    print(render(report, opts["format"]), end="")
    validity = schema_validity(args.dir)
    if validity is not None:
        line = (f"structured output: {validity[0]} of {validity[1]} rows with a response_format validated "
                "(schema_valid)")
        # The table gets it as a last line; csv and json stay machine-readable.
        print(line, file=sys.stdout if opts["format"] == "table" else sys.stderr)
    if opts["html"]:
        from mqinfer.ops.report_html import render_html

        try:
            Path(opts["html"]).write_text(render_html(report), encoding="utf-8")
        except OSError as exc:
            print(f"mqinfer report costs: error: cannot write {opts['html']}: {exc}", file=sys.stderr)
            return 2
        print(f"html: {opts['html']}", file=sys.stderr)
    if opts["plot"]:
        try:
            charts = plot(report, opts["plot"])
        except RuntimeError as exc:
            print(f"mqinfer report costs: error: {exc}", file=sys.stderr)
            return 2
        print("charts: " + ", ".join(str(p) for p in charts), file=sys.stderr)
    return 0


# -- run -------------------------------------------------------------------------------------
def cmd_run(args, opts: dict) -> int:
    from mqinfer.run import cmd_run as run

    return run(args, opts)


# -- plan ------------------------------------------------------------------------------------
def cmd_plan(args, opts: dict) -> int:
    from mqinfer.loadgen.plan.command import cmd_plan as plan

    return plan(args, opts)
