"""Workers forked from the warm template (mqinfer.warm_start): what their owner and the system see is
what a cold `python -P -m mqinfer ...` child would show, and they do not outlive their owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mqinfer.procs import mqinfer_command
from mqinfer.warm_start import SHARED, SWITCH, WarmProcess, WarmStarter
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm start is Linux-only")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def starter(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    s = WarmStarter()
    yield s
    s.close()


def test_a_forked_command_ends_as_the_cold_one(starter, tmp_path):
    env = dict(os.environ, MQINFER_LOG_LEVEL="bogus")
    outputs = []
    for start in (starter.popen, subprocess.Popen):
        with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
            proc = start(mqinfer_command("compact", "x"), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            code = proc.wait(timeout=120)
            out.seek(0)
            err.seek(0)
            outputs.append((type(proc), code, out.read(), err.read()))
    (forked_type, *forked), (_, *cold) = outputs
    assert forked_type is WarmProcess
    assert forked == cold
    assert cold[0] == 2 and "MQINFER_LOG_LEVEL" in cold[2]


def test_a_forked_worker_is_the_templates_child_with_its_own_command_line_and_status(starter, tmp_path):
    argv = mqinfer_command("redis", "--dir", str(tmp_path / "data"))
    with open(tmp_path / "log", "w") as log:
        proc = starter.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        assert isinstance(proc, WarmProcess)
        wait_until(lambda: "redis://" in (tmp_path / "log").read_text(), timeout=60, what="the server's URL")
        assert int(_stat(proc.pid)[1]) == starter.template_pid  # its parent
        assert int(_stat(proc.pid)[3]) == proc.pid  # start_new_session: it leads its own session
        shown = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert [p.decode() for p in shown if p] == argv
        assert proc.poll() is None
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from mqinfer.procs import mqinfer_command
    from mqinfer.warm_start import WarmStarter

    starter = WarmStarter()
    with open(sys.argv[2], "w") as log:
        proc = starter.popen(mqinfer_command("redis", "--dir", sys.argv[1]), stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log)
    print(type(proc).__name__, proc.pid, starter.template_pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def shared_template(tmp_path):
    """A template serving several owners on a socket, started as a user would (``--tiny --listen
    PATH``: it starts again with room for its workers' command lines, the option kept)."""
    path = str(tmp_path / "template.sock")
    proc = subprocess.Popen([sys.executable, "-m", "mqinfer.warm_template", "--tiny", "--listen", path],
                            stdin=subprocess.DEVNULL)
    wait_until(lambda: os.path.exists(path), timeout=30, what="the template's socket")
    yield path, proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("shared", [False, True], ids=["own-template", "shared-template"])
def test_forked_workers_die_with_their_owner(tmp_path, request, shared):
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, SHARED)}
    template_proc = None
    if shared:
        env[SHARED], template_proc = request.getfixturevalue("shared_template")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "data"), str(tmp_path / "log")], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        kind, pid, template = owner.stdout.readline().split()
        pid, template = int(pid), int(template)
        assert kind == "WarmProcess" and int(_stat(pid)[1]) == template
        if shared:
            assert template == template_proc.pid
        wait_until(lambda: "redis://" in (tmp_path / "log").read_text(), timeout=60, what="the server's URL")
        shown = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert [p.decode() for p in shown if p] == mqinfer_command("redis", "--dir", str(tmp_path / "data"))
        owner.kill()  # SIGKILL: no chance to stop anything itself
        owner.wait()
        wait_until(lambda: not _alive(pid), timeout=30, what="the command forked for it to exit")
        # Its own template goes with it; a shared one serves on.
        wait_until(lambda: _alive(template) == shared, timeout=30, what="the template to go, or stay")
    finally:
        if owner.poll() is None:
            owner.kill()


def test_commands_it_cannot_fork_start_cold(starter, monkeypatch):
    cold = starter.popen(mqinfer_command("--version"), env=dict(os.environ, OMP_WAIT_POLICY="passive"),
                         stdout=subprocess.DEVNULL)
    assert type(cold) is subprocess.Popen and cold.wait(timeout=120) == 0
    piped = starter.popen(mqinfer_command("--version"), stdout=subprocess.PIPE)
    assert type(piped) is subprocess.Popen and piped.communicate(timeout=120)[0].startswith(b"mqinfer ")
    other = starter.popen([sys.executable, "-c", "pass"])
    assert type(other) is subprocess.Popen and other.wait(timeout=120) == 0
    # A count of threads is no obstacle: the child sets it.
    forked = starter.popen(mqinfer_command("--version"), env=dict(os.environ, OMP_NUM_THREADS="3"),
                           stdout=subprocess.DEVNULL)
    assert type(forked) is WarmProcess and forked.wait(timeout=120) == 0
    monkeypatch.setenv(SWITCH, "0")
    off = WarmStarter()
    proc = off.popen(mqinfer_command("--version"), stdout=subprocess.DEVNULL)
    assert type(proc) is subprocess.Popen and proc.wait(timeout=120) == 0
    assert off.template_pid is None


def test_a_worker_whose_template_dies_ends_and_its_owner_is_told(tmp_path):
    starter = WarmStarter(warm=True, shared=False)
    with open(tmp_path / "log", "w") as log:
        proc = starter.popen(mqinfer_command("redis", "--dir", str(tmp_path / "data")), stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log)
    try:
        assert isinstance(proc, WarmProcess)
        wait_until(lambda: "redis://" in (tmp_path / "log").read_text(), timeout=60, what="the server's URL")
        os.kill(starter.template_pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # it got SIGTERM (PDEATHSIG) and is gone
        assert not _alive(proc.pid)
        assert proc.poll() == -signal.SIGTERM
    finally:
        if _alive(proc.pid):
            os.kill(proc.pid, signal.SIGKILL)
        starter.close()


def test_a_run_gives_the_same_greedy_rows_with_forked_and_cold_workers(tmp_path):
    from tests import zygote
    from tests.helpers import mqinfer_cmd, rows, write_jsonl

    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"r{i}", "prompt": f"request {i}: say something", "max_tokens": 12, "temperature": 0} for i in range(6)])
    texts = {}
    for warm in ("1", "0"):
        out = tmp_path / f"out-{warm}"
        env = dict(os.environ, MQINFER_WARM_START=warm, MQINFER_WORKERS="2", OMP_NUM_THREADS="1")
        done = zygote.run(mqinfer_cmd("run", str(src), "--out", str(out)), env=env, capture_output=True, text=True,
                          timeout=300)
        assert done.returncode == 0, done.stderr
        texts[warm] = {r["id"]: (r["text"], r["output_tokens"]) for r in rows(out / "results")}
    assert len(texts["1"]) == 6 and texts["1"] == texts["0"]


def test_a_tensor_parallel_rank_is_forked_and_killed_with_its_owner(starter, tmp_path):
    """A worker's other ranks come from the template too (its entry points), over the pipes the
    worker hands it; a rank ignores SIGTERM, so it gets SIGKILL when its owner's connection ends."""
    argv = [*mqinfer_command()[:-1], "mqinfer.workers.engine.tp_rank", "--init", f"file://{tmp_path / 'rendezvous'}",
            "--rank", "1", "--size", "2", "--device", "cpu"]
    to_rank, from_rank = os.pipe(), os.pipe()
    proc = starter.popen(argv, stdin=to_rank[0], stdout=from_rank[1], death_signal=signal.SIGKILL)
    for fd in (to_rank[0], from_rank[1]):
        os.close(fd)
    try:
        assert isinstance(proc, WarmProcess)
        with os.fdopen(from_rank[0], "rb") as said:
            assert said.readline() == b"started\n"  # the rank's own entry point ran in the fork
        assert int(_stat(proc.pid)[1]) == starter.template_pid
        shown = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert [p.decode() for p in shown if p] == argv
        os.kill(proc.pid, signal.SIGTERM)  # ignored: its worker decides when it stops
        time.sleep(0.5)
        assert _alive(proc.pid) and proc.poll() is None
        starter.close()  # the owner's connection ends, as when the owner dies
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        os.close(to_rank[1])
        if _alive(proc.pid):
            os.kill(proc.pid, signal.SIGKILL)
