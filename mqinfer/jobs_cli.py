"""The `mqinfer jobs` command line: submit, worker, status, list, cancel (bulk jobs through rq).

``add_jobs_parser(subparsers)`` adds the ``jobs`` command to the main parser; every subcommand's
parsed args carry ``_jobs_handler(args, opts) -> int``. ``python -m mqinfer.jobs_cli ...`` runs the
same commands on their own. Every flag also comes from ``MQINFER_<FLAG>`` and from ``--config`` (a
``[jobs]`` table overrides the top level). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from mqinfer.config import (
    LANES, LOG_LEVEL, MAX_COST_USD, MAX_LANES, ORDER, PREFIX_CACHE_SCOPE, REDIS, REDIS_CLUSTER, ROUTE, SHARDS, STREAM,
    ConfigError, Option, add_options, load_config_file, resolve,
)
from mqinfer.ops.job_lanes import DEFAULT_JOB_LANES

OUT = Option("out", str, None, "Output folder: output.parquet (and output.jsonl / errors.jsonl for OpenAI "
             "Batch input) and the job's spool go here.", metavar="DIR")
DEADLINE = Option("deadline", str, None, "When the job expires: +SECONDS from now, unix seconds, or ISO 8601 "
                  "(UTC unless a zone is given). Rows finished by then are kept.", metavar="WHEN")
MAX_IN_FLIGHT = Option("max_in_flight", int, 256, "Requests of this job in the stream without a row yet, at "
                       "most (backpressure).", metavar="N")
CHUNK_SIZE = Option("chunk_size", int, 500, "Requests sent to the stream per feed step.", metavar="N")
QUEUE = Option("queue", str, "mqinfer-jobs", "rq queue of the job tasks.", metavar="Q")
LEASE_S = Option("lease_s", float, 10.0, "Lock lease of a running job task; a dead task's job is taken over "
                 "after about this long.", metavar="S")
SWEEP_INTERVAL_S = Option("sweep_interval_s", float, 2.0, "How often the worker looks for jobs whose task "
                          "chain stopped (a killed worker) and restarts them.", metavar="S")
WORKER_NAME = Option("name", str, None, "Worker name (without it: mqinfer-jobs-HOST-PID-random).", metavar="NAME")
BURST = Option("burst", bool, False, "Exit once the queue is empty.")
SUBMIT_JSON = Option("json", bool, False, "Print {\"job_id\": ...} as JSON.")
STATUS_JSON = Option("json", bool, False, "Print the status as JSON.")
LIST_JSON = Option("json", bool, False, "Print a JSON array.")
WATCH = Option("watch", bool, False, "Refresh until the job ends (a progress bar on a terminal); exit 0 if it "
               "completed, 1 otherwise.")
INTERVAL = Option("interval", float, 1.0, "Seconds between refreshes.", metavar="S")
LIMIT = Option("limit", int, 50, "At most this many.", metavar="N")
WORKER_OUT = Option("worker_out", str, None, "The inference workers' --out folders or object storage URIs "
                    "(comma-separated), whose costs/ "
                    "datasets hold the job's cost rows. Given at submit, the job's last task reads them when it ends "
                    "(they must be readable where `mqinfer jobs worker` runs) and its cost becomes the sum of every "
                    "cost row of the job: each attempt of a retried request and work done twice included. Without "
                    "them the cost is the running sum of the costs the workers put on the job's result stream, one "
                    "attempt per request.", metavar="DIR[,DIR...]")
STATUS_WORKER_OUT = dataclasses.replace(WORKER_OUT, help="Read the job's cost from the cost rows in these "
                                        "inference workers' --out folders (comma-separated) now, whatever its status. "
                                        "Without it: while the job runs, the running sum of the costs on its result "
                                        "stream (shown as provisional); once it ended, the figure its last task read "
                                        "from the cost rows of the folders given at submit.")

JOBS_REDIS = Option("jobs_redis", str, None, "A plain Redis server for the rq queue and the job state, when the "
                    "request streams live elsewhere: --redis is then the inference workers' server (a Redis "
                    "Cluster seed with --redis-cluster; rq cannot run on a cluster). Default: --redis holds "
                    "everything.", metavar="URL")

# A job is fed part by part (4096 input lines each, validated as they come): the prefix order is
# the order within each part.
JOB_ORDER = dataclasses.replace(ORDER, help="The order the job's requests enter the stream: prefix = within each "
                                "part of 4096 input lines, requests sharing a prompt prefix next to each other (token "
                                "ids, else the prompt's bytes), so a worker computes a shared prefix once while its KV "
                                "blocks are cached (requests further apart than a part are not brought together); "
                                "input = the file's order. The output is in input order either way.")

# A lane of its own for every job by default, so that a job submitted behind a large one is read by
# the workers beside that one's backlog, not after it.
JOB_LANES = dataclasses.replace(LANES, default=DEFAULT_JOB_LANES, help="The lane each of the job's requests waits "
                                "in: a stream of its own per tenant and job (tenant,job), per job (job), per tenant "
                                "(tenant), or the plain stream mqinfer:{S} (none). Workers read every lane by fair "
                                "share, so one job's backlog does not hold back a job submitted after it. The job's "
                                "own lanes are removed when it ends.")

SUBMIT_OPTIONS = [REDIS, JOBS_REDIS, REDIS_CLUSTER, OUT, STREAM, SHARDS, ROUTE, JOB_ORDER, PREFIX_CACHE_SCOPE,
                  JOB_LANES, MAX_LANES, DEADLINE, MAX_IN_FLIGHT, CHUNK_SIZE, QUEUE, LEASE_S, WORKER_OUT, MAX_COST_USD,
                  SUBMIT_JSON,
                  LOG_LEVEL]
WORKER_OPTIONS = [REDIS, JOBS_REDIS, REDIS_CLUSTER, QUEUE, SWEEP_INTERVAL_S, WORKER_NAME, BURST, LOG_LEVEL]
STATUS_OPTIONS = [REDIS, JOBS_REDIS, STATUS_WORKER_OUT, STATUS_JSON, WATCH, INTERVAL, LOG_LEVEL]
LIST_OPTIONS = [REDIS, JOBS_REDIS, LIMIT, LIST_JSON, LOG_LEVEL]
CANCEL_OPTIONS = [REDIS, JOBS_REDIS, REDIS_CLUSTER, LOG_LEVEL]

_FINAL = ("completed", "failed", "cancelled", "expired")


def add_jobs_parser(subparsers) -> argparse.ArgumentParser:
    """Add `jobs` (with submit, worker, status, list, cancel) to the main parser's subparsers."""
    text = "Bulk jobs through rq: submit a file, watch it, cancel it; it resumes after any crash."
    jobs = subparsers.add_parser("jobs", help=text, description=text)
    jobs.set_defaults(_options=[], _required=(), _jobs_handler=_needs_subcommand(jobs))
    _add_subcommands(jobs)
    return jobs


def _needs_subcommand(parser: argparse.ArgumentParser):
    def handler(_args, _opts) -> int:
        parser.print_help(sys.stderr)
        return 2
    return handler


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")

    def command(name: str, help_text: str, options: list[Option], handler, required=()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", metavar="FILE", help="TOML file with flag values (env MQINFER_CONFIG).")
        add_options(p, options, required=required)
        p.set_defaults(_options=options, _required=required, _jobs_handler=handler)
        return p

    p = command("submit", "Register a bulk job for INPUT (JSONL or Parquet; native requests or OpenAI Batch "
                "lines) and print its id. `mqinfer jobs worker` runs it; inference workers compute it. "
                "Submitting the same INPUT into the same --out again resumes a job the server forgot, or "
                "carries on a job its cost cap stopped (--max-cost-usd): the requests the cap stopped run, the "
                "others keep their rows.",
                SUBMIT_OPTIONS, cmd_submit, required=("redis", "out"))
    p.add_argument("input", metavar="INPUT", help="Input file.")
    command("worker", "Run an rq worker for bulk-job tasks (they import no torch).", WORKER_OPTIONS,
            cmd_worker, required=("redis",))
    p = command("status", "Show a job: status, counts, tokens, cost, throughput, ETA (reads the jobs server: "
                "--jobs-redis, else --redis). The cost comes from the job's cost rows (every attempt of every "
                "request) once the job ended with --worker-out given at submit, or now with --worker-out here; "
                "otherwise it is the running sum on the job's result stream, provisional while the job runs.",
                STATUS_OPTIONS, cmd_status)
    p.add_argument("job_id", metavar="ID", help="Job id.")
    command("list", "List jobs, newest first (on --jobs-redis, else --redis).", LIST_OPTIONS, cmd_list)
    p = command("cancel", "Cancel a job: requests not started end as cancelled; rows already finished are "
                "kept in its output. Needs the jobs server (--jobs-redis, else --redis); with --jobs-redis, "
                "also giving --redis lets the inference workers stop its running requests at once.",
                CANCEL_OPTIONS, cmd_cancel)
    p.add_argument("job_id", metavar="ID", help="Job id.")


def _options(args) -> dict:
    """Every flag of the subcommand: command line > environment > config file ([jobs] table) > default."""
    if not args._options:
        return {}
    path = getattr(args, "config", None) or os.environ.get("MQINFER_CONFIG")
    known = getattr(args, "_config_known", None)
    return resolve(args, args._options, load_config_file(path, "jobs", known), args._required)


def _client(opts: dict):
    """The jobs server: job state and the rq queue (--jobs-redis, else --redis)."""
    from mqinfer.schemas.connection import connect

    url = opts.get("jobs_redis") or opts.get("redis")
    if not url:
        raise ConfigError("give --jobs-redis (or --redis) URL, or set MQINFER_JOBS_REDIS / MQINFER_REDIS")
    if not opts.get("jobs_redis") and opts.get("redis_cluster"):
        raise ConfigError("rq cannot run on a Redis Cluster: with --redis-cluster, give --jobs-redis URL, a plain "
                          "Redis server for the job queue and state")
    client = connect(url)
    if opts.get("jobs_redis"):
        import redis

        try:
            clustered = int(client.info("cluster").get("cluster_enabled", 0))
        except redis.exceptions.ResponseError:  # a server without the cluster section is not a cluster
            clustered = 0
        if clustered:
            raise ConfigError("--jobs-redis must be a plain Redis server, not a cluster node (rq cannot run on a "
                              "cluster)")
    return client


def _data_client(opts: dict, *, needed: bool = True):
    """The inference workers' server (--redis) when --jobs-redis names another one, else None."""
    from mqinfer.schemas.connection import connect_redis

    jobs_url, url = opts.get("jobs_redis"), opts.get("redis")
    if not jobs_url or url == jobs_url:
        return None
    if not url:
        if needed:
            raise ConfigError("with --jobs-redis, also give --redis: the server (or cluster seed, with "
                              "--redis-cluster) of the request streams")
        return None
    return connect_redis(url, cluster=bool(opts.get("redis_cluster")))


# -- handlers --------------------------------------------------------------------------------
def cmd_submit(args, opts: dict) -> int:
    from mqinfer.ops.job_cost import parse_folders
    from mqinfer.ops.jobs import parse_deadline, submit_job

    result = submit_job(
        _client(opts), args.input, opts["out"], stream=opts["stream"], deadline=parse_deadline(opts["deadline"]),
        max_in_flight=opts["max_in_flight"], chunk_size=opts["chunk_size"], queue_name=opts["queue"],
        lease_s=opts["lease_s"], shards=opts["shards"], order=opts["order"], route=opts["route"],
        data=_data_client(opts), worker_out=parse_folders(opts["worker_out"]), lanes=opts["lanes"],
        max_lanes=opts["max_lanes"], prefix_cache_scope=opts["prefix_cache_scope"],
        max_cost_usd=opts["max_cost_usd"],
    )
    if opts["json"]:
        print(json.dumps({"job_id": result.job_id, "resumed": result.resumed, "adopted_rows": result.adopted_rows,
                          "rerun": result.rerun}))
    else:
        print(result.job_id)
        if result.rerun:
            print(f"job {result.job_id} carries on: {result.rerun} requests a cost cap stopped run now; "
                  f"{result.adopted_rows} rows already in {opts['out']} are kept", file=sys.stderr)
        elif result.resumed:
            print(f"resumed job {result.job_id}: {result.adopted_rows} rows already in {opts['out']} are kept",
                  file=sys.stderr)
    return 0


def cmd_worker(args, opts: dict) -> int:
    from mqinfer.ops.jobs import run_worker

    return run_worker(_client(opts), queue_name=opts["queue"], name=opts["name"], burst=opts["burst"],
                      sweep_interval_s=opts["sweep_interval_s"], logging_level=opts["log_level"],
                      data=_data_client(opts))


def cmd_status(args, opts: dict) -> int:
    from mqinfer.ops.job_cost import parse_folders
    from mqinfer.ops.jobs import job_info

    interval = opts["interval"]
    if interval <= 0:
        raise ValueError(f"--interval must be > 0, got {interval}")
    client = _client(opts)
    worker_out = parse_folders(opts["worker_out"])
    info = job_info(client, args.job_id, worker_out=worker_out)
    if not opts["watch"]:
        print(json.dumps(info, indent=2) if opts["json"] else render_status(info))
        return 0
    tty = sys.stderr.isatty() and not opts["json"]
    last_line, last_print = "", 0.0
    while info["status"] not in _FINAL:
        line = progress_line(info)
        now = time.monotonic()
        if tty:
            print("\r\x1b[2K" + line, end="", file=sys.stderr, flush=True)
        elif line != last_line and now - last_print >= 10 * interval or not last_print:
            print(line, file=sys.stderr, flush=True)
            last_line, last_print = line, now
        time.sleep(interval)
        info = job_info(client, args.job_id)
    if worker_out:  # once, at the end: reading every cost row is not for each refresh
        info = job_info(client, args.job_id, worker_out=worker_out)
    if tty:
        print("\r\x1b[2K" + progress_line(info), file=sys.stderr, flush=True)
    print(json.dumps(info, indent=2) if opts["json"] else render_status(info))
    return 0 if info["status"] == "completed" else 1


def cmd_list(args, opts: dict) -> int:
    from mqinfer.ops.jobs import list_jobs

    if opts["limit"] < 1:
        raise ValueError(f"--limit must be >= 1, got {opts['limit']}")
    jobs = list_jobs(_client(opts), limit=opts["limit"])
    if opts["json"]:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    print(f"{'ID':<32} {'STATUS':<12} {'DONE':>15} {'CREATED (UTC)':<20} INPUT")
    for job in jobs:
        c = job["counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["created_at"] or 0))
        print(f"{job['id']:<32} {job['status']:<12} {c['done']:>7}/{c['total']:<7} {created:<20} {job['input']}")
    return 0


def cmd_cancel(args, opts: dict) -> int:
    from mqinfer.ops.jobs import cancel_job

    status = cancel_job(_client(opts), args.job_id, data=_data_client(opts, needed=False))
    if status == "cancelling":
        print(f"job {args.job_id}: cancelling (requests not started end as cancelled; finished rows are kept)")
        return 0
    print(f"job {args.job_id} is {status}: nothing to cancel", file=sys.stderr)
    return 0 if status in ("cancelled", "cancelling") else 1


# -- rendering -------------------------------------------------------------------------------
def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def progress_line(info: dict, width: int = 30) -> str:
    c = info["counts"]
    total = c["total"]
    frac = c["done"] / total if total else (1.0 if info["status"] in _FINAL else 0.0)
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    rate = info["throughput"]["requests_per_s"]
    line = f"[{bar}] {100 * frac:5.1f}% {c['done']}/{total} {info['status']}"
    if rate:
        line += f", {rate:.1f} req/s"
    if info["eta_s"] is not None:
        line += f", eta {_duration(info['eta_s'])}"
    return line


def _cost_line(info: dict) -> str:
    cost = info["cost"]
    if info["cost_usd"] is None:
        return "none collected yet"
    if cost["source"] == "cost_rows":
        line = (f"${cost['usd']:.6f} from {cost['rows']} cost rows (requests ${cost['request_usd']:.6f}, "
                f"work done twice ${cost['duplicate_usd']:.6f})")
        if cost["missing_folders"]:
            line += f"; no costs/ in {', '.join(cost['missing_folders'])}"
        return line
    if cost["provisional"]:
        return f"${cost['usd']:.6f} so far (provisional: from the result stream, one attempt per request)"
    return f"${cost['usd']:.6f} (from the result stream, one attempt per request: no --worker-out was given)"


def render_status(info: dict) -> str:
    c, t = info["counts"], info["tokens"]
    fmt = {"openai": "OpenAI Batch lines", "native": "native requests",
           "mixed": "native requests and OpenAI Batch lines"}.get(info["format"] or "", "not known yet")
    lines = [
        f"job {info['id']}: {info['status']}",
        f"  input      {info['input']} ({fmt})",
        f"  output     {info['out']}",
        f"  progress   {progress_line(info)}",
        f"  requests   total {c['total']}: completed {c['completed']}, failed {c['failed']} "
        f"(invalid lines {c['invalid']}), cancelled {c['cancelled']}, expired {c['expired']}; "
        f"skipped as already done {c['skipped']}; in flight {c['in_flight']}",
        f"  tokens     {t['prompt']} prompt, {t['output']} output",
        "  cost       " + _cost_line(info),
    ]
    if info.get("max_cost_usd") is not None:
        lines.append(f"  cost cap   ${info['max_cost_usd']:g} (--max-cost-usd): requests the cap stopped are "
                     "failed, with error rows budget_exceeded")
    stopped = c.get("budget_exceeded") or 0
    if stopped:
        lines.append(f"  stopped    {stopped} request{'s' if stopped != 1 else ''} did not run (budget_exceeded): "
                     "the job reached its cost cap; submit the same INPUT into the same --out again with a higher "
                     "--max-cost-usd to carry on (the other requests keep their rows)")
    rate, trate = info["throughput"]["requests_per_s"], info["throughput"]["output_tokens_per_s"]
    if rate is not None:
        lines.append(f"  throughput {rate:.2f} req/s, {trate or 0:.1f} output tokens/s; eta {_duration(info['eta_s'])}")
    if info["deadline"]:
        lines.append("  deadline   " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["deadline"])))
    if info["error"]:
        lines.append(f"  reason     {info['error']}")
    if info["last_task_error"]:
        lines.append(f"  last task error: {info['last_task_error']}")
    if info["errors"]:
        lines.append(f"  first invalid lines ({len(info['errors'])} shown, every one has an error row):")
        for e in info["errors"]:
            lines.append(f"    line {e['line']}: {e['code']}: {e['message']}")
    for name, path in info["outputs"].items():
        lines.append(f"  {name + ':':<10} {path}")
    return "\n".join(lines)


# -- entry point -----------------------------------------------------------------------------
def run(args, *, setup_logging: bool = False) -> int:
    """Resolve the subcommand's flags and call its handler, with the usual error handling;
    ``setup_logging``: log to stderr at --log-level first (when run on its own)."""
    handler = getattr(args, "_jobs_handler", None)
    if handler is None:
        return 2
    import redis

    from mqinfer.ops.job_store import JobNotFound

    try:
        opts = _options(args)
        if setup_logging:
            logging.basicConfig(level=opts.get("log_level", "info").upper(), stream=sys.stderr,
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return handler(args, opts)
    except KeyboardInterrupt:
        print("mqinfer jobs: interrupted", file=sys.stderr)
        return 130
    except JobNotFound as exc:
        print(f"mqinfer jobs: {exc}", file=sys.stderr)
        return 1
    except redis.exceptions.ConnectionError as exc:
        print(f"mqinfer jobs: error: cannot reach Redis: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"mqinfer jobs: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mqinfer jobs", description="Bulk jobs through rq.")
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    if getattr(args, "_jobs_handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args, setup_logging=True)


if __name__ == "__main__":
    raise SystemExit(main())
