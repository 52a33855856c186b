"""Shared parts of the fault suite: worker processes with armed fault points, Redis inspection, and
the final check every case ends with (``mqinfer compact``, then every submitted request exactly
once and nothing else).

Figures: when ``MQINFER_FAULT_REPORT`` names a file, each case appends one JSON line with its
figures (requests submitted, rows before and after compaction, lost, duplicated, worker crashes);
RELIABILITY.md's table was made that way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis.exceptions

from mqinfer.schemas import keys
from mqinfer.client import Producer
from mqinfer.workers.devices import usable_cores
from tests import zygote
from tests.helpers import mqinfer_cmd, rows, wait_until

STREAM = keys.request_stream("requests")
DEAD = keys.dead_letter_stream("requests")

# Small and quick: a KV cache of 256 blocks (not the default gigabyte), a short context, frequent
# flushes. Every case passes its own claim idle time.
FAST = ("--num-kv-blocks", "256", "--max-model-len", "512", "--flush-interval-s", "0.1")


@dataclass
class WorkerProc:
    """A `mqinfer worker` subprocess whose log goes to a file (a pipe could fill up and block it)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    _log: object = field(repr=False, default=None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"worker {self.name} did not exit within {timeout}s; log:\n{self.log()[-4000:]}")
        finally:
            self.close()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def metrics(self, port: int) -> dict[str, float]:
        """The worker's Prometheus samples, by name with labels (``name{label="v"}``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def metrics_port(self, timeout: float = 60.0) -> int:
        """The port a worker started with ``--metrics-port 0`` bound (read from its info log)."""
        found = wait_until(lambda: re.search(r"metrics on http://([\d.]+):(\d+)/metrics", self.log()),
                           timeout=timeout, what=f"worker {self.name} to serve metrics")
        return int(found.group(2))


def spawn(redis_url: str, out: Path, name: str, *args: str, faults: str | None = None,
          log_level: str = "warning") -> WorkerProc:
    """Start a worker named ``name`` (its consumer name too) with ``MQINFER_FAULTS=faults``."""
    env = dict(os.environ, MQINFER_LOG_LEVEL=log_level, OMP_NUM_THREADS="1")
    env.pop("MQINFER_FAULTS", None)
    if faults:
        env["MQINFER_FAULTS"] = faults
    out.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"worker-{name}.log"
    log = open(log_path, "w")
    proc = zygote.popen(
        mqinfer_cmd("worker", "--redis", redis_url, "--out", str(out), "--consumer", name, *FAST, *args),
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )
    return WorkerProc(name, proc, log_path, log)


def requests(job_id: str, n: int, max_tokens: int, *, prefix: str = "r") -> list[dict]:
    """``n`` greedy requests that always generate exactly ``max_tokens`` tokens."""
    return [
        {"id": f"{prefix}{i}", "job_id": job_id, "prompt_token_ids": [256] + [65 + i % 26] * 6,
         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        for i in range(n)
    ]


def submit(redis_url: str, items: list[dict]) -> set[tuple[str | None, str]]:
    Producer(redis_url).submit_many(items)
    return {(item.get("job_id"), item["id"]) for item in items}


def pending_by_consumer(client, stream: str = STREAM) -> dict[str, int]:
    """Entries delivered and not acked, per consumer name (none while the stream or its group does
    not exist yet)."""
    try:
        summary = client.xpending(stream, keys.GROUP)
    except redis.exceptions.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return {}
    return {_s(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}


def pending_ids(client, consumer: str | None = None, stream: str = STREAM) -> set[str]:
    kwargs = {"consumername": consumer} if consumer else {}
    return {_s(p["message_id"]) for p in client.xpending_range(stream, keys.GROUP, "-", "+", 100_000, **kwargs)}


def wait_claimable(client, idle_ms: int, stream: str = STREAM) -> None:
    """Until every pending entry has been idle ``idle_ms``, so that a worker started now with that
    --claim-idle-ms takes them over at its first claim, however fast it starts, instead of idling out
    (--idle-exit-s) while a dead worker's entries are not yet claimable."""
    wait_until(lambda: all(p["time_since_delivered"] >= idle_ms
                           for p in client.xpending_range(stream, keys.GROUP, "-", "+", 100_000)),
               timeout=60, what=f"the pending entries to be idle {idle_ms} ms")


def consumers(client, stream: str = STREAM) -> set[str]:
    return {_s(c["name"]) for c in client.xinfo_consumers(stream, keys.GROUP)}


def temp_files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob(".tmp-*"))


def result_keys(out: Path) -> list[tuple[str | None, str]]:
    return [(r["job_id"], r["id"]) for r in rows(out / "results")]


def compact(out: Path, *, faults: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MQINFER_FAULTS", None)
    if faults:
        env["MQINFER_FAULTS"] = faults
    return zygote.run(mqinfer_cmd("compact", str(out)), capture_output=True, text=True, env=env, timeout=120)


@dataclass
class Outcome:
    rows_before: int
    rows_after: int
    duplicates_removed: int
    cost_rows_marked_duplicate: int
    by_key: dict[tuple[str | None, str], dict]


def compact_and_check(out: Path, expected: set[tuple[str | None, str]], client=None) -> Outcome:
    """``mqinfer compact``, then: every expected request has exactly one row, nothing else has one,
    and exactly one cost row bills each of them. With ``client``, also: no loss was reported (no
    ``lost`` dead letter: nothing was taken for trimmed when it was not)."""
    if client is not None:
        reported = [f for _, f in client.xrange(DEAD) if f.get(b"error_code") == b"lost"]
        assert reported == [], f"loss reported where there was none: {reported}"
    before = result_keys(out)
    done = compact(out)
    assert done.returncode == 0, done.stderr
    numbers = re.search(r"results: (\d+) rows -> (\d+) \((\d+) duplicates removed\).*\((\d+) marked duplicate\)",
                        done.stdout)
    assert numbers, done.stdout
    results = rows(out / "results")
    keys_after = [(r["job_id"], r["id"]) for r in results]
    repeated = [k for k, n in Counter(keys_after).items() if n > 1]
    assert not repeated, f"duplicates after compaction: {repeated}"
    assert set(keys_after) - expected == set(), f"rows for requests never submitted: {set(keys_after) - expected}"
    assert expected - set(keys_after) == set(), f"lost requests: {sorted(expected - set(keys_after), key=str)}"
    billed = Counter((c["job_id"], c["id"]) for c in rows(out / "costs") if c["kind"] == "request")
    assert {k: n for k, n in billed.items() if n != 1} == {}, "a request billed more than once"
    assert set(billed) == expected, "a request not billed"
    assert int(numbers.group(1)) == len(before) and int(numbers.group(2)) == len(expected)
    return Outcome(len(before), len(results), int(numbers.group(3)), int(numbers.group(4)),
                   {(r["job_id"], r["id"]): r for r in results})


def check_lost_time(out: Path, worker: str, died: float, beat_s: float) -> dict:
    """After ``worker`` was killed at ``died`` (unix time) and others took over: exactly one ``lost``
    row bills it, and its rows with that one cover its uptime, from the start of its startup row to
    its last heartbeat (the lost row's finished_at), which is within ``beat_s`` (plus scheduling
    slack) of its death. Returns the lost row."""
    costs = rows(out / "costs")
    lost = [c for c in costs if c["kind"] == "lost"]
    assert [c["worker"] for c in lost] == [worker], lost
    (row,) = lost
    assert row["job_id"] is None and row["tenant"] is None and row["device_s"] > 0
    assert abs(row["cost_usd"] - row["device_s"] * row["price_per_device_hour"] / 3600) < 1e-12
    mine = [c for c in costs if c["worker"] == worker]
    (startup,) = [c for c in mine if c["kind"] == "startup"]
    # Its rows, the lost one too, bill its share of the machine (one model thread of its cores).
    (share,) = {c["device_share"] for c in mine}
    assert share == min(1.0, 1 / usable_cores())
    began = startup["finished_at"].timestamp() - startup["device_s"] / share
    last_beat = row["finished_at"].timestamp()
    assert abs(sum(c["device_s"] for c in mine) - (last_beat - began) * share) < 1e-3
    assert 0 <= died - last_beat <= beat_s + 0.5, (died, last_beat)
    return row


def record(case: str, **figures) -> None:
    """Append one case's figures to ``$MQINFER_FAULT_REPORT`` (when set)."""
    path = os.environ.get("MQINFER_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, **figures}) + "\n")


def killed(proc: WorkerProc) -> bool:
    return proc.proc.returncode == -signal.SIGKILL


def wait_rows(out: Path, n: int, timeout: float = 90.0, what: str = "rows") -> None:
    wait_until(lambda: len(rows(out / "results")) >= n, timeout=timeout, what=what)


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

