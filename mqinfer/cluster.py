"""Redis Cluster support: connecting to a cluster, sharded request streams, and a local test cluster.

One ``XREADGROUP`` cannot span hash slots, so a stream that outgrows one server is split into
shards: ``--stream S --shards N`` means the streams ``S-0 .. S-{N-1}``, each its own key
``mqinfer:{S-i}`` in its own slot, each read on its own by the workers assigned to it. A request
goes to the shard of its leading prompt (``mqinfer.schemas.routing``: requests sharing a prefix
meet on one shard's workers and its KV cache) or, with ``--route id`` and for short prompts, to
the shard picked by a stable hash of its id. ``cancel`` reaches a prefix-routed request through
every shard's cancel set. Every key that must change atomically with a stream entry (its
dead letters, done sets, cancel set) carries the same hash tag, so acks never need a cross-slot
transaction.

:class:`LocalCluster` starts a real N-node cluster from the packaged server binary (no
``valkey-cli`` needed: slots are assigned and nodes introduced with plain cluster commands), for
tests and for trying the cluster path on one machine.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis
import redis.cluster

from mqinfer.schemas.connection import connect, connect_redis
from mqinfer.server import ServerError, server_binary

NUM_SLOTS = 16384

def _free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise ServerError("no free port pair (P, P+10000) for a cluster node")


class LocalCluster:
    """A Redis Cluster of ``nodes`` masters (no replicas) on loopback, owned by this process.

    Each node keeps an append-only file and its ``nodes.conf`` in ``data_dir/node-<i>``, so
    :meth:`restart_node` brings a node back with its data and its slots.
    ``require_full_coverage=False`` keeps the other nodes serving while one is down.
    """

    def __init__(self, data_dir: str | os.PathLike, nodes: int = 3, *, password: str | None = None,
                 node_timeout_ms: int = 2000, startup_timeout_s: float = 30.0) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        self.data_dir = Path(data_dir).resolve()
        self.num_nodes = nodes
        self.password = password or secrets.token_urlsafe(24)
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout_s = startup_timeout_s
        self.ports = [_free_cluster_port() for _ in range(nodes)]
        self.processes: list[subprocess.Popen | None] = [None] * nodes

    # -- addressing --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """A seed URL (the first node)."""
        return self.node_url(0)

    def node_url(self, i: int) -> str:
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.ports[i]}/0"

    def node_client(self, i: int) -> redis.Redis:
        return connect(self.node_url(i))

    def client(self, **kwargs) -> redis.cluster.RedisCluster:
        return connect_redis(self.url, cluster=True, **kwargs)

    def node_for_key(self, key: str) -> int:
        """Index of the node serving ``key``'s slot."""
        return self._slot_owner(redis.cluster.key_slot(key.encode()))

    def _slot_range(self, i: int) -> tuple[int, int]:
        lo = i * NUM_SLOTS // self.num_nodes
        hi = (i + 1) * NUM_SLOTS // self.num_nodes - 1
        return lo, hi

    def _slot_owner(self, slot: int) -> int:
        for i in range(self.num_nodes):
            lo, hi = self._slot_range(i)
            if lo <= slot <= hi:
                return i
        raise ValueError(f"slot {slot} out of range")

    # -- lifecycle ---------------------------------------------------------------------------
    def _start_node(self, i: int) -> None:
        node_dir = self.data_dir / f"node-{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(server_binary()),
            "--bind", "127.0.0.1", "--port", str(self.ports[i]), "--protected-mode", "yes",
            "--dir", str(node_dir), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--daemonize", "no", "--logfile", str(node_dir / "server.log"),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--requirepass", self.password, "--masterauth", self.password,
        ]
        self.processes[i] = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._wait_node(i)

    def _wait_node(self, i: int) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            proc = self.processes[i]
            if proc is not None and proc.poll() is not None:
                log = self.data_dir / f"node-{i}" / "server.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise ServerError(f"cluster node {i} exited with code {proc.returncode} at start:\n{tail}")
            try:
                client = self.node_client(i)
                try:
                    if client.info("persistence").get("loading", 0) == 0:
                        return
                finally:
                    client.close()
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError, OSError) as exc:
                last = exc
            time.sleep(0.05)
        raise ServerError(f"cluster node {i} did not answer within {self.startup_timeout_s}s: {last}")

    def start(self) -> "LocalCluster":
        fresh = not (self.data_dir / "node-0" / "nodes.conf").exists()
        atexit.register(self.stop)
        for i in range(self.num_nodes):
            self._start_node(i)
        if fresh:
            for i in range(self.num_nodes):
                client = self.node_client(i)
                lo, hi = self._slot_range(i)
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                client.close()
            first = self.node_client(0)
            for i in range(1, self.num_nodes):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[i])
            first.close()
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Wait until every node says the cluster is ok and knows every other node."""
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        state = ""
        while time.monotonic() < deadline:
            states = []
            for i in range(self.num_nodes):
                try:
                    client = self.node_client(i)
                    info = client.execute_command("CLUSTER", "INFO")
                    client.close()
                except (redis.exceptions.RedisError, OSError) as exc:
                    states.append(f"node {i}: {exc}")
                    continue
                text = info.decode() if isinstance(info, bytes) else str(info)
                fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                ok = (fields.get("cluster_state") == "ok"
                      and int(fields.get("cluster_known_nodes", 0)) == self.num_nodes
                      and int(fields.get("cluster_slots_ok", 0)) == NUM_SLOTS)
                states.append("ok" if ok else f"node {i}: {fields.get('cluster_state')}, "
                              f"{fields.get('cluster_known_nodes')} known, {fields.get('cluster_slots_ok')} slots ok")
            if all(s == "ok" for s in states):
                return
            state = "; ".join(s for s in states if s != "ok")
            time.sleep(0.1)
        raise ServerError(f"cluster not ok after {timeout_s or self.startup_timeout_s}s: {state}")

    def stop_node(self, i: int, timeout_s: float = 10.0) -> None:
        proc, self.processes[i] = self.processes[i], None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # fsyncs the append-only file
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def restart_node(self, i: int, down_s: float = 0.0) -> None:
        """Stop node ``i`` (its slots are unavailable meanwhile), wait ``down_s``, start it again."""
        self.stop_node(i)
        time.sleep(down_s)
        self._start_node(i)
        self.wait_ok()

    def stop(self) -> None:
        for i in range(self.num_nodes):
            self.stop_node(i)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
