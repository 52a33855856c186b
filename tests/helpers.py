"""Helpers shared by the tests: real `mqinfer` processes against the embedded server, a clock moved
by hand, and requests that share prompt prefixes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.dataset as ds

from mqinfer.schemas.request import request_from_obj
from mqinfer.schemas.routing import PrefixRouter
from tests import zygote


def clean_env(*drop: str) -> dict[str, str]:
    """This process's environment without the MQINFER_* settings (and the other variables in
    ``drop``) that would change what the commands under test do. The shared warm template that
    conftest.py starts stays: it changes how a run's workers start, not what they compute, and
    without it each run imports the engine once more in a template of its own."""
    from mqinfer.warm_start import SHARED

    return {k: v for k, v in os.environ.items()
            if (k == SHARED or not k.startswith("MQINFER_")) and k not in drop}


def mqinfer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mqinfer", *args]


def start_worker(redis_url: str, out: Path, *extra: str, log_level: str = "warning") -> subprocess.Popen:
    # One model thread per worker: tests run several processes on a small machine, where
    # oversubscribed threads make every step many times slower.
    env = dict(os.environ, MQINFER_LOG_LEVEL=log_level, OMP_NUM_THREADS="1")
    return zygote.popen(
        mqinfer_cmd("worker", "--redis", redis_url, "--out", str(out), *extra),
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_exit(proc: subprocess.Popen, timeout: float = 180.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"process did not exit within {timeout}s; stderr:\n{err[-4000:]}")
    return proc.returncode, err


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def blocked_in(redis_client, command: str) -> int:
    """How many of the server's connections are blocked in ``command`` (``xread``, ``xreadgroup``;
    CLIENT LIST's flag ``b``): a test waits for a reader to be waiting instead of sleeping."""
    return sum(1 for c in redis_client.client_list() if c.get("cmd") == command and "b" in c.get("flags", ""))


class LineCollector:
    """Reads a running process's text stream (its stderr, say) line by line on a thread, so that a
    test can wait for a line while the process runs; ``text`` waits for the end of the stream."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def count(self, predicate) -> int:
        return sum(1 for line in list(self.lines) if predicate(line))

    def text(self, timeout: float = 30.0) -> str:
        self._thread.join(timeout)
        return "".join(self.lines)


def read_dataset(path: Path):
    if not path.exists():
        return None
    return ds.dataset(path, format="parquet", partitioning="hive").to_table()


def rows(path: Path) -> list[dict]:
    table = read_dataset(path)
    return [] if table is None else table.to_pylist()


def write_jsonl(path: Path, items) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(item if isinstance(item, str) else json.dumps(item))
            f.write("\n")
    return path


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (Linux, /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and its children (an rq worker's work horse runs in its own group)."""
    children = children_of(proc.pid)
    proc.kill()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def stop_processes(*procs: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL after ``timeout``)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class FakeClock:
    """A clock the test moves by hand, for code that takes ``clock=`` (no sleeping)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1000.0


class ShadowKV:
    """A stand-in for the paged KV cache that records, per slot, the token prefix its KV was
    computed from (a position's real KV depends on every token before it).

    ``device`` holds the records of the KV cache's slots, ``host`` those of the swap pool's. A
    request that reads a slot whose record is not its own prefix would read wrong, stale or
    overwritten KV: a bad block table, a prefix-cache hit on the wrong block, a block reused while
    still held, a swap copied to the wrong place or in the wrong order.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}

    def slot(self, request, pos: int) -> int:
        """The device slot that holds position ``pos`` of ``request`` (through its block table)."""
        bs = self.block_size
        return request.block_ids[pos // bs] * bs + pos % bs

    def check_reads(self, request, upto: int) -> None:
        """Assert that every position before ``upto`` holds the request's own prefix."""
        tokens = request.all_token_ids
        for pos in range(upto):
            assert self.device.get(self.slot(request, pos)) == tuple(tokens[: pos + 1]), (
                f"{request.request_id} reads wrong KV at position {pos}"
            )

    def write(self, request, start: int, num_new: int) -> None:
        """Record the KV of positions ``start`` .. ``start + num_new - 1`` as computed."""
        tokens = request.all_token_ids
        for pos in range(start, start + num_new):
            self.device[self.slot(request, pos)] = tuple(tokens[: pos + 1])

    def compute(self, manager, request, num_new: int, token: int) -> None:
        """What the model does with a chunk the KV cache manager gave slots to: read every earlier
        position, write the chunk's KV, and sample ``token`` once the whole sequence is computed.
        Nobody else may see a block while it is being written: each is held once and not cached."""
        start = request.num_computed_tokens
        self.check_reads(request, start)
        blocks = manager.owned_blocks(request.request_id)
        for pos in range(start, start + num_new):
            block = blocks[pos // self.block_size]
            assert block.ref_cnt == 1 and block.block_hash is None
        self.write(request, start, num_new)
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)

    def copy(self, pairs, src: dict, dst: dict) -> None:
        """Copy whole blocks, (source block, destination block) per pair, between two record maps."""
        bs = self.block_size
        for a, b in pairs:
            for j in range(bs):
                value = src.get(a * bs + j)
                if value is None:
                    dst.pop(b * bs + j, None)
                else:
                    dst[b * bs + j] = value


def shared_prefix_requests(per_group: int, max_tokens: int = 4) -> list[dict]:
    """Requests of two groups that share 64 leading token ids within a group, taking turns.

    Two prefixes of equal work fit two shards exactly; the balance slack would still let one
    request of the second group onto the first one's shard if both prefixes had the same first
    shard, so the prefixes are picked (once, deterministically) among those a fresh router keeps
    wholly apart."""
    for seed in range(1, 100):
        heads = [[(31 * (seed + g) + 7 * t + 1) % 250 for t in range(64)] for g in range(2)]
        items = [{"id": f"t{i}", "prompt_token_ids": heads[i % 2] + [i % 250, (3 * i) % 250],
                  "max_tokens": max_tokens, "temperature": 0.0} for i in range(2 * per_group)]
        shards = PrefixRouter(2).assign([request_from_obj(d) for d in items])
        if len(set(shards[0::2])) == len(set(shards[1::2])) == 1:
            return items
    raise AssertionError("no two prefixes that a router keeps apart")


def on_one_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with torch on one thread, its thread count put back afterwards: for
    reference code made of many small tensor operations, which other threads only slow down (each
    operation waits for every thread, and on a shared machine another process holds the cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(before)
