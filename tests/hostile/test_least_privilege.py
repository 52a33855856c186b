"""Least privilege: the ACL users of ops/acl/users.acl, a worker run under its user, TLS (rediss://),
the metrics endpoint on loopback only, and no pickle on anything that crosses Redis."""

from __future__ import annotations

import ast
import secrets
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from mqinfer.ops.jobs import JobsWorker
from mqinfer.schemas import keys
from mqinfer.client import Client, Producer
from mqinfer.server import _free_port, server_binary
from tests import zygote
from tests.faults.faultkit import STREAM, pending_by_consumer, requests, spawn, submit
from tests.helpers import mqinfer_cmd, rows, wait_until

ROOT = Path(__file__).resolve().parents[2]
ACL_FILE = ROOT / "ops" / "acl" / "users.acl"
USERS = ("admin", "producer", "worker", "rq")


def _acl_text(passwords: dict[str, str]) -> str:
    text = ACL_FILE.read_text()
    for user, password in passwords.items():
        placeholder = f">change-me-{user}"
        assert placeholder in text, f"{ACL_FILE} has no {placeholder}"
        text = text.replace(placeholder, f">{password}")
    return text


class AclServer:
    """The embedded server's binary started with ops/acl/users.acl as its ACL file."""

    def __init__(self, folder: Path) -> None:
        self.passwords = {user: secrets.token_urlsafe(18) for user in USERS}
        folder.mkdir(parents=True, exist_ok=True)
        acl = folder / "users.acl"
        acl.write_text(_acl_text(self.passwords))
        acl.chmod(0o600)
        self.port = _free_port()
        self.process = subprocess.Popen(
            [str(server_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--aclfile", str(acl),
             "--save", "", "--appendonly", "no", "--dir", str(folder)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        wait_until(self._up, timeout=15, what="the ACL server")

    def _up(self) -> bool:
        try:
            return self.client("admin").ping()
        except redis.exceptions.ConnectionError:
            return False

    def url(self, user: str) -> str:
        return f"redis://{user}:{quote(self.passwords[user], safe='')}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture
def acl_server(tmp_path):
    server = AclServer(tmp_path / "redis")
    yield server
    server.stop()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, port_hex = local.partition(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_unauthenticated_clients_are_refused_by_the_acl_file(acl_server):
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=acl_server.port).ping()


def test_worker_runs_under_its_acl_user_and_is_refused_anything_else(acl_server, tmp_path):
    expected = submit(acl_server.url("producer"), requests("acl", 5, 4))
    out = tmp_path / "out"
    worker = spawn(acl_server.url("worker"), out, "W", "--claim-idle-ms", "1000", "--metrics-port", "0",
                   log_level="info")
    admin = acl_server.client("admin")
    try:
        port = worker.metrics_port()
        # The streaming client as the producer: back-pressure reads, replies, a cancel, its reply
        # stream deleted when it closes.
        with Client(acl_server.url("producer"), max_backlog=100) as client:
            # One of them in a lane of its own (a tenant other than the default).
            streamed = requests("acl-client", 2, 4)
            streamed[1]["tenant"] = "acl-lane"
            client.submit_many(streamed)
            for item in streamed:
                assert client.result(item["id"], timeout=60, job_id="acl-client").output_tokens == 4
            client.cancel("never-sent", job_id="acl-client")
        expected |= {("acl-client", item["id"]) for item in streamed}
        wait_until(lambda: len(rows(out / "results")) >= 7 and not pending_by_consumer(admin), timeout=60,
                   what="the worker to finish under its ACL user")
        # The metrics endpoint listens on loopback only, as the default says.
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex
        assert b"mqinfer_result_rows_written_total" in _http_get(port)
    finally:
        worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.log()
    assert "NOPERM" not in worker.log() and "noperm" not in worker.log().lower()
    assert {(r["job_id"], r["id"]) for r in rows(out / "results")} == expected
    denied = [e for e in _acl_log(admin) if e[b"username"] in (b"worker", b"producer")]
    assert denied == []  # the worker and the producer needed nothing their users lack

    w = acl_server.client("worker")
    for refused in (lambda: w.flushall(), lambda: w.get("session:admin"), lambda: w.set("other", "x"),
                    lambda: w.keys("*"), lambda: w.config_get("*"), lambda: w.delete(STREAM),
                    lambda: w.xadd("other:stream", {"a": 1}), lambda: w.execute_command("SHUTDOWN"),
                    lambda: w.delete(keys.inflight_hash("requests:lane:x"))):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    p = acl_server.client("producer")
    for refused in (lambda: p.xreadgroup(keys.GROUP, "x", {STREAM: ">"}), lambda: p.xrange(STREAM),
                    lambda: p.xadd(keys.request_stream("other"), {"a": 1}), lambda: p.flushall(),
                    lambda: p.xack(STREAM, keys.GROUP, "0-1"), lambda: p.xadd("mqinfer:reply:mine", {"a": 1}),
                    lambda: p.delete(STREAM), lambda: p.expire(STREAM, 1), lambda: p.xtrim(STREAM, maxlen=0),
                    lambda: p.xadd(keys.dead_letter_stream("requests"), {"a": 1}), lambda: p.zadd("other", {"a": 1}),
                    lambda: p.xadd(keys.inflight_hash("requests:lane:x"), {"a": 1}),
                    lambda: p.xrange(keys.request_stream("requests:lane:x")),
                    lambda: p.xadd(keys.request_stream("other:lane:x"), {"a": 1}),
                    lambda: p.delete(keys.request_stream("requests:lane:x"))):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    admin.xadd("mqinfer:reply:mine", {"token": 1})
    assert len(p.xread({"mqinfer:reply:mine": "0"})[0][1]) == 1  # producers read their replies


def _acl_log(admin) -> list[dict]:
    return admin.execute_command("ACL", "LOG", "100")


def _http_get(port: int) -> bytes:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read()


def test_rate_limits_run_under_the_worker_user_and_a_user_without_them_refuses_to_start(acl_server, tmp_path):
    """The worker user may run the bucket script (every command in it is checked against the
    user); a worker whose user may not (an ACL file written without the script's commands) does not
    serve unlimited: it exits 2 with a message before it loads its model."""
    from mqinfer.workers.queue.buckets import TokenBuckets
    from mqinfer.workers.tenant_limits import TenantLimit

    buckets = TokenBuckets(acl_server.client("worker"), {"gold": TenantLimit(100, 1)})
    buckets.check()
    assert buckets.take("gold", [10, 10]) == (1, pytest.approx(1.0, abs=0.01))
    worker_rules = next(line for line in ACL_FILE.read_text().splitlines() if line.startswith("user worker "))
    rules = [r for r in worker_rules.split()[2:] if not r.startswith(">") and r not in ("+time", "+hmget", "+pexpire")]
    admin = acl_server.client("admin")
    admin.execute_command("ACL", "SETUSER", "oldworker", "reset", ">old-password", *rules)
    proc = zygote.run([*mqinfer_cmd("worker"), "--redis", f"redis://oldworker:old-password@127.0.0.1:"
                       f"{acl_server.port}/0", "--out", str(tmp_path / "out"), "--tenant-limits", "gold=100"],
                      capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--tenant-limits cannot be enforced: this Redis user may not run the rate-limit script" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr.lower()


class _InProcessWorker(SimpleWorker):
    """rq's in-process worker, listening on its command channel as `mqinfer jobs worker` does:
    rq's own listener polls once a minute, and its exit could wait for that poll."""

    subscribe = JobsWorker.subscribe


def test_rq_user_runs_a_json_job_and_nothing_else(acl_server):
    client = acl_server.client("rq")
    queue = Queue("mqinfer-jobs", connection=client, serializer=JSONSerializer)
    job = queue.enqueue("builtins.len", [1, 2, 3])
    _InProcessWorker([queue], connection=client, serializer=JSONSerializer).work(burst=True)
    job.refresh()
    assert job.return_value() == 3
    for refused in (lambda: client.flushall(), lambda: client.get("session:admin"),
                    lambda: client.config_set("dir", "/tmp"), lambda: client.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()


# -- TLS ----------------------------------------------------------------------------------------


def _tls_server(folder: Path, password: str) -> tuple[subprocess.Popen, int, Path] | str:
    """A TLS-only server with a fresh self-signed certificate, or the reason there can be none."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return "no openssl command to make a certificate"
    cert, key = folder / "cert.pem", folder / "key.pem"
    made = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                           "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                           "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, text=True)
    if made.returncode != 0:
        return f"openssl could not make a certificate: {made.stderr.strip()[-300:]}"
    reasons = []
    for binary in (str(server_binary()), shutil.which("redis-server"), shutil.which("valkey-server")):
        if not binary:
            continue
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(cert),
             "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
             "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(folder)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

        def listening_or_exited() -> str | None:
            if proc.poll() is not None:
                return "exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            except OSError:
                return None
            return "listening"

        try:
            state = wait_until(listening_or_exited, timeout=10, what=f"{binary} to listen")
        except AssertionError:
            state = "timed out"
        if state == "listening":
            return proc, port, cert
        proc.kill()
        output = proc.communicate()[0]
        reasons.append(f"{binary}: {output.strip().splitlines()[-1] if output.strip() else 'did not start'}")
    return ("no server binary with TLS support (" + "; ".join(reasons) + "); install Debian's redis-server "
            "(apt-get install -y redis-server) to run this test")


def test_worker_over_rediss_against_a_tls_server(tmp_path):
    password = secrets.token_urlsafe(18)
    started = _tls_server(tmp_path, password)
    if isinstance(started, str):
        pytest.skip(started)
    proc, port, cert = started
    try:
        url = f"rediss://:{quote(password, safe='')}@127.0.0.1:{port}/0?ssl_ca_certs={quote(str(cert))}"
        expected = submit(url, requests("tls", 4, 4))
        out = tmp_path / "out"
        worker = spawn(url, out, "T", "--claim-idle-ms", "1000", "--idle-exit-s", "1.5")
        assert worker.wait() == 0, worker.log()
        assert {(r["job_id"], r["id"]) for r in rows(out / "results")} == expected
        # Without the certificate's authority the connection is refused; plain text gets nowhere.
        untrusted = redis.Redis.from_url(f"rediss://:{quote(password, safe='')}@127.0.0.1:{port}/0")
        with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
            untrusted.ping()
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2).ping()
        assert Producer(url).redis.xlen(STREAM) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- defaults and no pickle -----------------------------------------------------------------------


def test_metrics_bind_loopback_unless_told_otherwise():
    from mqinfer.config import WORKER_OPTIONS

    assert {o.name: o.default for o in WORKER_OPTIONS}["metrics_host"] == "127.0.0.1"
    from mqinfer.ops.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    port = metrics.serve(0)
    try:
        assert _listening_addresses(port) == {"0100007F"}
    finally:
        metrics.close()


UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}
RQ_CLASSES = {"Queue", "Worker", "SimpleWorker", "Job"}
PACKAGE_FOLDERS = ("mqinfer", "workers", "scheduler", "kernels", "schemas", "ops", "loadgen")


def _rq_names(tree: ast.AST) -> set[str]:
    """Names bound to rq's job/queue/worker classes by a module's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rq":
            names |= {alias.asname or alias.name for alias in node.names if alias.name in RQ_CLASSES}
    return names


def test_no_pickle_anywhere_and_rq_always_uses_its_json_serializer():
    offenders = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            rq_classes = _rq_names(tree)
            where = f"{path.relative_to(ROOT)}"
            for node in ast.walk(tree):
                imported = []
                if isinstance(node, ast.Import):
                    imported = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    imported = [node.module.split(".")[0]]
                if UNSAFE_MODULES & set(imported):
                    offenders.append(f"{where}:{node.lineno} imports {imported}")
                if isinstance(node, ast.Call):
                    func = node.func
                    called = (func.id if isinstance(func, ast.Name) and func.id in rq_classes else
                              func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                              and func.value.id == "rq" and func.attr in RQ_CLASSES else None)
                    # A subclass passes serializer= in its super().__init__; a class built with
                    # **kwargs cannot be judged here and is left to review.
                    keywords = {k.arg for k in node.keywords}
                    if called and "serializer" not in keywords and None not in keywords:
                        offenders.append(f"{where}:{node.lineno} builds rq's {called} without serializer= "
                                         "(rq's default serializer is pickle)")
    assert offenders == []
