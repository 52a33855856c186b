"""`mqinfer run`: a whole bulk job in one command, safe to run again.

The job id derives from the input file's bytes, so running the same command again resumes the
same job: requests that already have a result row in ``OUT/results`` are not sent again, and a
finished job computes nothing. ``--fresh`` removes the job's rows and starts over; ``--job-id``
names the job explicitly. One run holds an output folder at a time (``mqinfer.runlock``), and
its embedded server and workers die with it (``mqinfer.procs``). ``--out`` may be object storage
(``s3://bucket/prefix``): the rows go there, the run's state stays on this machine
(``mqinfer.run_state``), and the rows are not compacted.

The results dataset is the record of what is done: a row is durable before its stream entry is
acked, so a run cut anywhere (Ctrl-C, kill -9, a crash) leaves rows for exactly the requests
whose work is kept, and the next run sends only the rest. ``--max-cost-usd`` caps what the job
spends (``mqinfer.workers.queue.job_caps``); the requests the cap stopped have ``budget_exceeded`` rows,
which the next run removes and computes again (under its own cap, if any).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from mqinfer.config import ENGINE_OPTIONS, LOG_FORMAT, WORKER_OPTIONS, ConfigError
from mqinfer.layout import choose_layout
from mqinfer.machine import Window, bill_remainder, settle_lost, worker_shares
from mqinfer.procs import mqinfer_command
from mqinfer.warm_start import WarmStarter
from mqinfer.run_caps import cap_summary, check_cap, set_cost_cap, stopped_by_cap
from mqinfer.run_progress import mark_done, wait_done, wait_for_workers
from mqinfer.run_state import STATE_DIR, check_manifest, ids_with_rows, job_rows, state_home, write_manifest
from mqinfer.schemas import lanes as lane_scheme
from mqinfer.schemas.dataset_uri import check_writable, join, out_location, shown
from mqinfer.schemas.errors import BUDGET_EXCEEDED
from mqinfer.supervise import Supervisor
from mqinfer.schemas.prefix_order import prefix_order

class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while the job ran."""


def input_job_id(path: Path) -> str:
    """The default job id: a hash of the input file's bytes, so a re-run finds its own rows."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"run-{digest.hexdigest()[:16]}"


def check_run_flags(opts: dict) -> None:
    """Every flag checked before anything is locked, written or submitted."""
    if opts["shards"] < 1:
        raise ConfigError("--shards must be >= 1")
    if opts["workers"] < opts["shards"]:
        raise ConfigError(f"--workers ({opts['workers']}) must be at least --shards ({opts['shards']}): "
                          "each shard's stream is read by its own workers")
    check_cap(opts.get("max_cost_usd"))
    if opts["redis_cluster"] and not opts["redis"]:
        raise ConfigError("--redis-cluster needs --redis URL of a cluster node (the embedded server is not a cluster)")
    from mqinfer.commands import worker_config

    worker_config(opts, redis_url=opts["redis"] or "unix:///unused", out=out_location(opts["out"]))
    placement(opts)  # refuses devices that do not exist
    model = Path(opts["model"])
    is_gguf = model.suffix.lower() == ".gguf" and model.is_file()
    if opts["model"] != "tiny" and not (model.is_dir() or is_gguf):
        raise ConfigError(f"--model {opts['model']!r} is neither 'tiny', a checkpoint folder nor a .gguf file")
    if opts["model"] != "tiny" and model.is_dir() and not (model / "config.json").is_file():
        raise ConfigError(f"--model {opts['model']!r}: {model / 'config.json'}: file not found (a checkpoint folder "
                          "needs config.json)")


def model_label(model: str) -> str:
    return "tiny" if model == "tiny" else Path(model).name


# -- the run ------------------------------------------------------------------------------------
def cmd_run(args, opts: dict) -> int:
    from mqinfer.runlock import RunLock, RunLockError

    workers, threads, why = choose_layout(opts)
    opts = {**opts, "workers": workers, "num_threads": threads}
    check_run_flags(opts)
    if why != "--workers":
        print(f"{workers} worker{'s' if workers > 1 else ''} x {threads or 'all'} thread"
              f"{'s' if threads != 1 else ''} ({why}; --workers N sets it)", file=sys.stderr)
    input_path = Path(args.input)
    if not input_path.is_file():
        raise FileNotFoundError(f"no such input file: {input_path}")
    out = out_location(opts["out"])
    if isinstance(out, Path):
        out = out.resolve()
        out.mkdir(parents=True, exist_ok=True)
    else:
        try:
            check_writable(out)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
    home = state_home(out)
    job_id = opts["job_id"] or input_job_id(input_path)
    lock = RunLock(home)
    try:
        stopped = lock.acquire()
    except RunLockError as exc:
        raise ConfigError(str(exc)) from None
    try:
        if stopped:
            print(f"stopped {len(stopped)} leftover processes of an earlier run on {out} "
                  f"(pids {', '.join(map(str, stopped))})", file=sys.stderr)
        return _run_locked(input_path, out, home, job_id, opts, lock)
    finally:
        lock.release()


def _run_locked(input_path: Path, out: Path | str, home: Path, job_id: str, opts: dict, lock) -> int:
    """The run, its folder locked: ``out`` holds the rows (a folder, or a URI), ``home`` the state."""
    from mqinfer.commands import read_input
    from mqinfer.ops.compact import compact, drop_job

    model = model_label(opts["model"])
    check_manifest(home, out, job_id, model, opts["fresh"])
    if opts["fresh"]:
        results, costs = drop_job(out, job_id)
        if results or costs:
            print(f"--fresh: removed {results} result rows and {costs} cost rows of job {job_id}", file=sys.stderr)
    capped = stopped_by_cap(out, job_id)
    if capped:
        # They never ran: running the job again (with a higher cap, or none) computes them now.
        drop_job(out, job_id, capped)
        print(f"job {job_id}: {len(capped)} requests a cost cap stopped earlier run now", file=sys.stderr)
    requests, invalid, duplicates = read_input(str(input_path), job_id)
    for message in duplicates:
        print(message, file=sys.stderr)
    invalid_ids = {item.error.request_id or f"line:{item.line}" for item in invalid}
    total = len({r.id for r in requests} | invalid_ids)
    write_manifest(home, job_id, input_path, model, total)
    done_before = ids_with_rows(out, job_id)
    started = time.time()
    _write_invalid_rows(out, job_id, [i for i in invalid
                                      if (i.error.request_id or f"line:{i.line}") not in done_before], opts)
    todo = [r for r in requests if r.id not in done_before]
    if done_before and todo:
        print(f"job {job_id}: resuming: {len(requests) - len(todo)} of {len(requests)} requests already have "
              f"rows in {shown(join(out, 'results'))}", file=sys.stderr, flush=True)
    machine = None
    if todo:
        if opts["order"] == "prefix":
            todo = prefix_order(todo, opts["prefix_cache_scope"])
        window = Window(devices=1.0, price_per_device_hour=opts["price_per_device_hour"])
        try:
            status = _compute(todo, requests, done_before, out, home, job_id, opts, lock, window)
        finally:
            machine = _bill_machine(out, home, job_id, window)
    else:
        status = 0
        if requests and done_before:
            print(f"job {job_id}: every request already has a row: nothing to compute "
                  "(--fresh starts over)", file=sys.stderr)
    if isinstance(out, Path):  # compaction needs a folder; object storage keeps the parts as written
        compact(out)
    if status == 130:
        print(f"mqinfer run: interrupted; run the same command again to resume job {job_id}", file=sys.stderr)
        _summary(out, job_id, total, started, opts, machine, complete=False)
        return 130
    if status != 0:
        return status
    return _summary(out, job_id, total, started, opts, machine)


def _bill_machine(out: Path | str, home: Path, job_id: str, window: Window) -> dict | None:
    """The run's own ``idle`` row for what its workers did not cover (``mqinfer.machine``)."""
    try:
        return bill_remainder(out, home / STATE_DIR, job_id, window)
    except (OSError, ValueError) as exc:
        print(f"mqinfer run: warning: could not bill the machine time no worker covered: {exc}", file=sys.stderr)
        return None


def _write_invalid_rows(out: Path | str, job_id: str, invalid: list, opts: dict) -> None:
    """Lines that failed validation get their error row here, once per job."""
    if not invalid:
        return
    from mqinfer.schemas.rows import CostRow, error_result_row
    from mqinfer.workers.queue.sink import Sinks

    now = time.time()
    model = model_label(opts["model"])
    sinks = Sinks(out, "submit")
    for item in invalid:
        rid = item.error.request_id or f"line:{item.line}"
        row = error_result_row(rid, job_id, item.error.code, f"line {item.line}: {item.error.message}",
                               model=model, worker="submit", attempt=0, enqueued_at=now, finished_at=now)
        sinks.add(row, CostRow(kind="request", job_id=job_id, id=rid, tenant=row.tenant, model=row.model,
                               request_type=row.request_type, prompt_tokens=0, cached_prompt_tokens=0,
                               output_tokens=0, queue_s=0.0, prefill_s=0.0, decode_s=0.0, device_s=0.0,
                               recomputed_s=0.0, kv_block_s=0.0, cost_usd=0.0,
                               price_per_device_hour=opts["price_per_device_hour"], worker="submit",
                               finished_at=now))
    sinks.flush()
    print(f"{len(invalid)} invalid lines got error rows (first: line {invalid[0].line}: "
          f"{invalid[0].error.message})", file=sys.stderr)


class _Signals:
    """Ctrl-C and SIGTERM stop the job in order: the first asks the workers to finish and write what
    they hold; later ones only say that this is under way (rows already written are never redone)."""

    def __init__(self) -> None:
        self.count = 0
        self.armed = True  # off once the run is stopping anyway: a signal then only says so
        self._previous = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        self.count += 1
        if self.count == 1 and self.armed:
            raise Interrupted()
        print("\nmqinfer run: still stopping: workers are writing and acknowledging what they finished",
              file=sys.stderr, flush=True)


def _embedded_server(home: Path):
    """The run's own Redis-compatible server, in the run's state."""
    from mqinfer.server import EmbeddedServer, ServerError

    try:
        return EmbeddedServer(home / STATE_DIR / "redis", unix_socket=True).start()
    except ServerError as exc:
        raise ConfigError(f"cannot start the embedded server: {exc}") from None


def _compute(todo, requests, done_before: set[str], out: Path | str, home: Path, job_id: str, opts: dict, lock,
             window: Window) -> int:
    """Serve ``todo`` with the run's workers; ``window`` gets the devices the run holds and when
    its first worker started and its last one exited."""
    from mqinfer.schemas import keys
    from mqinfer.client import Producer
    from mqinfer.schemas.connection import connect_redis
    from mqinfer.schemas.keys import shard_index, shard_streams

    streams = shard_streams(opts["stream"], opts["shards"])
    server = client = None
    workers: list[subprocess.Popen] = []
    starter = WarmStarter(tiny=opts["model"] == "tiny").prepare()  # imports the engine meanwhile
    with _Signals() as signals:
        try:
            redis_url = opts["redis"]
            if not redis_url:
                server = _embedded_server(home)
                redis_url = server.url
            client = connect_redis(redis_url, cluster=opts["redis_cluster"])
            if server is not None:
                # The server is this run's alone (the folder is locked): what an earlier, killed run
                # left in it is superseded by the rows on disk.
                client.flushall()
            set_cost_cap(client, out, job_id, opts.get("max_cost_usd"))
            done_keys = [keys.job_done_set(s, job_id) for s in streams]
            mark_done(client, done_keys, [r for r in requests if r.id in done_before], len(streams), shard_index)
            env = dict(os.environ, MQINFER_REDIS=redis_url)
            if not isinstance(out, Path):
                env["MQINFER_OUT"] = out  # object storage: credentials it may carry stay out of argv
            env.setdefault("MQINFER_LOG_LEVEL", "warning" if opts["log_level"] == "info" else opts["log_level"])
            # Worker i reads shard i mod N. They join their consumer groups before anything is
            # submitted, so that the first one ready leaves the others their share.
            places = placement(opts)
            shares, window.devices = worker_shares(opts, places)
            window.start()

            def start(i: int) -> subprocess.Popen:
                return starter.popen(
                    worker_argv(opts, out, i, streams[i % len(streams)], places[i], device_share=shares[i]), env=env,
                    stdin=subprocess.DEVNULL, pass_fds=(lock.fd,), start_new_session=True)

            def started_again(proc: subprocess.Popen) -> None:
                window.pids.append(proc.pid)
                lock.add_children([proc.pid])

            workers.extend(start(i) for i in range(opts["workers"]))
            window.pids = [w.pid for w in workers]
            lock.add_children([w.pid for w in workers])
            wait_for_workers(client, [keys.request_stream(s) for s in streams], opts["group"], workers)
            if len(streams) > 1 or opts["redis_cluster"]:
                from mqinfer.commands import submit_sharded

                submit_sharded(opts, redis_url, todo)
            else:
                Producer(stream=opts["stream"], client=client, lanes=opts["lanes"],
                         max_lanes=opts["max_lanes"]).submit_many(todo)
            print(f"job {job_id}: submitted {len(todo)} requests", file=sys.stderr, flush=True)
            generated_keys = [keys.generated_tokens(s) for s in streams]

            def stream_keys() -> list[str]:
                return [k for s in streams for k in lane_scheme.stream_keys(client, s)]

            supervisor = Supervisor(client, workers, start, stream_keys, opts["group"],
                                    claim_idle_ms=opts["claim_idle_ms"], max_deliveries=opts["max_deliveries"],
                                    on_start=started_again)
            return wait_done(client, done_keys, len(requests), workers, generated_keys, job_id,
                              stream_keys(), opts["group"], supervisor)
        except Interrupted:
            print("\nmqinfer run: stopping: workers finish what they run and write it "
                  f"(up to --drain-timeout-s {opts['drain_timeout_s']:g}s)", file=sys.stderr, flush=True)
            return 130
        finally:
            signals.armed = False
            _stop_workers(workers, timeout_s=opts["drain_timeout_s"] + 30.0, starter=starter)
            if workers:
                window.end()
                _settle_lost(client, streams, opts["group"], window, out)
            if server is not None:
                server.stop()


def _settle_lost(client, streams: list[str], group: str, window: Window, out: Path | str) -> None:
    """The ``lost`` rows of workers killed during the run that no surviving worker billed."""
    import redis

    if client is None:
        return
    try:
        written = settle_lost(client, streams, group, window, out)
    except (redis.exceptions.RedisError, OSError) as exc:
        print(f"mqinfer run: warning: could not bill the lost time of killed workers: {exc}", file=sys.stderr)
        return
    if written:
        print(f"billed the lost time of {written} killed worker{'s' if written > 1 else ''}", file=sys.stderr)


def placement(opts: dict) -> list[tuple[str, str | None]]:
    """(--device, --devices) of each worker: spread over the CUDA devices (``workers.devices``).
    ValueError, naming the devices that exist, for one that does not."""
    from mqinfer.layout import cuda_available, ranks_per_worker
    from mqinfer.workers import devices

    device = opts["device"]
    maybe_cuda = device.startswith("cuda") or opts.get("devices") or (device == "auto" and cuda_available())
    count = devices.cuda_device_count() if maybe_cuda else 0
    try:
        return devices.worker_devices(opts["workers"], device, opts.get("devices"), ranks_per_worker(opts), count)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def worker_argv(opts: dict, out: Path | str, index: int, stream: str,
                device: tuple[str, str | None] | None = None, device_share: float | None = None) -> list[str]:
    """A worker's command line; ``device``: its (--device, --devices) from :func:`placement`;
    ``device_share``: its share of the machine (``mqinfer.machine.worker_shares``), unless the
    user's --device-share. The Redis URL, which may hold a password, goes through the environment
    (MQINFER_REDIS), not argv, where `ps` would show it; so does an object-storage ``out``
    (MQINFER_OUT, set by the run), which may hold credentials."""
    argv = [*mqinfer_command("worker"), *(["--out", str(out)] if isinstance(out, Path) else []), "--stream", stream]
    placed = {} if device is None else {"device": device[0], "devices": device[1]}
    if device_share is not None:
        placed["device_share"] = repr(device_share)
    for opt in [*ENGINE_OPTIONS, *WORKER_OPTIONS, LOG_FORMAT]:
        if opt.name == "consumer":
            continue
        value = placed[opt.name] if opt.name in placed else opts.get(opt.name)
        if value is None:
            continue
        if opt.name == "metrics_port" and value:
            value += index  # each worker of `run --workers N` serves on its own port: P, P+1, ...
        argv += opt.argv(value)
    return argv


def _stop_workers(workers: list[subprocess.Popen], timeout_s: float, starter: WarmStarter | None = None) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for w in workers:
        try:
            w.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    if starter is not None:
        starter.close()


# -- the summary --------------------------------------------------------------------------------
def _summary(out: Path | str, job_id: str, expected: int, started: float, opts: dict, machine: dict | None = None,
             complete: bool = True) -> int:
    columns = ["id", "finish_reason", "error_code", "prompt_tokens", "output_tokens", "finished_at"]
    try:
        choices = job_rows(out, "results", job_id, columns + ["index"])
    except Exception:  # a dataset written before results had an `index` column: one choice each
        choices = job_rows(out, "results", job_id, columns)
    # A request with n choices has a row per choice: the requests are their first choices' rows;
    # the tokens of every choice count.
    rows = [r for r in choices if not r.get("index")]
    cost = sum(r["cost_usd"] for r in job_rows(out, "costs", job_id, ["cost_usd"], kind="request"))
    n = len(rows)
    reasons = Counter(r["finish_reason"] for r in rows)
    codes = Counter(r["error_code"] for r in rows if r["finish_reason"] == "error")
    parts = []
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        part = f"{count} {reason}"
        if reason == "error":
            part += " (" + ", ".join(f"{code or 'unknown'} {c}" for code, c in sorted(codes.items())) + ")"
        parts.append(part)
    text = ", ".join(parts) if parts else "none"
    print(f"job {job_id}: {n} of {expected} requests have rows: {text}")
    mine = [r for r in rows if r["finished_at"] is not None and r["finished_at"].timestamp() >= started]
    mine_choices = [r for r in choices if r["finished_at"] is not None and r["finished_at"].timestamp() >= started]
    wall = max(time.time() - started, 1e-9)
    prompt = sum(r["prompt_tokens"] for r in mine)
    output = sum(r["output_tokens"] for r in mine_choices)
    earlier = f" ({n - len(mine)} rows from earlier runs)" if n - len(mine) else ""
    if mine:
        print(f"this run: {len(mine)} requests{earlier}; tokens: {prompt} prompt, {output} output; "
              f"{output / wall:.1f} output tokens/s over {wall:.1f}s")
    else:
        print(f"this run: nothing computed{earlier}")
    print(f"cost: ${cost:.6f} of requests at ${opts['price_per_device_hour']}/device-hour")
    line = cap_summary(codes.get(BUDGET_EXCEEDED, 0), opts.get("max_cost_usd"))
    if line:
        print(line)
    if machine is not None:
        # Every cost row of this run: the workers' (requests, startup, idle, ...) and the run's own
        # idle row for what no worker covered; they add up to the machine's time.
        devices = machine["devices"]
        print(f"machine: {machine['wall_s']:.1f}s x {devices:g} device{'s' if devices != 1 else ''} = "
              f"{machine['billed_device_s']:.1f} device-seconds billed, ${machine['billed_usd']:.6f} in all "
              f"({machine['remainder_device_s']:.1f}s no worker covered, billed as idle to `run`)")
    print(f"results: {shown(join(out, 'results'))}  costs: {shown(join(out, 'costs'))}")
    if complete and n != expected:
        print(f"mqinfer run: error: expected {expected} result rows, found {n}", file=sys.stderr)
        return 1
    return 0
