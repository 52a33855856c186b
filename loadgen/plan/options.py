"""The flags of `mqinfer plan`, kept apart from the planner so that building the command line imports
nothing heavy (no numpy, no torch).

The engine's flags (``--model``, ``--num-threads``, ``--max-num-seqs``, ...) and the batcher's and
price flags are the worker's own options (mqinfer/config.py), so a plan is made for exactly the
worker those flags would start; every flag is also read from ``MQINFER_<FLAG>`` and the TOML config
(a ``[plan]`` table applies to this command only).
"""

from __future__ import annotations

from mqinfer.config import ENGINE_OPTIONS, LOG_FORMAT, LOG_LEVEL, WORKER_OPTIONS, Option
from mqinfer.layout import parse_workers
from mqinfer.loadgen.bench_options import WORKLOADS

PLAN_HELP = ("How many workers a workload needs to meet a target, and what a request costs: the real scheduler "
             "and batcher simulated with this machine's measured step times.")
PLAN_DESCRIPTION = (
    "How many workers a workload needs to meet a target (--rate with SLOs, or a bulk job's --deadline-s), with the "
    "predicted latency, throughput, cost per request and per million tokens (start-up and warm running apart) and "
    "KEDA replica bounds. Step times come from a calibration of this machine, model and worker layout (--calibrate, "
    "once; kept under the cache folder); the real scheduler and batcher are then simulated on a simulated clock. On "
    "a CPU a planned worker has one thread unless --num-threads says otherwise (the layout of `mqinfer run --workers "
    "auto`). Exit 1 when the target is out of reach.")

# Requests simulated when --num-requests is not given: a named workload's for a bulk job (the
# bench's default), and for an online rate enough arrivals that the p99 rests on ten requests.
BULK_REQUESTS = 256
ONLINE_REQUESTS = 1000


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"expected a number > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return value


WORKLOAD = Option("workload", str, None, "Plan for a synthetic workload instead of INPUT (the lengths of `mqinfer "
                  "bench --workload`): standard = prompts 16..256 tokens, outputs 16..128; uniform, lognormal, "
                  "shared-prefix, fixed (128 + 128).", choices=WORKLOADS)
NUM_REQUESTS = Option("num_requests", _positive_int, None, f"Requests to simulate: of --workload (default "
                      f"{BULK_REQUESTS} for a bulk job, {ONLINE_REQUESTS} with --rate); with INPUT and --rate, the "
                      f"file's requests arrive in turn, repeated up to this many (default: the file's count, at "
                      f"least {ONLINE_REQUESTS}).", metavar="N")
SEED = Option("seed", int, 0, "Seed of the synthetic workload and of the arrival times.", metavar="S")
RATE = Option("rate", _positive_float, None, "Online target: requests arrive at this many per second (a seeded "
              "Poisson process). Without it the input is a bulk job, every request submitted at once.",
              metavar="QPS")
SLO_TTFT = Option("slo_ttft_p99_ms", _positive_float, None, "With --rate: the 99th percentile of time to first token "
                  "(from entering the stream) must stay at or below this.", metavar="MS")
SLO_TPOT = Option("slo_tpot_ms", _positive_float, None, "With --rate: the 99th percentile over requests of the time "
                  "per output token after the first must stay at or below this. Without either SLO, the bench's "
                  "online goal applies: p99 TTFT <= the batcher's max wait + 3 engine steps.", metavar="MS")
DEADLINE = Option("deadline_s", _positive_float, None, "Bulk target: every request submitted at once, done within "
                  "this many seconds of the workers' start (their start-up included).", metavar="S")
PLAN_WORKERS = Option("workers", parse_workers, "auto", "Workers to plan for, or auto: the fewest that meet the "
                      "target (without a target, what `mqinfer run --workers auto` starts on this machine).",
                      metavar="N|auto")
CALIBRATE = Option("calibrate", bool, False, "Measure this machine's step costs for the model and worker layout "
                   "first (the real engine on a few batch shapes, under two minutes for the tiny model) and keep "
                   "them under the cache folder's plan/ for later plans.")
PLAN_FORMAT = Option("format", str, "table", "Output format.", choices=("table", "json"))
PLOT = Option("plot", str, None, "Also draw p99 TTFT against requests per second (a quarter to 1.5 times the rate) "
              "for the planned worker count, one fewer and one more, into FILE (.png, .svg or .pdf; needs "
              "matplotlib); the JSON gains the points as `sweep`.", metavar="FILE")

# The worker's own flags that change what a plan predicts or what it costs.
WORKER_PLAN_OPTIONS = [o for o in WORKER_OPTIONS
                       if o.name in ("max_batch", "max_wait_ms", "flush_rows", "flush_interval_s",
                                     "price_per_device_hour", "device_share", "tenant_slos")]

PLAN_CMD = [WORKLOAD, NUM_REQUESTS, SEED, RATE, SLO_TTFT, SLO_TPOT, DEADLINE, PLAN_WORKERS, CALIBRATE, PLAN_FORMAT,
            PLOT, *ENGINE_OPTIONS, *WORKER_PLAN_OPTIONS, LOG_LEVEL, LOG_FORMAT]
